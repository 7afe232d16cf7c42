"""Base SFT: a tiny K3 hybrid trained from scratch on the experts' traces, saved as an HF checkpoint."""

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mopd.base import base_checkpoint, build_base
from mopd.base.sft import corrupt
from mopd.envs import get_env
from mopd.envs.chat import messages_for, render_task_prompt
from mopd.pipeline import StageContext
from mopd.recipe import RecipeError, load_recipe
from mopd.rollout.interface import CheckpointError

ROOT = Path(__file__).resolve().parent.parent
SMALL_SFT = (
    "base.sft={examples: 90, steps: 8, batch_size: 8, learning_rate: 3.0e-3, noise: 0.5, mix: {general: 1.0}, "
    "vocab_size: 300}"
)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    recipe = load_recipe(ROOT / "recipes/smoke.yaml", [SMALL_SFT])
    build_base(StageContext(recipe, run_dir, run_dir / "base"))
    return recipe, run_dir


def test_base_is_an_hf_checkpoint_with_tokenizer_and_chat_template(built):
    recipe, run_dir = built
    path = base_checkpoint(recipe, run_dir)
    assert path == run_dir / "base"
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "k3_hybrid" and model.config.vocab_size == len(tokenizer) == 300
    task = get_env("general").sample(1, seed=3, split="dev", effort="max")[0]
    rendered = tokenizer.apply_chat_template(
        messages_for(task.prompt), effort="max", add_generation_prompt=True, tokenize=False
    )
    assert rendered == render_task_prompt(task)
    ids = tokenizer.encode(rendered, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()


def test_sft_learns_and_corrupts_the_requested_fraction(built):
    _, run_dir = built
    losses = [json.loads(line)["loss"] for line in (run_dir / "base/metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5
    report = json.loads((run_dir / "base/sft.json").read_text())
    assert report["examples"] >= 90 and 0.3 < report["corrupted"] / report["examples"] < 0.7


@pytest.mark.parametrize("domain", ["general", "agent", "code"])
def test_a_corrupted_trace_fails_its_verifier(domain):
    env = get_env(domain)
    corrupted = 0
    for task in env.sample(4, seed=2, split="train", effort="high"):
        solution = env.solve(task)
        turns = solution if isinstance(solution, list) else [{"role": "assistant", "content": solution}]
        wrong = corrupt(env, task, turns, random.Random(0))
        if wrong is None:  # no digit of the answer matters (e.g. code without numbers)
            continue
        corrupted += 1
        changed = [(a["content"], b["content"]) for a, b in zip(turns, wrong, strict=True) if a != b]
        assert len(changed) == 1 and sum(x != y for x, y in zip(*changed[0], strict=True)) == 1
        attempt = wrong if isinstance(solution, list) else wrong[0]["content"]
        assert env.verify(task, attempt).reward == 0.0, task.prompt
    assert corrupted >= 2


def test_a_named_checkpoint_is_checked_not_trained(built, tmp_path):
    _, run_dir = built
    named = load_recipe(ROOT / "recipes/smoke.yaml", [f"base.checkpoint={run_dir / 'base'}"])
    build_base(StageContext(named, tmp_path, tmp_path / "base"))
    assert base_checkpoint(named, tmp_path) == run_dir / "base"
    assert not (tmp_path / "base" / "model.safetensors").exists()
    broken = load_recipe(ROOT / "recipes/smoke.yaml", [f"base.checkpoint={tmp_path}"])
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        build_base(StageContext(broken, tmp_path, tmp_path / "base2"))


def test_sft_mix_typos_are_clear_errors():
    with pytest.raises(RecipeError, match="mix"):
        load_recipe(ROOT / "recipes/smoke.yaml", ["base.sft.mix={genral: 1.0}"])
    with pytest.raises(RecipeError, match=r"unknown field `base\.sft\.nosie`"):
        load_recipe(ROOT / "recipes/smoke.yaml", ["base.sft.nosie=0.2"])


def test_batches_group_similar_lengths_within_the_token_budget():
    from mopd.base.sft import length_grouped_batches
    from mopd.recipe import SFTSpec

    lengths = [25] * 300 + [400] * 30  # sums and agent transcripts
    examples = [{"input_ids": [0] * n, "index": i} for i, n in enumerate(lengths)]
    sft = SFTSpec(batch_size=64, batch_tokens=2048)
    batches = length_grouped_batches(examples, sft, random.Random(0))
    epoch = [next(batches) for _ in range(300 // 64 + 1 + 30 // 5)]  # sums: ⌈300/64⌉; agents: 30/5
    seen = sorted(e["index"] for batch in epoch for e in batch)
    assert seen == list(range(len(lengths)))  # one epoch: every example exactly once
    for batch in epoch:
        width = max(len(e["input_ids"]) for e in batch)
        assert len(batch) <= 64 and len(batch) * width <= 2048
        assert len({len(e["input_ids"]) for e in batch}) == 1  # a short one is never padded to 400
