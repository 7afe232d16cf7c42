"""Teacher RL: GRPO on one (domain, effort) cell, built on TRL's GRPOTrainer.

    train_teacher(spec, recipe, init_dir, out_dir)

TRL owns the algorithm (group-relative advantages, the clipped policy loss, the optimizer and
its checkpoints); we own generation. TRL's `rollout_func` hands us each step's prompts (task
ids, repeated once per group member); `GroupRollouts` syncs the trainer's weights into our
rollout engine, runs the shared episode loop (`run_rollouts`: multi-turn agent episodes, the
verifiers, the effort protocol's reward shaping) and returns the engine's token ids and
log-probs, with `env_mask` zero on observation tokens so they never enter the loss. TRL weighs
each token's loss by its importance-sampling ratio of trainer to sampler probability (mode and
cap from the spec), which corrects for the gap between our engine and the trainer's forward.

Every step logs one line of `metrics.jsonl`: mean reward, pass rate, thinking and answer
tokens, over-budget rate, KL to the initial policy, entropy, the mean and largest
|log p_train − log p_sampler| over the loss tokens and the share of them whose ratio was masked
or truncated, the step's seconds split into generate / verify / train, and what `mopd.compute`
counts: tokens sampled and trained, CPU seconds. `train_grpo` is the same loop over any tasks and
envs (the mixed-RL baseline), optionally stopped by a rule on the records so far. A restarted run
resumes from TRL's last checkpoint and drops the metrics of the steps it redoes.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from statistics import fmean
from types import SimpleNamespace
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from mopd.artifacts import MetricsLog, atomic_dir, curve_snapshot
from mopd.compute import cpu_seconds
from mopd.envs import get_env, prompt_contents
from mopd.envs.splits import TRAINED_TEXT, task_keys, write_trained_on
from mopd.machine import resolve_device
from mopd.model import is_k3
from mopd.model.export import qat_start
from mopd.precision import check_precision
from mopd.rollout.engine import create_engine
from mopd.rollout.episodes import run_rollouts

# The KL to the initial policy is a diagnostic: a sample of the rollouts estimates it well enough,
# and scoring all of them with the reference model cost ~15% of a code teacher's step.
KL_SAMPLES = 16

# The base was fitted on the first tasks of the recipe seed's train stream. RL on those very
# prompts sharpens answers the base has memorised, and held-out scores do not move.
RL_SEED_OFFSET = 7919


def teacher_tasks(env, spec, recipe) -> list:
    """The teacher's training prompts: fresh draws from the train split, not the base's SFT tasks."""
    return env.sample(spec.steps * spec.prompts_per_step, recipe.seed + RL_SEED_OFFSET, "train", spec.effort)


def train_teacher(
    spec, recipe, init_dir: Path, out_dir: Path, backend: str | None = None, trainer_class: type | None = None
) -> int:
    """Run GRPO for `spec.steps` steps (resuming from out_dir's last checkpoint); returns the step resumed from.

    `trainer_class`: LengthSortedGRPOTrainer by default; TRL's own GRPOTrainer for a benchmark baseline.
    """
    env = teacher_env(spec, recipe)
    return train_grpo(
        spec, recipe, init_dir, out_dir, {env.domain: env}, teacher_tasks(env, spec, recipe),
        {spec.effort: teacher_effort(spec, recipe)}, backend=backend, trainer_class=trainer_class,
    )  # fmt: skip


def train_grpo(
    spec, recipe, init_dir: Path, out_dir: Path, envs: dict, tasks: list, efforts: dict,
    backend: str | None = None, trainer_class: type | None = None, stop=None, curve_every: int | None = None,
) -> int:  # fmt: skip
    """GRPO from `init_dir` on `tasks` (each verified by its domain's env, at its effort), resuming from
    out_dir's last checkpoint; returns the step resumed from. `stop(records)`, when given, ends the run
    after a step where it returns True (metrics.jsonl's records so far). `curve_every`: keep the policy
    every that many steps in `curve/step-N/` (the `curves` stage scores them)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    init_dir = qat_start(init_dir, spec.qat and spec.qat.routed_expert_mx, out_dir, f"{spec.source}: qat")
    check_precision(spec.precision, resolve_device(recipe.device), f"{spec.source}: precision")
    engine = create_engine(init_dir, backend=backend or recipe.rollout, max_model_len=recipe.max_model_len, dtype=spec.sampler_dtype)
    try:
        return grpo_with(engine, spec, recipe, init_dir, out_dir, envs, tasks, efforts, trainer_class, stop, curve_every)
    finally:
        engine.close()  # now: the garbage collector's teardown could reset vLLM's state under this process's next engine


def grpo_with(engine, spec, recipe, init_dir, out_dir, envs, tasks, efforts, trainer_class, stop, curve_every) -> int:
    """train_grpo's run, sampling with `engine`."""
    torch.manual_seed(recipe.seed)
    tokenizer = AutoTokenizer.from_pretrained(init_dir)
    write_trained_on(out_dir, task_keys(tasks))  # the whole deterministic list: a resumed run records the same
    write_trained_on(out_dir, prompt_contents(tasks), TRAINED_TEXT)
    rollouts = GroupRollouts(
        engine=engine,
        reference=create_engine(init_dir, backend="hf", max_model_len=recipe.max_model_len),
        tokenizer=tokenizer,
        envs=envs,
        efforts=efforts,
        tasks={task.id: task for task in tasks},
        temperature=spec.temperature,
    )
    checkpoint = last_checkpoint(out_dir / "checkpoints")
    resumed_from = checkpoint_step(checkpoint)
    metrics = MetricsLog(out_dir / "metrics.jsonl")
    metrics.resume_after(resumed_from)
    model = AutoModelForCausalLM.from_pretrained(init_dir, dtype=torch.float32)
    use_cache = model.config.use_cache
    if spec.kl_beta > 0 and is_k3(model.config) and getattr(model.config, "auto_map", None) is None:
        raise ValueError(
            f"{spec.source}: kl_beta > 0 needs TRL to load a reference copy, which it cannot do for "
            "a config without `auto_map`; use kl_beta: 0 (the KL to the initial policy is still logged, as kl_init)"
        )
    max_new_tokens = max(effort.max_new_tokens for effort in efforts.values())
    step_metrics = StepMetrics(metrics, rollouts, stop)
    if curve_every:
        step_metrics.snapshots = Snapshots(out_dir, curve_every, tokenizer, use_cache)
    trainer = (trainer_class or LengthSortedGRPOTrainer)(
        model=model,
        reward_funcs=shaped_reward,
        args=grpo_config(spec, recipe, out_dir / "checkpoints", max_new_tokens),
        train_dataset=Dataset.from_dict({"prompt": [task.id for task in tasks]}),
        processing_class=tokenizer,
        rollout_func=rollouts,
        callbacks=[step_metrics],
    )
    step_metrics.trainer = trainer
    trainer.remove_callback(PrinterCallback)  # metrics.jsonl and the driver's progress line say it
    correct_for_the_sampler(trainer)
    trainer.skip_zero_advantage = spec.skip_zero_advantage
    trainer.train(resume_from_checkpoint=checkpoint)
    trainer.model.config.use_cache = use_cache  # transformers' Trainer turns it off for training
    trainer.model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return resumed_from


def teacher_env(spec, recipe):
    options = {**recipe.env_options(spec.domain), **spec.difficulty}
    if spec.families:
        options["families"] = spec.families
    return get_env(spec.domain, **options)


def teacher_effort(spec, recipe):
    """The recipe's effort budget, with the spec's own budget / length penalty where it sets one."""
    update = {"budget_tokens": spec.budget_tokens, "length_penalty": spec.length_penalty}
    return recipe.efforts[spec.effort].model_copy(update={k: v for k, v in update.items() if v is not None})


def grpo_config(spec, recipe, output_dir: Path, max_new_tokens: int) -> GRPOConfig:
    batch = spec.prompts_per_step * spec.group_size
    micro = spec.micro_batch_size or batch  # divides batch: GRPOSpec checks it
    use_cpu = recipe.device == "cpu" or not torch.cuda.is_available()
    return GRPOConfig(
        output_dir=str(output_dir),
        max_steps=spec.max_steps if spec.steps is None else spec.steps,  # a matched run stops itself
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        steps_per_generation=batch // micro,  # one optimizer step per batch of rollouts: strictly on-policy
        num_generations=spec.group_size,
        max_completion_length=max_new_tokens,
        temperature=spec.temperature,
        beta=spec.kl_beta,
        learning_rate=spec.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="steps",
        save_steps=spec.checkpoint_every,
        save_total_limit=2,
        seed=recipe.seed,
        use_cpu=use_cpu,
        bf16=spec.precision == "bf16" if spec.precision else not use_cpu,  # unset: TRL's default (fp32 on CPU, faster for tiny)
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        gradient_checkpointing=False,  # not supported by the hybrid (nor needed at these sizes)
        vllm_importance_sampling_correction=spec.importance_sampling != "none",
        vllm_importance_sampling_mode=spec.importance_sampling,  # TRL reads it only with the correction on
        vllm_importance_sampling_clip_max=spec.importance_sampling_cap,
    )


def correct_for_the_sampler(trainer) -> None:
    """Let TRL weigh the loss by the trainer/sampler probability ratio of the rollout_func's log-probs."""
    # TRL applies its correction only with `use_vllm`, which in __init__ would also start TRL's own
    # vLLM; set after __init__, the flag only turns the correction on (and makes TRL call
    # vllm_generation.sync_weights before each rollout_func: our rollout_func syncs its own engine).
    trainer.use_vllm = trainer.vllm_importance_sampling_correction
    trainer.vllm_generation = SimpleNamespace(sync_weights=lambda: None)
    trainer._last_loaded_step = -1


class LengthSortedGRPOTrainer(GRPOTrainer):
    """TRL's GRPO with each step's micro-batches cut from the rollouts sorted by length, every one
    trimmed to its own longest rollout, and without the rollouts whose advantage is zero.

    TRL pads a step's rollouts to the longest of them and shuffles them before cutting micro-batches,
    so every micro-batch pays for the longest episode. One optimizer step sums the gradients of all
    its micro-batches, so which rollouts share a micro-batch does not change the update.

    A group whose rollouts all earned the same reward gives each of them advantage 0. With the DAPO
    loss (normalised by the tokens of the whole step, not of the micro-batch) and no KL or entropy
    term, such a rollout adds exactly nothing to the gradient, so it is not trained on at all (a
    third of a tiny teacher's rollouts on average, most of a late general-low step). Only the MoE
    router's load statistics, which steer its bias, no longer count their tokens. A spec's
    `skip_zero_advantage: false` trains on them all the same.
    """

    skip_zero_advantage = True
    tokens_trained: int | None = None  # the last step's prompt + completion tokens through forward and backward

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if "importance_sampling_ratio" in batch:
            self._metrics["train" if self.model.training else "eval"]["sampling/corrected_fraction"].append(
                corrected_fraction(batch)
            )
        return batch

    def _prepare_inputs(self, generation_batch):
        if not self.model.training or self.num_iterations != 1:
            return super()._prepare_inputs(generation_batch)
        micro_batches = self.args.steps_per_generation
        if self._step % micro_batches == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            if self.skip_zero_advantage and self.zero_advantage_is_silent():
                batch = rows_with_learning_signal(batch, at_least=micro_batches)
            batch = sorted_by_length(batch)
            self.tokens_trained = int(rollout_lengths(batch).sum())
            self._buffered_inputs = [trim_padding(part) for part in split_rows(batch, micro_batches)]
        return self._buffered_inputs[self._step % micro_batches]

    def zero_advantage_is_silent(self) -> bool:
        """Whether a rollout with advantage 0 contributes exactly 0 to the loss and its gradient."""
        return (
            self.loss_type == "dapo"
            and self.beta == 0.0
            and self.top_entropy_quantile == 1.0
            and not self._entropy_bonus_enabled
            and not self.aux_loss_enabled
        )


def corrected_fraction(batch: dict[str, Any]) -> float:
    """The share of loss tokens whose importance-sampling ratio TRL masked or truncated: those where
    its ratio differs from exp(log p_train − log p_sampler), computed as TRL computes it."""
    mask = batch["completion_mask"] * batch.get("tool_mask", 1)
    diff = torch.nan_to_num((batch["old_per_token_logps"] - batch["sampling_per_token_logps"]) * mask, nan=0.0)
    ratio = batch["importance_sampling_ratio"]
    if ratio.shape[1] == 1:  # one ratio per sequence
        diff = diff.sum(-1, keepdim=True)
    corrected = (ratio != diff.exp()).expand_as(mask)
    return (corrected[mask.bool()].float().mean().nan_to_num(0.0)).item()


PROMPT_KEYS = ("prompt_ids", "prompt_mask")


def rollout_lengths(batch: dict[str, Any]) -> torch.Tensor:
    return batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1)


def select_rows(batch: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """Those rollouts (every batch-first tensor or list in `batch`), in that order; scalars as they are."""

    def pick(value):
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            return value
        return value[rows] if isinstance(value, torch.Tensor) else [value[i] for i in rows.tolist()]

    return {key: pick(value) for key, value in batch.items()}


def sorted_by_length(batch: dict[str, Any]) -> dict[str, Any]:
    """The rollouts reordered by prompt + completion length."""
    return select_rows(batch, rollout_lengths(batch).argsort(stable=True))


def rows_with_learning_signal(batch: dict[str, Any], at_least: int) -> dict[str, Any]:
    """The rollouts whose advantage is not zero; if fewer than `at_least` (one per micro-batch),
    the shortest others make up the number (their gradient is zero all the same)."""
    advantages = batch["advantages"]
    keep = (advantages if advantages.ndim == 1 else advantages.abs().sum(1)) != 0
    missing = at_least - int(keep.sum())
    if missing > 0:
        silent = (~keep).nonzero().squeeze(1)
        keep[silent[rollout_lengths(batch)[silent].argsort(stable=True)[:missing]]] = True
    return select_rows(batch, keep.nonzero().squeeze(1))


def split_rows(batch: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """`parts` consecutive runs of rollouts, sizes differing by at most one (TRL's split_tensor_dict
    drops the remainder of an uneven split)."""
    first = next(v for v in batch.values() if isinstance(v, torch.Tensor) and v.ndim > 0)
    return [select_rows(batch, rows) for rows in torch.arange(first.shape[0]).tensor_split(parts)]


def trim_padding(batch: dict[str, Any]) -> dict[str, Any]:
    """Drop the prompt columns that are left padding in every row and the completion columns that
    are right padding in every row (completion_mask 0 throughout: they carry no loss and, being
    last, no causal influence). Every per-token tensor (completion width) is cut alike."""
    keep_prompt = int(batch["prompt_mask"].any(0).int().argmax())
    used = batch["completion_mask"].any(0).nonzero()
    keep_completion = int(used[-1]) + 1 if len(used) else 1
    width = batch["completion_ids"].shape[1]
    trimmed = {}
    for key, value in batch.items():
        if key in PROMPT_KEYS:
            value = value[:, keep_prompt:]
        elif isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == width:
            value = value[:, :keep_completion]
        trimmed[key] = value
    return trimmed


# ------------------------------------------------------------------------------------- rollouts
class GroupRollouts:
    """TRL's rollout_func: our engine samples, our episode loop verifies and shapes the rewards."""

    def __init__(self, engine, reference, tokenizer, envs, efforts, tasks, temperature):
        self.engine, self.reference, self.tokenizer = engine, reference, tokenizer
        self.envs = {domain: TimedEnv(env) for domain, env in envs.items()}
        self.efforts, self.tasks, self.temperature = efforts, tasks, temperature
        self.synced_step: int | None = None
        self.seconds = {"generate": 0.0, "verify": 0.0}
        self.tokens_sampled = 0

    def __call__(self, prompts: list[str], trainer) -> dict[str, Any]:
        self.sync_weights(trainer)
        ids, sizes = zip(*[(key, len(list(run))) for key, run in itertools.groupby(prompts)], strict=True)
        if len(set(sizes)) != 1:
            raise ValueError(f"rollout_func: prompts must come in equal groups, got group sizes {sizes}")
        for env in self.envs.values():
            env.seconds = 0.0
        start = time.time()
        groups = run_rollouts(
            self.engine,
            self.tokenizer,
            self.envs,
            [self.tasks[i] for i in ids],
            self.efforts,
            n=sizes[0],
            temperature=self.temperature,
        )
        verify = sum(env.seconds for env in self.envs.values())
        self.seconds = {"verify": verify, "generate": time.time() - start - verify}
        flat = [r for group in groups for r in group]
        self.tokens_sampled = sum(sum(r.loss_mask) for r in flat)
        return {
            "prompt_ids": [r.prompt_ids for r in flat],
            "completion_ids": [r.token_ids for r in flat],
            "logprobs": [r.logprobs for r in flat],
            "env_mask": [r.loss_mask for r in flat],
            "reward": [r.reward for r in flat],
            "stats": self.batch_stats(flat),
        }

    def sync_weights(self, trainer) -> None:
        if self.synced_step != trainer.state.global_step:
            self.engine.update_weights(trainer.model.state_dict())
            self.synced_step = trainer.state.global_step

    def batch_stats(self, flat) -> dict[str, float]:
        return {
            "pass_rate": fmean(r.verdict.passed for r in flat),
            "thinking_tokens": fmean(r.thinking_tokens for r in flat),
            "answer_tokens": fmean(r.answer_tokens for r in flat),
            "over_budget_rate": fmean(r.over_budget for r in flat),
            "kl_init": self.kl_to_initial(flat),
        }

    def kl_to_initial(self, flat) -> float:
        """KL(π‖π₀) per generated token: the mean of log π − log π₀ over the policy's own samples
        (every k-th rollout, at most KL_SAMPLES of them)."""
        flat = flat[:: -(-len(flat) // KL_SAMPLES)]
        scored = self.reference.score([r.prompt_ids for r in flat], [r.token_ids for r in flat])
        diffs = [
            lp - lp0 for r, ref in zip(flat, scored, strict=True) for lp, lp0, m in zip(r.logprobs, ref, r.loss_mask, strict=True) if m
        ]
        return fmean(diffs) if diffs else 0.0


class TimedEnv:
    """An environment whose reset / step / verify time (batched or not) is counted as verification time."""

    def __init__(self, env):
        self.env, self.seconds = env, 0.0
        self.domain = env.domain

    def __getattr__(self, name: str):
        method = getattr(self.env, name)
        if name not in ("reset", "step", "step_many", "verify", "verify_many"):
            return method

        def timed(*args, **kwargs):
            start = time.time()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.time() - start

        return timed


def shaped_reward(prompts, completions, reward, stats, log_metric, **_) -> list[float]:
    """The effort-shaped verifier reward computed in the rollout; also logs the batch's statistics."""
    for name, value in stats[0].items():
        log_metric(name, value)
    return list(reward)


# ------------------------------------------------------------------------------ logging, resume
LOGGED = {
    "reward": "reward",
    "pass_rate": "pass_rate",
    "thinking_tokens": "thinking_tokens",
    "answer_tokens": "answer_tokens",
    "over_budget_rate": "over_budget_rate",
    "kl_init": "kl_init",
    "entropy": "entropy",
    "loss": "loss",
    "grad_norm": "grad_norm",
    "reward_std": "reward_std",
    "frac_reward_zero_std": "frac_reward_zero_std",
    "sampling/sampling_logp_difference/mean": "logp_gap",
    "sampling/sampling_logp_difference/max": "logp_gap_max",
    "sampling/corrected_fraction": "is_corrected_fraction",
}


class StepMetrics(TrainerCallback):
    """One metrics.jsonl line per optimizer step (with its tokens and CPU seconds, `mopd.compute`);
    also the MoE bias update the model needs per step, and the end of a run that `stop` calls."""

    def __init__(self, log: MetricsLog, rollouts: GroupRollouts, stop=None):
        self.log, self.rollouts, self.stop = log, rollouts, stop
        self.step_start, self.cpu_start, self.row = 0.0, 0.0, {}
        self.trainer = None  # set once the trainer exists: it counts the tokens it trained on
        self.snapshots: Snapshots | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.step_start, self.cpu_start = time.time(), cpu_seconds()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        seconds = time.time() - self.step_start
        self.row = {f"time_{k}": v for k, v in self.rollouts.seconds.items()}
        self.row["time_train"] = seconds - sum(self.rollouts.seconds.values())
        self.row["tokens_sampled"] = self.rollouts.tokens_sampled
        trained = getattr(self.trainer, "tokens_trained", None)
        if trained is not None:
            self.row["tokens_trained"] = trained
        self.row["cpu_s"] = cpu_seconds() - self.cpu_start
        if hasattr(model, "update_moe_bias"):  # K3 only: quantile balancing of the LatentMoE routers
            self.row.update(model.update_moe_bias())
        if self.snapshots is not None:
            self.snapshots.keep(model, state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            values = {name: logs[key] for key, name in LOGGED.items() if key in logs}
            self.log.log(state.global_step, **values, **self.row)
            if self.stop is not None and self.stop(self.log.records()):
                control.should_training_stop = True


class Snapshots:
    """The policy after every `every`-th step in `curve/step-N/`, saved as the final model is (the
    config's own `use_cache`, which transformers' Trainer turns off), so engines swap it in like any."""

    def __init__(self, out_dir: Path, every: int, tokenizer, use_cache: bool):
        self.out_dir, self.every, self.tokenizer, self.use_cache = out_dir, every, tokenizer, use_cache

    def keep(self, model, step: int) -> None:
        if step % self.every:
            return
        training_value, model.config.use_cache = model.config.use_cache, self.use_cache
        try:
            with atomic_dir(curve_snapshot(self.out_dir, step)) as tmp:
                model.save_pretrained(tmp)
                self.tokenizer.save_pretrained(tmp)
        finally:
            model.config.use_cache = training_value


def last_checkpoint(folder: Path) -> str | None:
    """The newest complete TRL checkpoint (one that got as far as writing its trainer state)."""
    done = [p for p in folder.glob("checkpoint-*") if (p / "trainer_state.json").is_file()]
    return str(max(done, key=checkpoint_step)) if done else None


def checkpoint_step(path: str | Path | None) -> int:
    return 0 if path is None else int(Path(path).name.removeprefix("checkpoint-"))
