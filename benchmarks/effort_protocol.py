"""Benchmark of the effort protocol and the general domain; writes one JSON file.

    python -m benchmarks.effort_protocol --out runs/bench/envs.json

It builds the tiny tokenizer from the task corpus, then measures with it:
- thinking tokens of the expert's scratchpad per domain × effort (for the agent, the longest
  turn), at default difficulty and, for general, at the hardest default knobs, and the share
  that fits each effort's budget: the evidence that budgets make effort matter;
- the general expert's success on 1,000 tasks across efforts (verdict and shaped reward);
- general verification throughput, own families and reasoning-gym families side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from mopd.envs import get_env
from mopd.envs.base import DOMAINS, EFFORTS
from mopd.envs.effort import default_effort_specs, shape_reward, thinking_tokens
from mopd.envs.general import DEFAULT_FAMILIES, OWN_FAMILIES, GeneralEnv
from mopd.envs.tokenizer import build_tokenizer, task_corpus
from mopd.machine import describe_machine

HARD_GENERAL = {
    "families": list(OWN_FAMILIES),
    "add_digits": (6, 6),
    "mul_digits": (4, 4),
    "chain_terms": (6, 6),
}


def completion_thinking(solution, tokenizer) -> int | None:
    """Thinking tokens of a completion, or of the longest assistant turn of a transcript."""
    if isinstance(solution, str):
        return thinking_tokens(solution, tokenizer)
    counts = [thinking_tokens(t["content"], tokenizer) for t in solution if t["role"] == "assistant"]
    return None if None in counts else max(counts)


def thinking_stats(env, tokenizer, n: int, specs: dict) -> dict:
    stats = {}
    for effort in EFFORTS:
        counts = [completion_thinking(env.solve(t), tokenizer) for t in env.sample(n, 1, "dev", effort)]
        stats[effort] = {
            "min": min(counts),
            "median": statistics.median(counts),
            "p90": sorted(counts)[int(0.9 * (len(counts) - 1))],
            "max": max(counts),
            "fits_budget": {
                e: sum(c <= s.budget_tokens for c in counts) / len(counts) for e, s in specs.items()
            },
        }
    return stats


def expert_success(tokenizer, specs: dict, n: int = 1000) -> dict:
    env = GeneralEnv()
    tasks = [t for effort in EFFORTS for t in env.sample(n // len(EFFORTS) + 1, 2, "dev", effort)][:n]
    verdicts, shaped = [], []
    for task in tasks:
        completion = env.solve(task)
        verdict = env.verify(task, completion)
        verdicts.append(verdict.reward == 1.0)
        shaped.append(
            shape_reward(verdict, thinking_tokens(completion, tokenizer), specs[task.effort]) == 1.0
        )
    return {"tasks": len(tasks), "verdict_1": sum(verdicts) / n, "shaped_reward_1": sum(shaped) / n}


def verify_throughput(families: list[str], n: int = 600, repeats: int = 3) -> float:
    env = GeneralEnv(families=families)
    tasks = env.sample(n, 3, "dev", "high")
    completions = [env.solve(t) for t in tasks]
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for task, completion in zip(tasks, completions, strict=True):
            env.verify(task, completion)
        rates.append(n / (time.perf_counter() - start))
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument(
        "--tasks-per-cell", type=int, default=100, help="tokenizer corpus size per domain×effort"
    )
    parser.add_argument("--sample", type=int, default=200, help="tasks per domain×effort for thinking stats")
    args = parser.parse_args(argv)

    specs = default_effort_specs()
    start = time.perf_counter()
    tokenizer = build_tokenizer(task_corpus(tasks_per_cell=args.tasks_per_cell))
    report = {
        "machine": describe_machine(),
        "tokenizer": {"vocab": len(tokenizer), "build_s": round(time.perf_counter() - start, 2)},
        "budgets": {effort: spec.model_dump() for effort, spec in specs.items()},
        "thinking_tokens": {
            domain: thinking_stats(get_env(domain), tokenizer, args.sample, specs) for domain in DOMAINS
        },
        "thinking_tokens_hard_general": thinking_stats(
            GeneralEnv(**HARD_GENERAL), tokenizer, args.sample, specs
        ),
        "general_expert": expert_success(tokenizer, specs),
        "general_verify_per_s": {
            "own_families": verify_throughput(list(OWN_FAMILIES)),
            "reasoning_gym_families": verify_throughput(
                [f for f in DEFAULT_FAMILIES if f not in OWN_FAMILIES]
            ),
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
