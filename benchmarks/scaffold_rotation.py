"""Agents in harnesses they never saw: scaffolds rotated in training (`envs.agent.scaffolds=rotate`)
against one fixed harness (`fixed`, the default), over pipeline seeds (#60).

Two sweeps of one recipe, the same seeds:

    mopd sweep recipes/tiny.yaml --seeds 0,1 --out runs/scaf-fixed
    mopd sweep recipes/tiny.yaml envs.agent.scaffolds=rotate --seeds 0,1 --out runs/scaf-rotate

This script benches each seed's agent teachers and student (`mopd bench --run … --domains agent`) on

    heldout   eval/tiny-scaffolds.yaml: the test tasks, each in a held-out scaffold (qwen-agent, functionary)
    seen      eval/tiny-scaffolds-seen.yaml: the same tasks in the training scaffolds (rotate's five)

and reads `own`, the same tasks in today's harness, from the sweep's own bench (eval/tiny.yaml's agent
cells). Then, per effort and pooled, with 95% intervals over seeds × contents (`mopd.stats`, paired where
the models answer the same tasks), it writes `summary.json` and `summary.md` with the issue's four claims:

    held-out gain     rotate − fixed on heldout, teachers and student          beyond noise: the interval above 0
    transfer          rotate's heldout ÷ rotate's seen                         ≥ 0.8
    seen kept         rotate's seen ÷ fixed's own                              ≥ 0.95
    student keeps     rotate's student ÷ its teachers on heldout               ≥ 0.9

`--dev` benches the dev suite (eval/tiny-scaffolds-dev.yaml, the dev split's held-out scaffolds) instead,
for choosing anything on dev; its summary reports the held-out gain only.

    python -m benchmarks.scaffold_rotation --fixed runs/scaf-fixed --rotate runs/scaf-rotate --seeds 0,1 \\
        --out docs/results/scaffolds
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from benchmarks.common import write_summary
from mopd.artifacts import read_json
from mopd.bench.report import machine_text
from mopd.bench.seeds import contents_of, pooled_matrix, task_matrix
from mopd.cli import main as mopd
from mopd.envs.base import EFFORTS
from mopd.machine import describe_machine
from mopd.stats import Interval, Matrix, accuracy, ratio, subtract, two_way
from mopd.sweep import format_seeds, parse_seeds

SUITES = {"heldout": "eval/tiny-scaffolds.yaml", "seen": "eval/tiny-scaffolds-seen.yaml"}
DEV_SUITES = {"heldout": "eval/tiny-scaffolds-dev.yaml"}
MODELS = ("teacher", "student")
GOALS = {"transfer": 0.8, "seen_kept": 0.95, "student_keeps": 0.9}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    seeds = parse_seeds(args.seeds)
    suites = DEV_SUITES if args.dev else SUITES
    arms = {"fixed": args.fixed, "rotate": args.rotate}
    reports = {arm: {name: {s: bench(run / f"seed-{s}", suite) for s in seeds} for name, suite in suites.items()}
               for arm, run in arms.items()}  # fmt: skip
    if not args.dev:
        for arm, run in arms.items():
            reports[arm]["own"] = {s: own_bench(run / f"seed-{s}") for s in seeds}
    summary = summarise(reports, seeds, args.dev)
    summary["command"] = (f"python -m benchmarks.scaffold_rotation --fixed {args.fixed} --rotate {args.rotate} "
                          f"--seeds {format_seeds(seeds)} --out {args.out}" + (" --dev" if args.dev else ""))  # fmt: skip
    write_summary(args.out, summary, render)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fixed", type=Path, required=True, help="sweep with envs.agent.scaffolds=fixed (seed-S/ runs)")
    p.add_argument("--rotate", type=Path, required=True, help="sweep with envs.agent.scaffolds=rotate, the same seeds")
    p.add_argument("--seeds", required=True, help="seeds both sweeps finished, e.g. 0,1")
    p.add_argument("--dev", action="store_true", help="the dev suite only (held-out dev scaffolds), for choices made on dev")
    p.add_argument("--out", type=Path, required=True, help="folder for summary.json and summary.md")
    return p


# ----------------------------------------------------------------------------- reports
def bench(run: Path, suite: str) -> dict:
    """The run's agent cells on `suite`, benched once into <run>/bench-scaffolds/<suite name>/."""
    out = run / "bench-scaffolds" / Path(suite).stem
    if read_json(out / "report.json", default=None) is None:
        if not (run / "distill" / "stage.json").is_file():
            raise SystemExit(f"{run}: its distill stage has not finished (no distill/stage.json)")
        if mopd(["bench", "--run", str(run), "--suite", suite, "--domains", "agent", "--out", str(out)]) != 0:
            raise SystemExit(f"{run}: mopd bench --suite {suite} failed")
    return read_json(out / "report.json")


def own_bench(run: Path) -> dict:
    """The sweep's own bench (eval/tiny.yaml): the agent tasks in the harness every fixed stage trained in."""
    report = read_json(run / "bench" / "report.json", default=None)
    if report is None:
        raise SystemExit(f"{run}: no bench/report.json (the sweep's bench has not finished)")
    return report


# ----------------------------------------------------------------------------- claims
def matrices(reports: dict[int, dict]) -> dict[str, dict[str, Matrix | None]]:
    """Per effort and pooled ("all"): seeds × contents of the agent teachers (each its own cell) and the student."""
    efforts = [e for e in EFFORTS if all(e in r["suite"]["efforts"] for r in reports.values())]
    cells = [("agent", e) for e in efforts]
    out = {e: {m: task_matrix(reports, m, "agent", e) for m in MODELS} for e in efforts}
    out["all"] = {m: pooled_matrix(reports, m, cells) for m in MODELS}
    return out


def same_tasks(a: dict[int, dict], b: dict[int, dict], efforts: list[str]) -> bool:
    """Whether two suites asked the same agent tasks (pairing is then per task)."""
    return all(contents_of(a, "agent", e) == contents_of(b, "agent", e) for e in efforts)


def summarise(reports: dict[str, dict[str, dict[int, dict]]], seeds: list[int], dev: bool) -> dict:
    m = {arm: {suite: matrices(r) for suite, r in by_suite.items()} for arm, by_suite in reports.items()}
    groups = list(m["fixed"]["heldout"])
    for suite in reports["fixed"]:
        if not same_tasks(reports["fixed"][suite], reports["rotate"][suite], groups[:-1]):
            raise SystemExit(f"{suite}: the two arms were asked different tasks; bench both from the same suite file")
    rows = {}
    for group in groups:
        row: dict = {"accuracy": {arm: {suite: {model: asdict(accuracy(x)) for model, x in m[arm][suite][group].items() if x}
                                        for suite in m[arm]} for arm in m}}  # fmt: skip
        row["heldout_gain"] = {model: interval(two_way, m["rotate"]["heldout"][group][model], m["fixed"]["heldout"][group][model])
                               for model in MODELS}  # fmt: skip
        row["student_keeps"] = interval(ratio, m["rotate"]["heldout"][group]["student"], m["rotate"]["heldout"][group]["teacher"])
        if not dev:
            if not same_tasks(reports["rotate"]["heldout"], reports["rotate"]["seen"], groups[:-1]):
                raise SystemExit("the held-out and seen suites asked different tasks: they must share split, seeds and n")
            row["transfer"] = {model: interval(ratio, m["rotate"]["heldout"][group][model], m["rotate"]["seen"][group][model])
                               for model in MODELS}  # fmt: skip
            paired = same_tasks(reports["rotate"]["seen"], reports["fixed"]["own"], groups[:-1])
            row["seen_kept"] = {model: interval(ratio, m["rotate"]["seen"][group][model], m["fixed"]["own"][group][model])
                                if paired else None for model in MODELS}  # fmt: skip
        rows[group] = row
    first = reports["rotate"]["heldout"][seeds[0]]
    return {"seeds": seeds, "dev": dev, "suites": {s: r[seeds[0]]["suite"] for s, r in reports["rotate"].items()},
            "efforts": groups, "rows": rows, "goals": GOALS, "machine": describe_machine(),
            "runs": {arm: str(Path(r["heldout"][seeds[0]]["models"][0]["path"]).parents[1]) for arm, r in reports.items()},
            "scaffolds_seen": scaffold_seen_lines(first)}  # fmt: skip


def interval(how, a: Matrix | None, b: Matrix | None) -> dict | None:
    """`two_way` of a − b, or the `ratio` a ÷ b, paired over seeds × contents; None where a model lacks scores."""
    if a is None or b is None:
        return None
    return asdict(how(subtract(a, b)) if how is two_way else how(a, b))


def scaffold_seen_lines(report: dict) -> dict[str, dict[str, bool | None]]:
    """Per model, whether its training records name each held-out scaffold (the bench's audit)."""
    return {r["model"]: r["scaffolds_seen"] for r in report["results"] if r.get("scaffolds_seen")}


# ----------------------------------------------------------------------------- markdown
def text(x: dict | None, number: str = "{:.2f}") -> str:
    return "—" if x is None else Interval(**x).text(number)


def verdict(x: dict | None, goal: float | None = None) -> str:
    if x is None:
        return "—"
    if goal is None:
        return "above 0 beyond noise" if x["low"] > 0 else ("below 0 beyond noise" if x["high"] < 0 else "within noise")
    if x["low"] >= goal or x["high"] < goal:
        return f"≥ {goal}: " + ("met" if x["mean"] >= goal else "missed")
    return f"≥ {goal}: " + ("met" if x["mean"] >= goal else "missed") + " by the mean, within noise"


def render(s: dict) -> str:
    seeds = ", ".join(map(str, s["seeds"]))
    lines = [f"# Scaffolds rotated against fixed ({'dev' if s['dev'] else 'test'} split, seeds {seeds})", "",
             f"`{s['command']}`", "", f"Machine: {machine_text(s['machine'])}.", "",
             "Suites: " + "; ".join(f"{name} `{suite['path']}` ({suite['split']} split, {suite['n']} tasks per effort)"
                                    for name, suite in s["suites"].items()) + ".", "",
             "Agent accuracy [95% interval over seeds × contents]; teachers: each effort's agent teacher on its own cell.", "",
             "| effort | model | fixed, held-out | rotate, held-out |" + ("" if s["dev"] else " rotate, seen | fixed, own harness |"),
             "|---|---|---:|---:|" + ("" if s["dev"] else "---:|---:|")]  # fmt: skip
    for group in s["efforts"]:
        acc = s["rows"][group]["accuracy"]
        for model in MODELS:
            cells = [acc["fixed"]["heldout"].get(model), acc["rotate"]["heldout"].get(model)]
            if not s["dev"]:
                cells += [acc["rotate"]["seen"].get(model), acc["fixed"]["own"].get(model)]
            lines.append(f"| {group} | {model} | " + " | ".join(text(c) for c in cells) + " |")
    lines += ["", "| effort | claim | teacher | student | verdict (teacher; student) |", "|---|---|---:|---:|---|"]
    for group in s["efforts"]:
        row = s["rows"][group]
        claims = [("held-out gain, rotate − fixed", row["heldout_gain"], None)]
        if not s["dev"]:
            claims += [("transfer, held-out ÷ seen (rotate)", row["transfer"], GOALS["transfer"]),
                       ("seen kept, rotate seen ÷ fixed own", row["seen_kept"], GOALS["seen_kept"])]  # fmt: skip
        for name, x, goal in claims:
            number = "{:+.2f}" if goal is None else "{:.2f}"
            lines.append(f"| {group} | {name} | {text(x['teacher'], number)} | {text(x['student'], number)} "
                         f"| {verdict(x['teacher'], goal)}; {verdict(x['student'], goal)} |")  # fmt: skip
        keeps = row["student_keeps"]
        lines.append(f"| {group} | student ÷ teachers, rotate held-out | | {text(keeps)} | {verdict(keeps, GOALS['student_keeps'])} |")
    lines += ["", "Held-out scaffolds named in each model's training records (the bench's audit; false = never trained on):", ""]
    lines += [f"- {model}: {seen}" for model, seen in s["scaffolds_seen"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
