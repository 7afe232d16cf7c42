"""Dev-split score of a checkpoint on one teacher cell: the numbers behind "the teacher beats the base".

It reads the dev split, never test: these numbers choose knobs (steps, learning rates), and a
report quotes only what `mopd bench` scores on test.
"""

from __future__ import annotations

from pathlib import Path
from statistics import fmean

from transformers import AutoTokenizer

from mopd.rollout.engine import create_engine
from mopd.rollout.episodes import run_rollouts


def evaluate_cell(model_dir: Path, spec, recipe, env, effort, backend: str) -> dict[str, float]:
    """Mean shaped reward, pass rate and token counts on the cell's dev split (sampled at the spec's temperature)."""
    tasks = env.sample(spec.eval_tasks, recipe.seed, "dev", spec.effort)
    engine = create_engine(model_dir, backend=backend, max_model_len=recipe.max_model_len)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    groups = run_rollouts(
        engine,
        tokenizer,
        {env.domain: env},
        tasks,
        {spec.effort: effort},
        n=spec.eval_samples,
        temperature=spec.temperature,
        seed=recipe.seed,
    )
    flat = [r for group in groups for r in group]
    return {
        "reward": fmean(r.reward for r in flat),
        "pass_rate": fmean(r.verdict.passed for r in flat),
        "thinking_tokens": fmean(r.thinking_tokens for r in flat),
        "answer_tokens": fmean(r.answer_tokens for r in flat),
        "over_budget_rate": fmean(r.over_budget for r in flat),
        "rollouts": len(flat),
    }
