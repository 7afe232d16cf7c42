"""Benchmark the code verifier: programs/s through the sandbox pool, and the expert's pass rate.

    python -m benchmarks.sandbox_throughput --out runs/bench/sandbox.json

For each backend (bwrap and the rlimit fallback, side by side) and each mix of completions
(correct, wrong, hostile reward hacks), it verifies a batch of code tasks `--repeats` times and
reports the median programs/s. It also measures the worker pool's speedup over one worker, and
the expert solver's pass rate on `--expert-tasks` generated tasks. The JSON ends with a machine
description, including the load average: the machine may be shared.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from mopd.envs.base import EFFORTS, Task
from mopd.envs.code import CodeEnv, function_from_meta
from mopd.machine import describe_machine

# Reward hacks that fail fast (bombs that burn their whole CPU limit are in the attack suite).
HOSTILE = [
    "import os\nos._exit(0)",
    "import sys\nsys.exit(0)",
    "print('PASS')\nprint('OK')\ndef f(x):\n    return None",
    "def f(x):\n    raise SystemExit(0)",
    "def f(x):\n    raise KeyboardInterrupt",
    "class A:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return A()",
    "class L(list):\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return L()",
    "import json\njson.dumps = lambda *a, **k: '{\"cases\": []}'\ndef f(x):\n    return 0",
    "import os, signal\ndef f(x):\n    os.kill(os.getppid(), signal.SIGKILL)",
    "def f(x):\n    return open('/etc/passwd').read()",
]


def fenced(code: str) -> str:
    return f"<think>plan</think>\n```python\n{code}\n```"


def wrong_code(task: Task) -> str:
    function = function_from_meta(task.meta)
    return function.source + {"list[int]": " + [0]", "str": " + 'z'", "int": " + 1"}[function.return_type]


def completions_for(mix: str, env: CodeEnv, tasks: list[Task]) -> list[str]:
    if mix == "correct":
        return [env.solve(task) for task in tasks]
    if mix == "wrong":
        return [fenced(wrong_code(task)) for task in tasks]
    return [fenced(HOSTILE[i % len(HOSTILE)]) for i in range(len(tasks))]


class CpuMeter:
    """CPU seconds used by this process and every process it starts, from a cgroup v1 cpuacct group.

    Rusage cannot see them all: bwrap's namespace init is reparented away and never waited for.
    On a shared machine, wall-clock rates fall with other people's load; CPU cost per program
    does much less, and 2 / cost estimates the rate on 2 idle cores.
    """

    ROOT = Path("/sys/fs/cgroup/cpuacct")

    def __init__(self):
        self.group: Path | None = self.ROOT / f"mopd-bench-{os.getpid()}"
        try:
            self.group.mkdir(exist_ok=True)
            (self.group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            self.group = None  # no writable cpuacct hierarchy here: report wall-clock rates only

    def seconds(self) -> float | None:
        return None if self.group is None else int((self.group / "cpuacct.usage").read_text()) / 1e9

    def close(self) -> None:
        if self.group is not None:
            (self.ROOT / "cgroup.procs").write_text(str(os.getpid()))
            time.sleep(0.5)  # reparented zombies leave the group once reaped
            with contextlib.suppress(OSError):
                self.group.rmdir()


def throughput(
    env: CodeEnv, tasks: list[Task], completions: list[str], repeats: int, meter: CpuMeter
) -> dict:
    rates, costs, rewards = [], [], []
    env.verify_many(tasks[:4], completions[:4])  # warm the pool and the page cache
    for _ in range(repeats):
        cpu, start = meter.seconds(), time.perf_counter()
        verdicts = env.verify_many(tasks, completions)
        rates.append(len(tasks) / (time.perf_counter() - start))
        if cpu is not None:
            costs.append((meter.seconds() - cpu) / len(tasks))
        rewards.append(statistics.fmean(v.reward for v in verdicts))
    result = {
        "programs_per_s": statistics.median(rates),
        "all_runs": rates,
        "mean_reward": statistics.fmean(rewards),
    }
    if costs:
        cost = statistics.median(costs)
        result |= {"cpu_ms_per_program": 1000 * cost, "est_programs_per_s_on_2_idle_cores": 2 / cost}
    return result


def bench_mixes(args: argparse.Namespace, meter: CpuMeter) -> dict:
    results: dict = {}
    for backend in ("bwrap", "rlimit"):
        env = CodeEnv(workers=args.workers, backend=backend)
        tasks = env.sample(args.programs, seed=args.seed)
        results[backend] = {
            mix: throughput(env, tasks, completions_for(mix, env, tasks), args.repeats, meter)
            for mix in ("correct", "wrong", "hostile")
        }
        env.close()
    results["bwrap_over_rlimit"] = {
        mix: results["bwrap"][mix]["programs_per_s"] / results["rlimit"][mix]["programs_per_s"]
        for mix in ("correct", "wrong", "hostile")
    }
    return results


def bench_pool(args: argparse.Namespace, meter: CpuMeter) -> dict:
    rates = {}
    for workers in (1, args.workers):
        env = CodeEnv(workers=workers, backend="bwrap")
        tasks = env.sample(args.programs, seed=args.seed)
        correct = completions_for("correct", env, tasks)
        rates[workers] = throughput(env, tasks, correct, args.repeats, meter)["programs_per_s"]
        env.close()
    return {"programs_per_s_by_workers": rates, "speedup": rates[args.workers] / rates[1]}


def bench_expert(args: argparse.Namespace) -> dict:
    env = CodeEnv(workers=args.workers)
    tasks = [
        task
        for i, effort in enumerate(EFFORTS)
        for task in env.sample(
            args.expert_tasks // 3 + (i < args.expert_tasks % 3), seed=args.seed + 1, effort=effort
        )
    ]
    start = time.perf_counter()
    verdicts = env.verify_many(tasks, [env.solve(task) for task in tasks])
    elapsed = time.perf_counter() - start
    env.close()
    passed = sum(v.reward == 1.0 for v in verdicts)
    failures = [{"id": t.id, "details": v.details} for t, v in zip(tasks, verdicts, strict=True) if v.reward != 1.0][:5]
    return {
        "tasks": len(tasks),
        "passed": passed,
        "pass_rate": passed / len(tasks),
        "programs_per_s": len(tasks) / elapsed,
        "first_failures": failures,
    }


def sandbox_tools() -> dict:
    bwrap = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, check=False).stdout.strip()
    return {"bwrap": bwrap, "cpus_usable": len(os.sched_getaffinity(0))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON report")
    parser.add_argument("--programs", type=int, default=60, help="programs per timed batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed batches per measurement (median)")
    parser.add_argument("--workers", type=int, default=4, help="sandbox worker pool size")
    parser.add_argument(
        "--expert-tasks", type=int, default=1000, help="tasks for the expert pass rate (0: skip)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.programs, args.repeats, args.workers) < 1 or args.expert_tasks < 0:
        parser.error("--programs, --repeats and --workers must be >= 1, --expert-tasks >= 0")
    report = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    report["machine_at_start"] = describe_machine() | sandbox_tools()
    meter = CpuMeter()
    try:
        report["mixes"] = bench_mixes(args, meter)
        report["pool"] = bench_pool(args, meter)
        if args.expert_tasks:
            report["expert"] = bench_expert(args)
    finally:
        meter.close()
    report["load_average_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    summary = {
        backend: {
            mix: [round(r["programs_per_s"], 1), round(r.get("est_programs_per_s_on_2_idle_cores", 0), 1)]
            for mix, r in report["mixes"][backend].items()
        }
        for backend in ("bwrap", "rlimit")
    }
    expert = report.get("expert", {}).get("pass_rate")
    print(
        json.dumps({"programs_per_s [measured, est. on 2 idle cores]": summary, "expert_pass_rate": expert})
    )


if __name__ == "__main__":
    main()
