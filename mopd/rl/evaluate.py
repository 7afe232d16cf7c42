"""Dev-split score of a checkpoint on one teacher cell: the numbers behind "the teacher beats the base".

It reads the dev split, never test: these numbers choose knobs (steps, learning rates), and a
report quotes only what `mopd bench` scores on test.
"""

from __future__ import annotations

from pathlib import Path

from mopd.rollout.held_out import TaskScorer, reward_summary


def evaluate_cell(model_dir: Path, spec, recipe, env, effort, backend: str) -> dict[str, float]:
    """Mean shaped reward, pass rate and token counts on the cell's dev split (sampled at the spec's
    temperature); the engine is shut down before it returns."""
    tasks = env.sample(spec.eval_tasks, recipe.seed, "dev", spec.effort)
    with TaskScorer(backend, max_model_len=recipe.max_model_len) as scorer:
        groups = scorer.rollouts(
            model_dir, {env.domain: env}, tasks, {spec.effort: effort},
            n=spec.eval_samples, temperature=spec.temperature, seed=recipe.seed,
        )  # fmt: skip
    return reward_summary(groups)
