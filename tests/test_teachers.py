"""Teacher RL: GRPO on TRL with our rollout loop, per-step metrics, and Ray actors that survive a kill."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer

from mopd.base import build_base
from mopd.base.sft import expert_transcripts
from mopd.envs import get_env
from mopd.envs.chat import END
from mopd.envs.effort import default_effort_specs
from mopd.model import K3HybridForCausalLM
from mopd.pipeline import StageContext
from mopd.recipe import RecipeError, TeacherSpec, load_recipe, load_teacher_specs
from mopd.rl.grpo import (
    GroupRollouts,
    LengthSortedGRPOTrainer,
    TimedEnv,
    grpo_config,
    last_checkpoint,
    rows_with_learning_signal,
    shaped_reward,
    sorted_by_length,
    split_rows,
    teacher_tasks,
    train_teacher,
    trim_padding,
)
from mopd.rl.teachers import is_finished, select_cells, spec_hash, train_teachers
from mopd.rollout.interface import CheckpointError, Sample

ROOT = Path(__file__).resolve().parent.parent
BASE_SFT = "base.sft={examples: 60, steps: 3, batch_size: 8, mix: {general: 1.0}}"
LOGGED = {
    "reward",
    "pass_rate",
    "thinking_tokens",
    "answer_tokens",
    "over_budget_rate",
    "kl_init",
    "entropy",
    "time_generate",
    "time_verify",
    "time_train",
    "logp_gap",
    "logp_gap_max",
    "is_corrected_fraction",
}


def smoke_recipe(*overrides):
    return load_recipe(ROOT / "recipes/smoke.yaml", [BASE_SFT, "rollout=hf", *overrides])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    build_base(StageContext(smoke_recipe(), run, run / "base"))
    return run


def metric_steps(folder: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_grpo_logs_every_metric_each_step_and_saves_an_hf_teacher(run_dir, tmp_path):
    recipe = smoke_recipe(
        "teachers.common={steps: 2, prompts_per_step: 2, group_size: 2, checkpoint_every: 1, micro_batch_size: 2}"
    )
    spec = load_teacher_specs(recipe)["general-high"]  # two micro-batches of 2 rollouts per optimizer step
    train_teacher(spec, recipe, run_dir / "base", tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row.keys() >= LOGGED, LOGGED - row.keys()
        assert 0.0 <= row["pass_rate"] <= 1.0 and row["time_generate"] > 0 and row["time_train"] > 0
    assert abs(rows[0]["kl_init"]) < 1e-3  # step 1 samples from the initial weights themselves
    # the HF engine samples with the trainer's own weights: TRL's sampler correction has nothing to correct
    assert all(r["logp_gap_max"] < 1e-4 and r["is_corrected_fraction"] == 0.0 for r in rows)
    assert last_checkpoint(tmp_path / "checkpoints").endswith("checkpoint-2")
    assert AutoTokenizer.from_pretrained(tmp_path).chat_template is not None
    assert (tmp_path / "model.safetensors").is_file()
    # transformers' Trainer turns the cache off for training; the saved teacher keeps its base's setting
    assert json.loads((tmp_path / "config.json").read_text())["use_cache"] is True


def test_a_qat_teacher_samples_and_trains_on_the_same_mx_rounded_experts(run_dir, tmp_path):
    recipe = smoke_recipe(
        "teachers.common={steps: 1, prompts_per_step: 2, group_size: 2, qat: {experts: mxfp4, activations: mxfp8}}"
    )
    train_teacher(load_teacher_specs(recipe)["general-high"], recipe, run_dir / "base", tmp_path)
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["logp_gap_max"] < 1e-4  # the sampler's experts round exactly as the trainer's
    assert json.loads((tmp_path / "config.json").read_text())["routed_expert_mx"] == {"weights": "mxfp4", "activations": "mxfp8"}


def padded_rollouts(prompt_lengths, completion_lengths, width_prompt=6, width_completion=7):
    """A TRL-style batch: prompts left-padded, completions right-padded, token ids >= 3 where real."""
    rows = len(prompt_lengths)
    generator = torch.Generator().manual_seed(0)
    prompt_mask = torch.tensor([[0] * (width_prompt - n) + [1] * n for n in prompt_lengths])
    completion_mask = torch.tensor([[1] * n + [0] * (width_completion - n) for n in completion_lengths])
    return {
        "prompt_ids": torch.randint(3, 50, (rows, width_prompt), generator=generator) * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(3, 50, (rows, width_completion), generator=generator) * completion_mask,
        "completion_mask": completion_mask,
        "old_per_token_logps": torch.randn(rows, width_completion, generator=generator) * completion_mask,
        "advantages": torch.arange(rows, dtype=torch.float),
        "num_items_in_batch": torch.tensor(sum(completion_lengths)),
        "tags": [f"row{i}" for i in range(rows)],
        "pixel_values": None,
    }


def test_micro_batches_are_cut_by_length_and_trimmed_to_their_longest_rollout():
    batch = padded_rollouts(prompt_lengths=[4, 2, 3, 1], completion_lengths=[5, 1, 2, 3])
    ordered = sorted_by_length(batch)
    assert ordered["tags"] == ["row1", "row3", "row2", "row0"]  # total lengths 3, 4, 5, 9
    assert ordered["advantages"].tolist() == [1.0, 3.0, 2.0, 0.0]
    assert torch.equal(ordered["num_items_in_batch"], batch["num_items_in_batch"])

    short = trim_padding({key: value[:2] if key != "num_items_in_batch" and value is not None else value
                          for key, value in ordered.items()})
    assert short["prompt_ids"].shape == (2, 2) and short["completion_ids"].shape == (2, 3)
    assert short["old_per_token_logps"].shape == (2, 3) and short["advantages"].shape == (2,)
    assert short["prompt_mask"].sum() == ordered["prompt_mask"][:2].sum()  # only padding was dropped
    assert short["completion_mask"].sum() == ordered["completion_mask"][:2].sum()


def test_zero_advantage_rollouts_are_left_out_but_each_micro_batch_keeps_one():
    batch = padded_rollouts(prompt_lengths=[4, 2, 3, 1], completion_lengths=[5, 1, 2, 3])  # lengths 9, 3, 5, 4
    batch["advantages"] = torch.tensor([0.0, 0.0, 1.0, 0.0])
    assert rows_with_learning_signal(batch, at_least=1)["tags"] == ["row2"]
    assert rows_with_learning_signal(batch, at_least=3)["tags"] == ["row1", "row2", "row3"]  # + the 2 shortest
    parts = split_rows(batch, 3)  # an uneven split loses no rollout
    assert [part["tags"] for part in parts] == [["row0", "row1"], ["row2"], ["row3"]]
    assert all(torch.equal(part["num_items_in_batch"], batch["num_items_in_batch"]) for part in parts)


def test_leaving_out_zero_advantage_rollouts_keeps_the_gradient(run_dir, tmp_path):
    """DAPO normalises by the tokens of the whole step: rollouts with advantage 0 add nothing."""
    recipe = smoke_recipe("teachers.common={steps: 1, prompts_per_step: 2, group_size: 3, micro_batch_size: 3}")
    spec = load_teacher_specs(recipe)["general-high"]
    trainer = LengthSortedGRPOTrainer(
        model=K3HybridForCausalLM.from_pretrained(run_dir / "base"),
        reward_funcs=shaped_reward,
        args=grpo_config(spec, recipe, tmp_path, max_new_tokens=8),
        train_dataset=Dataset.from_dict({"prompt": ["task"]}),
        processing_class=AutoTokenizer.from_pretrained(run_dir / "base"),
        rollout_func=lambda prompts, trainer: {},
    )
    assert trainer.zero_advantage_is_silent() and trainer.args.steps_per_generation == 2
    batch = padded_rollouts(prompt_lengths=[4, 2, 3, 1, 5, 2], completion_lengths=[5, 1, 2, 3, 4, 6])
    del batch["old_per_token_logps"]  # on-policy: TRL takes the detached log-probs of the forward itself
    batch["advantages"] = torch.tensor([0.0, 1.2, 0.0, -0.7, 0.0, 0.5])

    def gradient(rollouts):
        trainer.model.train()
        trainer.model.zero_grad()
        trainer.current_gradient_accumulation_steps = 2
        for part in split_rows(sorted_by_length(rollouts), 2):
            trainer._compute_loss(trainer.model, trim_padding(part)).backward()
        return {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}

    every, with_signal = gradient(batch), gradient(rows_with_learning_signal(batch, at_least=2))
    assert len(rows_with_learning_signal(batch, at_least=2)["tags"]) == 3
    assert every.keys() == with_signal.keys() and any(g.abs().sum() > 0 for g in every.values())
    for name, grad in every.items():
        torch.testing.assert_close(with_signal[name], grad, atol=1e-7, rtol=1e-5, msg=name)


def test_trimming_padding_leaves_the_policy_log_probs_unchanged(run_dir):
    model = K3HybridForCausalLM.from_pretrained(run_dir / "base").eval()
    batch = padded_rollouts(prompt_lengths=[3, 2], completion_lengths=[2, 4], width_prompt=9, width_completion=11)
    trimmed = trim_padding(batch)

    def completion_logprobs(b):
        ids = torch.cat([b["prompt_ids"], b["completion_ids"]], dim=1)
        mask = torch.cat([b["prompt_mask"], b["completion_mask"]], dim=1)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits[:, b["prompt_ids"].shape[1] - 1 : -1]
        logprobs = logits.log_softmax(-1).gather(-1, b["completion_ids"][..., None]).squeeze(-1)
        return logprobs * b["completion_mask"]

    full = completion_logprobs(batch)
    assert trimmed["prompt_ids"].shape[1] == 3 and trimmed["completion_ids"].shape[1] == 4
    torch.testing.assert_close(completion_logprobs(trimmed), full[:, :4], atol=1e-5, rtol=1e-5)
    assert full[:, 4:].abs().sum() == 0


def test_rl_bench_compares_our_micro_batches_with_trls(run_dir, tmp_path):
    from benchmarks import grpo_step

    out = tmp_path / "rl.json"
    grpo_step.main([
        "--recipe", str(ROOT / "recipes/smoke.yaml"), "--base", str(run_dir / "base"), "--cells", "code-max",
        "--steps", "2", "--compare-trl-batches", "--out", str(out), "rollout=hf",
        "teachers.common={prompts_per_step: 2, group_size: 4, micro_batch_size: 2}",
    ])  # fmt: skip
    cell = json.loads(out.read_text())["cells"]["code-max"]
    ours, trl = cell["median_seconds"]["train"], cell["trl_micro_batches"]["median_seconds"]["train"]
    assert ours > 0 and trl > 0 and cell["train_seconds_trl_over_ours"] == pytest.approx(trl / ours)


class ExpertEngine:
    """Replays the expert's assistant turns as sampled tokens (log-prob −0.5 each)."""

    policy_version = 0

    def __init__(self, tokenizer, scripts):
        self.tokenizer, self.scripts = tokenizer, scripts

    def generate(self, prompt_ids, n=1, sampling=None):
        out = []
        for ids in prompt_ids:
            text = self.tokenizer.decode(ids)
            turns = next(turns for prompt, turns in self.scripts.items() if prompt in text)
            tokens = self.tokenizer.encode(
                turns[text.count("<|observation|>")] + END, add_special_tokens=False
            )
            out.append([Sample(tokens, [-0.5] * len(tokens), "stop", self.policy_version)])
        return out

    def score(self, prompt_ids, completion_ids):
        return [[-0.75] * len(c) for c in completion_ids]

    def update_weights(self, state_dict):
        self.policy_version += 1
        return self.policy_version


def test_rollout_func_masks_observations_and_reports_the_batch(run_dir):
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "base")
    env = get_env("agent")
    task = env.sample(1, seed=1, split="train", effort="high")[0]
    turns = [t["content"] for t in env.solve(task) if t["role"] == "assistant"]
    engine = ExpertEngine(tokenizer, {task.prompt: turns})
    rollouts = GroupRollouts(engine, engine, tokenizer, {"agent": env}, default_effort_specs(), {task.id: task}, 1.0)
    trainer = type("Trainer", (), {"state": type("State", (), {"global_step": 0}), "model": None})
    trainer.model = type("Model", (), {"state_dict": lambda self: {}})()
    out = rollouts([task.id, task.id], trainer)
    assert engine.policy_version == 1  # the trainer's weights were pushed before sampling
    assert out["reward"] == [1.0, 1.0] and len(out["completion_ids"]) == 2
    for ids, mask, logprobs in zip(out["completion_ids"], out["env_mask"], out["logprobs"], strict=True):
        generated = [t for t, m in zip(ids, mask, strict=True) if m]
        assert generated == [
            t for turn in turns for t in tokenizer.encode(turn + END, add_special_tokens=False)
        ]
        assert 0 in mask and all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m)
    stats = out["stats"]
    assert stats["pass_rate"] == 1.0 and stats["kl_init"] == pytest.approx(0.25)
    assert rollouts.seconds["verify"] > 0 and rollouts.seconds["generate"] > 0


def test_batched_environment_calls_count_as_verification_time():
    """The code env steps and verifies a turn's episodes in one call: that is verification time too."""

    class SlowBatches:
        domain = "code"

        def step_many(self, states, texts):
            time.sleep(0.05)
            return [(None, True)] * len(states)

        def verify_many(self, tasks, attempts):
            time.sleep(0.05)
            return []

    env = TimedEnv(SlowBatches())
    assert env.step_many([1], ["text"]) == [(None, True)] and env.verify_many([], []) == []
    assert env.seconds >= 0.1


def test_a_killed_teacher_resumes_from_its_last_checkpoint(run_dir):
    recipe = smoke_recipe(
        "ray.num_cpus=1",  # one actor at a time: general-high waits for general-low's CPU
        "teachers.general-high.steps=1",
        "teachers.common={steps: 4, prompts_per_step: 1, group_size: 2, checkpoint_every: 2, eval_tasks: 2,"
        " eval_samples: 1, max_restarts: 2, resources: {num_cpus: 1}}",
    )
    folder = run_dir / "teachers" / "general-low"
    killed, finished = {}, threading.Event()

    def kill_after_the_first_checkpoint():
        while not killed and not finished.is_set():
            steps = metric_steps(folder) if (folder / "metrics.jsonl").is_file() else []
            checkpoint = last_checkpoint(folder / "checkpoints")
            if checkpoint and steps and steps[-1] >= 3:
                attempt = json.loads((folder / "attempts.jsonl").read_text().splitlines()[-1])
                killed.update(pid=attempt["pid"], checkpoint=checkpoint, steps=steps)
                os.kill(attempt["pid"], signal.SIGKILL)
            time.sleep(0.1)

    killer = threading.Thread(target=kill_after_the_first_checkpoint, daemon=True)
    killer.start()
    try:
        result = train_teachers(recipe, run_dir, only=["general-low", "general-high"])
    finally:
        finished.set()
        killer.join()
    assert killed, "the teacher finished before it could be killed"
    attempts = [json.loads(line) for line in (folder / "attempts.jsonl").read_text().splitlines()]
    assert len(attempts) == 2 and attempts[0]["pid"] == killed["pid"] != attempts[1]["pid"]
    checkpointed = int(killed["checkpoint"].rsplit("-", 1)[1])
    assert attempts[1]["resumed_from"] >= checkpointed >= 2  # nothing before the last checkpoint is redone
    assert metric_steps(folder) == [1, 2, 3, 4]  # no gaps, no duplicates
    teacher = result["general-low"]
    assert teacher["steps"] == 4 and {"base", "teacher", "margin"} <= teacher.keys()
    assert (folder / "model.safetensors").is_file() and not (folder / "checkpoints").exists()
    assert metric_steps(run_dir / "teachers" / "general-high") == [1] and result["general-high"]["steps"] == 1

    again = train_teachers(recipe, run_dir, only=["general-low", "general-high"])  # finished: skipped
    assert again == result and len((folder / "attempts.jsonl").read_text().splitlines()) == 2


def test_bad_cells_specs_and_bases_are_clear_errors(run_dir, tmp_path):
    recipe = smoke_recipe()
    specs = load_teacher_specs(recipe)
    with pytest.raises(RecipeError, match="unknown cells"):
        select_cells(specs, ["code-mx"])
    with pytest.raises(RecipeError, match="unknown field `stpes`"):
        load_teacher_specs(smoke_recipe("teachers.general-low.stpes=3"))
    with pytest.raises(CheckpointError, match=str(tmp_path)):
        train_teachers(recipe, tmp_path, only=["general-low"])


def test_a_teacher_is_redone_when_its_spec_or_base_changes(run_dir, tmp_path):
    recipe = smoke_recipe()
    spec = load_teacher_specs(recipe)["code-max"]
    digest = spec_hash(spec, recipe, run_dir / "base")
    assert digest != spec_hash(spec.model_copy(update={"steps": 3}), recipe, run_dir / "base")
    assert digest != spec_hash(spec, recipe, tmp_path)  # another initial checkpoint
    assert digest != spec_hash(spec, recipe.model_copy(update={"max_model_len": 4096}), run_dir / "base")
    assert digest == spec_hash(spec, recipe.model_copy(update={"max_model_len": 2048}), run_dir / "base")  # default

    class SpecWithANewField(TeacherSpec):  # a later schema: finished teachers must stay finished
        new_knob: int = 7

    assert spec_hash(SpecWithANewField(**spec.model_dump()), recipe, run_dir / "base") == digest
    folder = tmp_path / "code-max"
    assert not is_finished(folder, digest)
    (folder / "teacher.json").write_text("{}")
    assert is_finished(folder, digest)
    assert not is_finished(folder, "another") and not (folder / "teacher.json").exists()
    assert (tmp_path / "code-max.previous" / "teacher.json").is_file()  # the other spec's work is kept aside


def test_teachers_train_on_prompts_the_base_was_not_fitted_on():
    recipe = smoke_recipe()
    spec = load_teacher_specs(recipe)["code-high"].model_copy(update={"steps": 4, "prompts_per_step": 8})
    env = get_env("code", **recipe.envs.get("code", {}))
    sft_prompts = {
        task.prompt for _, (task, _) in expert_transcripts({"code": env}, 300, {"code": 1.0}, recipe.seed)
    }
    rl_prompts = [task.prompt for task in teacher_tasks(env, spec, recipe)]
    assert len(rl_prompts) == 32 and not sft_prompts & set(rl_prompts)
