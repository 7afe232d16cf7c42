"""QAT against PTQ on one recipe's test suite, over pipeline seeds: four students side by side.

    full        the full-precision MOPD student of the reference run (`mopd sweep RECIPE`)
    ptq         that student with its routed experts packed in MXFP4 after training, inputs in MXFP8
    qat         the QAT student (the same run with `distill.qat.experts=mxfp4 distill.qat.activations=mxfp8`),
                packed in MXFP4 the same way: what is deployed
    qat-full    the QAT student served at full precision (`mopd export --quantize none`)

The QAT arm's runs share the reference's base and teachers: copy `base/` and `teachers/` of each
reference seed into the arm's seed directory, then `mopd run RECIPE seed=S distill.qat...=… --out ARM/seed-S`
re-runs only distill (and its bench). This script then packs (`mopd export --quantize`), benches the four
students in one `mopd bench` per seed (the same tasks for all four), and writes `summary.json` and
`summary.md`: accuracy per cell and pooled with 95% intervals over seeds × contents (`mopd.stats`), the
paired differences, qat ÷ full, the share of PTQ's loss that QAT recovers, the routed experts' bytes,
and the MOPD step's CPU seconds per trained token with and without fake quantization (the runs'
`distill/metrics.jsonl`; both arms ran on the same machine, not side by side, so read it as a median
over steps and seeds).

    python -m benchmarks.qat_vs_ptq --reference runs/tiny-sweep --qat runs/tiny-qat --seeds 0,2 \\
        --suite eval/tiny.yaml --out docs/results/qat
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict
from pathlib import Path

from benchmarks.common import write_summary
from mopd.artifacts import MetricsLog, read_json
from mopd.bench.run import run_bench
from mopd.bench.seeds import pooled_matrix, suite_cells, task_matrix
from mopd.machine import describe_machine
from mopd.model.export import export_mxfp4, routed_expert_bytes, with_routed_expert_mx
from mopd.stats import Interval, Matrix, accuracy, ratio, scaled, subtract, two_way
from mopd.sweep import format_seeds, parse_seeds

STUDENTS = ("full", "ptq", "qat", "qat-full")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    seeds = parse_seeds(args.seeds)
    reports = {s: bench_students(args.reference / f"seed-{s}", args.qat / f"seed-{s}", args.suite, args.workers) for s in seeds}
    summary = summarise(reports, args.reference, args.qat, seeds)
    summary["command"] = (f"python -m benchmarks.qat_vs_ptq --reference {args.reference} --qat {args.qat} "
                          f"--seeds {format_seeds(seeds)} --suite {args.suite} --out {args.out}")  # fmt: skip
    write_summary(args.out, summary, render)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reference", type=Path, required=True, help="sweep of the recipe (seed-S/ runs)")
    p.add_argument("--qat", type=Path, required=True, help="sweep of the recipe with distill.qat set")
    p.add_argument("--seeds", required=True, help="seeds both sweeps finished, e.g. 0-2")
    p.add_argument("--suite", default="eval/tiny.yaml", help="the test suite (default eval/tiny.yaml)")
    p.add_argument("--workers", type=int, default=2, help="bench engines at once (default 2)")
    p.add_argument("--out", type=Path, required=True, help="folder for summary.json and summary.md")
    return p


# ----------------------------------------------------------------------------- per seed
def bench_students(reference: Path, qat: Path, suite: str, workers: int) -> dict:
    """The four students of one seed, packed where they are served packed, benched together."""
    out = qat / "qat-vs-ptq"
    models = students(reference, qat, out / "models")
    report_file = out / "bench" / "report.json"
    report = read_json(report_file, default=None)
    if report is None or sorted(m["name"] for m in report["models"]) != sorted(STUDENTS):
        report = run_bench([f"{name}={path}" for name, path in models.items()], suite=suite, out=out / "bench",
                           workers=workers)  # fmt: skip
    return report


def students(reference: Path, qat: Path, out: Path) -> dict[str, Path]:
    full, qat_student = finished_student(reference), finished_student(qat)
    packed = {"ptq": full, "qat": qat_student}
    for name, source in packed.items():
        if not (out / name / "config.json").exists():
            export_mxfp4(source, out / name, activations="mxfp8")
    if not (out / "qat-full" / "config.json").exists():
        with_routed_expert_mx(qat_student, out / "qat-full", None)
    return {"full": full, "ptq": out / "ptq", "qat": out / "qat", "qat-full": out / "qat-full"}


def finished_student(run: Path) -> Path:
    model = run / "distill" / "model"
    if not (run / "distill" / "stage.json").exists() or not (model / "config.json").exists():
        raise SystemExit(f"{run}: its distill stage has not finished (no distill/stage.json and distill/model)")
    return model


# ----------------------------------------------------------------------------- over seeds
def summarise(reports: dict[int, dict], reference: Path, qat: Path, seeds: list[int]) -> dict:
    cells = suite_cells(next(iter(reports.values())))
    rows = {f"{d}-{e}": compare_students({n: task_matrix(reports, n, d, e) for n in STUDENTS}) for d, e in cells}
    rows["pooled"] = compare_students({n: pooled_matrix(reports, n, cells) for n in STUDENTS})
    some = reports[seeds[0]]
    return {
        "seeds": seeds,
        "suite": some["suite"],
        "cells": rows,
        "routed_expert_bytes": {name: routed_expert_bytes(Path(m["path"])) for name, m in models_of(some).items()},
        "mopd_cpu_s_per_token": {"full": cpu_per_token(reference, seeds), "qat": cpu_per_token(qat, seeds)},
        "machine": describe_machine(),
    }


def models_of(report: dict) -> dict[str, dict]:
    return {m["name"]: m for m in report["models"]}


def compare_students(m: dict[str, Matrix]) -> dict:
    """Accuracy of each student, and the paired comparisons the QAT claims rest on."""
    full, ptq, qat = m["full"], m["ptq"], m["qat"]
    ptq_loss = two_way(subtract(full, ptq))  # full − ptq: what quantizing after training costs
    # QAT recovers at least half of PTQ's loss when qat − ptq − ½(full − ptq) = qat − ½·full − ½·ptq > 0
    half_recovered = two_way(subtract(subtract(qat, scaled(full, 0.5)), scaled(ptq, 0.5)))
    return {
        **{name: asdict(accuracy(x)) for name, x in m.items()},
        "ptq_minus_full": asdict(two_way(subtract(ptq, full))),
        "qat_minus_full": asdict(two_way(subtract(qat, full))),
        "qat_minus_ptq": asdict(two_way(subtract(qat, ptq))),
        "qat_over_full": asdict(ratio(qat, full)),
        "qat_minus_half_recovery": asdict(half_recovered),
        # a share of a loss that is not there is noise over noise: only where PTQ's loss is beyond noise
        "recovered_share": (two_way(subtract(qat, ptq)).mean / ptq_loss.mean) if ptq_loss.low > 0 else None,
    }


def cpu_per_token(sweep: Path, seeds: list[int]) -> dict:
    """Median over every MOPD step of the seeds: CPU seconds of the step per trained token."""
    values = [
        record["cpu_s"] / record["tokens"]
        for s in seeds
        for record in MetricsLog(sweep / f"seed-{s}" / "distill" / "metrics.jsonl").records()
        if record.get("tokens")
    ]
    return {"median": statistics.median(values), "steps": len(values)}


# ----------------------------------------------------------------------------- report
def render(summary: dict) -> str:
    def cell(x: dict, number: str = "{:.3f}") -> str:
        return Interval(**x).text(number)

    lines = [
        "# QAT against PTQ: four students on the test split",
        "",
        f"Seeds {format_seeds(summary['seeds'])} ({len(summary['seeds'])}); 95% intervals over seeds × contents, paired "
        "where students answer the same tasks (`mopd.stats.two_way`). Command: `" + summary.get("command", "") + "`.",
        "",
        "| cell | full | ptq | qat (served MXFP4) | qat at full precision | ptq − full | qat − full | qat − ptq | qat ÷ full |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in summary["cells"].items():
        lines.append(
            f"| {name} | {cell(row['full'])} | {cell(row['ptq'])} | {cell(row['qat'])} | {cell(row['qat-full'])} | "
            f"{cell(row['ptq_minus_full'], '{:+.3f}')} | {cell(row['qat_minus_full'], '{:+.3f}')} | "
            f"{cell(row['qat_minus_ptq'], '{:+.3f}')} | {cell(row['qat_over_full'])} |"
        )
    pooled = summary["cells"]["pooled"]
    share = pooled["recovered_share"]
    lines += [
        "",
        f"PTQ's pooled change: {cell(pooled['ptq_minus_full'], '{:+.3f}')}. Share of its loss QAT recovers: "
        + ("none to take (PTQ's loss is within noise)" if share is None else f"{share:.2f}")
        + f"; qat − ½·full − ½·ptq (> 0: at least half recovered): {cell(pooled['qat_minus_half_recovery'], '{:+.3f}')}.",
        "",
        "| student | routed-expert bytes | ÷ bf16 |",
        "|---|---|---|",
    ]
    for name, size in summary["routed_expert_bytes"].items():
        lines.append(f"| {name} | {size['stored']:,} | {size['stored'] / size['bf16']:.3f} |")
    cpu = summary["mopd_cpu_s_per_token"]
    lines += [
        "",
        f"MOPD CPU seconds per trained token, median over steps: full {cpu['full']['median']:.2e} ({cpu['full']['steps']} "
        f"steps), QAT {cpu['qat']['median']:.2e} ({cpu['qat']['steps']} steps): QAT ÷ full "
        f"{cpu['qat']['median'] / cpu['full']['median']:.2f}.",
        "",
        "Machine: " + ", ".join(f"{key} {value}" for key, value in summary["machine"].items()),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
