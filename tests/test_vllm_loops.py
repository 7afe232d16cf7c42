"""vLLM inside the training loops: every GRPO and MOPD step's weights reach the rollout engine.

The loops run as the pipeline runs them, on the vLLM backend; the engine they create is the real
one, watched: after each weight push it records its policy version and its log-probs of one fixed
sequence, beside the HF model's log-probs for the very weights pushed.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import mopd.distill.trainer
import mopd.rl.grpo
from mopd.base import build_base
from mopd.distill.trainer import train_mopd
from mopd.model import K3HybridForCausalLM, preset_config
from mopd.pipeline import StageContext
from mopd.recipe import DistillSpec, load_recipe, load_teacher_specs
from mopd.rl.grpo import train_teacher
from mopd.rollout.engine import create_engine
from mopd.rollout.vllm_backend import VllmEngine
from tests.fakes import seeded_copy

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-4
CHANGED = 1e-3
# reasoning-gym's GCD scores an answer that contains the right one by its share of the answer, so a
# briefly fitted base earns small, unequal rewards: 16 of 24 groups of 8 had a learning signal when
# measured. With 4 groups the first step has a gradient but for a ~1% draw, and Adam's momentum
# moves the weights in every later step, signal or not.
GCD = [
    "rollout=vllm",
    "envs={general: {families: [rg/gcd]}}",
    "base.sft={examples: 100, steps: 20, batch_size: 8, mix: {general: 1.0}}",
]


@dataclass
class Push:
    version: int
    engine: torch.Tensor  # the engine's log-probs of the probe sequence after the push
    hf: torch.Tensor  # the HF model's, with the weights pushed


class WatchedEngine(VllmEngine):
    """The vLLM engine of a training loop, observed after each `update_weights` (and at start)."""

    def __init__(self, model_dir, probe: tuple[list[int], list[int]]):
        super().__init__(model_dir, max_model_len=512, max_num_seqs=16, kv_cache_memory_bytes=1 << 27)
        self.probe = probe
        self.hf = K3HybridForCausalLM.from_pretrained(model_dir).eval()
        self.pushes = [self.observe(self.hf.state_dict())]

    def update_weights(self, state_dict) -> int:
        version = super().update_weights(state_dict)
        self.pushes.append(self.observe(state_dict))
        return version

    def observe(self, state_dict) -> Push:
        self.hf.load_state_dict(state_dict)
        engine = torch.tensor(self.score([self.probe[0]], [self.probe[1]])[0])
        return Push(self.policy_version, engine, hf_logprobs(self.hf, *self.probe))


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def probe_sequence(model_dir: Path) -> tuple[list[int], list[int]]:
    """A fixed prompt of 12 tokens and completion of 20, drawn from the model's vocabulary."""
    vocab = K3HybridForCausalLM.config_class.from_pretrained(model_dir).vocab_size
    tokens = torch.randint(3, vocab, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    return tokens[:12], tokens[12:]


@pytest.fixture
def watched(monkeypatch):
    """Every vLLM engine the loops create is a WatchedEngine (HF engines stay as they are)."""
    engines: list[WatchedEngine] = []

    def create(model_dir, backend="vllm", **kwargs):
        if backend != "vllm":
            return create_engine(model_dir, backend=backend, **kwargs)
        engines.append(WatchedEngine(model_dir, probe_sequence(Path(model_dir))))
        return engines[-1]

    monkeypatch.setattr(mopd.rl.grpo, "create_engine", create)
    monkeypatch.setattr(mopd.distill.trainer, "create_engine", create)
    yield engines
    for engine in engines:
        engine.close()


def assert_pushed_and_changed(pushes: list[Push], versions: list[int], unchanged: tuple[int, ...] = ()) -> None:
    """One push per expected version; each one moved the engine to exactly the pushed weights, and
    each one but those `unchanged` (a push of the weights already there) changed its log-probs."""
    assert [push.version for push in pushes] == versions
    for push in pushes:
        torch.testing.assert_close(push.engine, push.hf, atol=TOL, rtol=0)
    for k, (before, after) in enumerate(itertools.pairwise(pushes), start=1):
        change = (after.engine - before.engine).abs().max().item()
        assert (change < TOL) if k in unchanged else (change > CHANGED), (k, change)


def test_grpo_pushes_every_step_into_vllm(watched, tmp_path):
    recipe = load_recipe(ROOT / "recipes/smoke.yaml", [
        *GCD, "teachers.common={steps: 3, prompts_per_step: 4, group_size: 8, checkpoint_every: 1, budget_tokens: 64}",
    ])  # fmt: skip
    build_base(StageContext(recipe, tmp_path, tmp_path / "base"))
    spec = load_teacher_specs(recipe)["general-low"]
    train_teacher(spec, recipe, tmp_path / "base", tmp_path / "teacher")

    (engine,) = watched
    assert engine.closed  # shut down by the loop: left to the GC, its teardown can break the process's next engine
    rows = [json.loads(line) for line in (tmp_path / "teacher/metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert rows[0]["grad_norm"] > 0, "no learning signal in step 1: the weights would not change"
    # before step k's rollouts the trainer pushes its weights after step k-1: the first push is the
    # initial weights again, the last step's weights are saved but never sampled from
    assert_pushed_and_changed(engine.pushes, versions=[0, 1, 2, 3], unchanged=(1,))
    step2 = K3HybridForCausalLM.from_pretrained(tmp_path / "teacher/checkpoints/checkpoint-2").eval()
    torch.testing.assert_close(engine.pushes[3].engine, hf_logprobs(step2, *engine.probe), atol=TOL, rtol=0)


def test_mopd_pushes_every_step_into_vllm(watched, tmp_path, tiny_tokenizer):
    torch.manual_seed(0)
    model = K3HybridForCausalLM(preset_config("tiny", num_hidden_layers=2, vocab_size=len(tiny_tokenizer)))
    model.save_pretrained(tmp_path / "student")
    tiny_tokenizer.save_pretrained(tmp_path / "student")
    cells = ["general-low", "general-high"]
    teachers = {cell: seeded_copy(tmp_path / "student", tmp_path / cell, seed=i + 1) for i, cell in enumerate(cells)}
    spec = DistillSpec(mix=dict.fromkeys(cells, 1.0), steps=2, prompts_per_step=4, teacher_actors=False)
    final = train_mopd(
        tmp_path / "student", teachers, spec, tmp_path / "mopd", efforts=load_recipe(ROOT / "recipes/smoke.yaml").efforts,
        env_options={"general": {"families": ["add"]}}, backend="vllm", progress=False,
    )  # fmt: skip

    (engine,) = watched
    assert engine.closed  # as GRPO's: the next engine of this process starts on a clean vLLM state
    rows = [json.loads(line) for line in (tmp_path / "mopd/metrics.jsonl").read_text().splitlines()]
    assert [row["policy_version"] for row in rows] == [0, 1]  # step 2 sampled from step 1's weights
    # the sampler's log-probs are the trainer's own: in step 2 too, after the push
    assert all(row["train_rollout_gap"] < 1e-4 for row in rows), [row["train_rollout_gap"] for row in rows]
    assert_pushed_and_changed(engine.pushes, versions=[0, 1, 2])
    student = K3HybridForCausalLM.from_pretrained(final).eval()
    torch.testing.assert_close(engine.pushes[2].engine, hf_logprobs(student, *engine.probe), atol=TOL, rtol=0)

