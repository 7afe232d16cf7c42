"""Benchmark the agent environment and write the numbers as JSON.

    python -m benchmarks.agent_env --out runs/bench/agent.json

Measures, in one run on one machine:
- snapshot and restore of a mid-episode `AgentEnv` episode on a ~1 MB database (p50/p99 ms of
  wall-clock and of CPU time), beside SQLite's bare serialize/deserialize, and whether restores
  are byte-identical;
- episode step throughput (tool calls executed per second) replaying expert transcripts on the
  default small databases and on the ~1 MB one;
- the expert's success rate on generated tasks, per effort and family.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mopd.envs.agent import AgentEnv
from mopd.envs.agent.database import MAX_CUSTOMERS, MAX_PRODUCTS, build_database, db_spec
from mopd.envs.base import EFFORTS, split_thinking
from mopd.machine import describe_machine


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    big_env = AgentEnv(**database_sizes_for(args.db_bytes))
    report = {
        "machine": describe_machine() | {"sqlite": sqlite3.sqlite_version},
        "snapshot_restore": bench_snapshot_restore(big_env, args.repeats),
        "step_throughput": {
            "default_db": bench_steps(AgentEnv(), args.episodes),
            "1mb_db": bench_steps(big_env, max(1, args.episodes // 10)),
        },
        "expert": bench_expert(AgentEnv(), args.expert_tasks),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agent_env", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--db-bytes", type=int, default=1 << 20, help="size of the large database (default 1 MiB)")
    parser.add_argument("--repeats", type=int, default=500, help="snapshots and restores to time")
    parser.add_argument("--episodes", type=int, default=300, help="expert episodes to replay for step throughput")
    parser.add_argument("--expert-tasks", type=int, default=1000, help="tasks for the expert success rate")
    args = parser.parse_args(argv)
    for name in ("db_bytes", "repeats", "episodes", "expert_tasks"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def database_sizes_for(target_bytes: int) -> dict[str, int]:
    """Row counts whose database serializes to about `target_bytes`: orders grow it linearly."""
    def size(n_orders: int) -> int:
        return len(build_database(db_spec(0, MAX_PRODUCTS, MAX_CUSTOMERS, n_orders)))

    small, large = MAX_CUSTOMERS, 20 * MAX_CUSTOMERS
    per_order = (size(large) - size(small)) / (large - small)
    n_orders = max(MAX_CUSTOMERS, round(small + (target_bytes - size(small)) / per_order))
    return {"n_products": MAX_PRODUCTS, "n_customers": MAX_CUSTOMERS, "n_orders": n_orders}


def bench_snapshot_restore(env: AgentEnv, repeats: int) -> dict[str, Any]:
    task = env.sample(1, seed=0, effort="high")[0]
    episode = env.reset(task)
    env.step(episode, env.solve(task)[0]["content"])  # mid-episode, as a GRPO group would branch
    state = env.snapshot(episode)
    original = episode.conn.serialize()
    restored = [env.restore(state) for _ in range(min(repeats, 50))]
    return {
        "db_bytes": len(original),
        "snapshot_bytes": len(state),
        "rows": {"orders": env.sizes["n_orders"], "products": env.sizes["n_products"],
                 "customers": env.sizes["n_customers"]},
        "restore_byte_identical": all(r.conn.serialize() == original for r in restored),
        "snapshot_ms": timings(lambda: env.snapshot(episode), repeats),
        "restore_ms": timings(lambda: env.restore(state), repeats),
        "sqlite_serialize_ms": timings(episode.conn.serialize, repeats),
        "sqlite_deserialize_ms": timings(lambda: sqlite3.connect(":memory:").deserialize(original), repeats),
    }


def timings(action: Callable[[], object], repeats: int) -> dict[str, Any]:
    """Wall-clock and this thread's CPU milliseconds; results are freed outside the timed span.

    On a busy shared machine the wall-clock tail includes waiting for a core; CPU time does not.
    """
    action()  # warm up
    wall, cpu = [], []
    for _ in range(repeats):
        wall_start, cpu_start = time.perf_counter_ns(), time.thread_time_ns()
        result = action()
        cpu.append((time.thread_time_ns() - cpu_start) / 1e6)
        wall.append((time.perf_counter_ns() - wall_start) / 1e6)
        del result
    return {"wall": percentiles(wall), "cpu": percentiles(cpu), "n": repeats}


def percentiles(samples: list[float]) -> dict[str, float]:
    p99 = statistics.quantiles(samples, n=100)[98] if len(samples) > 1 else samples[0]
    return {"p50": round(statistics.median(samples), 4), "p99": round(p99, 4),
            "mean": round(statistics.fmean(samples), 4)}


def bench_steps(env: AgentEnv, episodes: int) -> dict[str, Any]:
    """Replay expert actions (made beforehand, untimed) through reset + step, then verify."""
    tasks = env.sample(episodes, seed=1, effort="high")
    actions = [[turn["content"] for turn in env.solve(task) if turn["role"] == "assistant"] for task in tasks]
    replayed, steps = [], 0
    start = time.perf_counter()
    for task, episode_actions in zip(tasks, actions, strict=True):
        episode = env.reset(task)
        for action in episode_actions:
            env.step(episode, action)
        steps += len(episode_actions)
        replayed.append(episode)
    stepping = time.perf_counter() - start
    start = time.perf_counter()
    rewards = [env.verify(task, episode).reward for task, episode in zip(tasks, replayed, strict=True)]
    verifying = time.perf_counter() - start
    return {"episodes": episodes, "steps": steps, "steps_per_s": round(steps / stepping, 1),
            "episodes_per_s": round(episodes / stepping, 1), "verify_per_s": round(episodes / verifying, 1),
            "mean_reward": sum(rewards) / len(rewards)}


def bench_expert(env: AgentEnv, n_tasks: int) -> dict[str, Any]:
    per_effort = {effort: n_tasks // len(EFFORTS) + (i < n_tasks % len(EFFORTS)) for i, effort in enumerate(EFFORTS)}
    solved, total, turns, think_chars = Counter(), Counter(), Counter(), Counter()
    for seed, (effort, n) in enumerate(per_effort.items()):
        for task in env.sample(n, seed=seed, split="dev", effort=effort):
            transcript = env.solve(task)
            reward = env.verify(task, transcript).reward
            for key in (effort, task.meta["family"]):
                total[key] += 1
                solved[key] += reward == 1.0
            assistant = [turn["content"] for turn in transcript if turn["role"] == "assistant"]
            turns[effort] += len(assistant)
            think_chars[effort] += sum(len(split_thinking(content)[0]) for content in assistant)
    return {
        "tasks": n_tasks,
        "success_rate": sum(solved[e] for e in EFFORTS) / n_tasks,
        "success_rate_by": {key: solved[key] / total[key] for key in total},
        "mean_turns_by_effort": {e: turns[e] / max(1, per_effort[e]) for e in EFFORTS},
        "mean_think_chars_by_effort": {e: think_chars[e] / max(1, per_effort[e]) for e in EFFORTS},
    }


if __name__ == "__main__":
    main()
