"""Planted sweeps: bench reports whose answers are drawn with known accuracies, for `mopd sweep`'s summary and
`mopd compare`, where the intervals must find what was planted."""

import json
import random
from pathlib import Path

from mopd.envs.base import DOMAINS, EFFORTS

CELLS = [f"{d}-{e}" for d in DOMAINS for e in EFFORTS]
TASKS = 40


def planted_report(seed: int, accuracy: dict[str, dict[str, float]], tokens: dict[str, float]) -> dict:
    """A bench report where model m answers each task of cell c right with probability accuracy[m][c]."""
    rng = random.Random(seed)
    models = [{"name": "base", "role": "base", "cell": None}, {"name": "student", "role": "student", "cell": None},
              *({"name": f"t-{c}", "role": "teacher", "cell": c} for c in CELLS)]
    results = []
    for model in models:
        cells = [model["cell"]] if model["role"] == "teacher" else CELLS
        key = "teacher" if model["role"] == "teacher" else model["name"]
        for cell in cells:
            domain, effort = cell.split("-")
            rewards = [float(rng.random() < accuracy[key][cell]) for _ in range(TASKS)]
            results.append({"model": model["name"], "domain": domain, "effort": effort, "task_rewards": rewards,
                            "thinking_tokens_mean": tokens[effort] + rng.random(),
                            "audit": {"overlap": 0, "tasks": TASKS, "stages": {}}})
    suite = {"name": "planted", "path": "eval/planted.yaml", "split": "test", "n": TASKS, "seeds": [1001],
             "samples": 1, "domains": {d: {} for d in DOMAINS}, "efforts": list(EFFORTS)}
    return {"suite": suite, "models": models, "results": results, "code_sandbox": "bubblewrap sandbox"}


def write_runs(tmp_path: Path, seeds, accuracy, tokens) -> dict[int, Path]:
    runs = {}
    for seed in seeds:
        run = tmp_path / f"seed-{seed}"
        (run / "bench").mkdir(parents=True)
        (run / "bench" / "report.json").write_text(json.dumps(planted_report(seed, accuracy, tokens)))
        for stage, seconds in (("base", 100.0), ("teachers", 50.0), ("distill", 20.0), ("bench", 10.0)):
            (run / stage).mkdir(exist_ok=True)
            flops = {"teachers": 4e12, "distill": (1 + seed) * 1e12}.get(stage)  # MOPD ÷ teachers 0.25, 0.5, 0.75
            compute = {"compute": {"flops": flops}} if flops else {}
            (run / stage / "stage.json").write_text(json.dumps({"seconds": seconds, "hash": f"{stage}-{seed}", **compute}))
        runs[seed] = run
    return runs
