"""Does a model's agent accuracy come from one constant answer? A check on a bench report.

An agent question's answer is a number the verifier compares exactly. Where one number is the answer to many of a
split's tasks, a policy that always says it scores that share without reading the database. For every agent cell of
the report, this redraws the suite's tasks (same split, seed and count, so the same content keys), computes each
task's true answer, and writes:

    majority            the most common answer and the share of the cell's tasks it answers
    models.<m>.matches  the tasks where the model's 0/1 reward equals "the answer is the majority one":
                        all of them means its rewards are exactly those of always saying it

    python -m benchmarks.constant_answer --recipe recipes/smollm2.yaml --report runs/smollm2-sweep/seed-0/bench/report.json \
        --out docs/results/smollm2-seed0/constant_answer.json
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from mopd.artifacts import read_json, write_json_atomic
from mopd.envs import get_env
from mopd.envs.agent.env import question_answer
from mopd.recipe import load_recipe


def cell_check(env, suite: dict, effort: str, rows: list[dict]) -> dict:
    tasks = env.sample(suite["n"], suite["seeds"][0], suite["split"], effort)
    answers = {task.meta["content_hash"]: question_answer(task.meta) for task in tasks}
    majority, count = Counter(answers.values()).most_common(1)[0]
    models = {}
    for row in rows:
        missing = [key for key in row["task_keys"] if key not in answers]
        if missing:
            raise SystemExit(f"{row['model']} agent-{effort}: {len(missing)} task keys are not the suite's redrawn tasks")
        hits = [float(answers[key] == majority) for key in row["task_keys"]]
        matches = sum(hit == reward for hit, reward in zip(hits, row["task_rewards"], strict=True))
        models[row["model"]] = {"accuracy": row["accuracy"], "matches": matches, "tasks": len(hits)}
    return {"majority": {"answer": majority, "share": count / len(answers), "tasks": len(answers)}, "models": models}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", required=True, help="the recipe whose agent options the run used")
    parser.add_argument("--report", required=True, help="a bench report.json")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    report = read_json(args.report)
    if report is None:
        raise SystemExit(f"{args.report}: no such report")
    suite = report["suite"]
    if len(suite["seeds"]) != 1 or suite["samples"] != 1:
        raise SystemExit(f"{args.report}: one suite seed and one sample a task expected")
    env = get_env("agent", **load_recipe(args.recipe).env_options("agent"))
    cells = {}
    for effort in suite["efforts"]:
        rows = [r for r in report["results"] if r["domain"] == "agent" and r["effort"] == effort]
        if rows:
            cells[f"agent-{effort}"] = cell_check(env, suite, effort, rows)
    out = {"command": " ".join(["python -m benchmarks.constant_answer", *(argv or sys.argv[1:])]), "report": args.report,
           "recipe": args.recipe, "cells": cells}
    write_json_atomic(args.out, out)
    for cell, c in cells.items():
        m = c["majority"]
        print(f"{cell}: answer {m['answer']} is right on {m['share']:.3f} of {m['tasks']}; "
              + ", ".join(f"{name} {v['accuracy']:.2f} (matches {v['matches']}/{v['tasks']})" for name, v in c["models"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
