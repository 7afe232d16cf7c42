"""The report's PNGs (matplotlib, Agg): accuracy vs effort, accuracy vs tokens, a per-cell ratio heat map.

Accuracy is the report's: within budget (the verifier accepts, the thinking fits the effort's
budget). A labelled report (training tasks, overlapping tasks) carries its label in each title.

Teachers answer only their own cell, so they appear as single points beside the curves of the
models that answer every cell (base, student, any checkpoint given on the command line).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.colors import TwoSlopeNorm
from matplotlib.ticker import NullFormatter, ScalarFormatter

from mopd.envs.base import DOMAINS, EFFORTS

EFFORT_MARK = {"low": "L", "high": "H", "max": "M"}
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
DODGE = 0.05  # effort-axis offset between models, so equal scores don't hide each other


def write_plots(report: dict[str, Any], out: Path) -> list[str]:
    """Write the plots into `out`; returns their file names."""
    files = {
        "accuracy_vs_effort.png": plot_accuracy_vs_effort,
        "accuracy_vs_tokens.png": plot_accuracy_vs_tokens,
    }
    if ratio_pair(report) is not None:
        files["ratio_heatmap.png"] = plot_ratio_heatmap
    for name, plot in files.items():
        figure = plot(report)
        figure.savefig(out / name, dpi=110, bbox_inches="tight")
        plt.close(figure)
    return list(files)


# ----------------------------------------------------------------------------- data access
def domains_and_efforts(report: dict[str, Any]) -> tuple[list[str], list[str]]:
    # report.json stores mappings with sorted keys: take the canonical order, not the file's
    domains = [d for d in DOMAINS if d in report["suite"]["domains"]]
    domains += sorted(d for d in report["suite"]["domains"] if d not in DOMAINS)  # external benchmarks
    return domains, [e for e in EFFORTS if e in report["suite"]["efforts"]]


def result(report: dict[str, Any], model: str, domain: str, effort: str) -> dict[str, Any] | None:
    return next(
        (r for r in report["results"] if (r["model"], r["domain"], r["effort"]) == (model, domain, effort)),
        None,
    )


def curve_models(report: dict[str, Any]) -> list[str]:
    return [m["name"] for m in report["models"] if m["role"] != "teacher"]


def teachers_of(report: dict[str, Any], domain: str) -> list[dict[str, Any]]:
    return [m for m in report["models"] if m["role"] == "teacher" and m["cell"].startswith(f"{domain}-")]


def labelled(report: dict[str, Any], title: str) -> str:
    return f"{title} ({report['label']})" if report.get("label") else title


def domain_axes(count: int, title: str):
    width = 4.2 * count  # inches: one panel per domain
    figure, axes = plt.subplots(1, count, figsize=(width, 3.8), squeeze=False, sharey=True, layout="constrained")
    figure.suptitle(title)
    return figure, list(axes[0])


def shared_legend(figure, axes) -> None:
    handles, labels = {}, []
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in handles:
                handles[label] = handle
                labels.append(label)
    figure.legend([handles[label] for label in labels], labels, loc="outside right center")


# ----------------------------------------------------------------------------- the plots
def plot_teachers(ax, report: dict[str, Any], domain: str, efforts: list[str], x_of) -> None:
    """Each cell's teacher as a star at `x_of(effort, result)` (a run's teachers answer only their cell)."""
    for teacher in teachers_of(report, domain):
        effort = teacher["cell"].split("-")[1]
        if effort in efforts and (r := result(report, teacher["name"], domain, effort)):
            ax.plot(x_of(effort, r), r["accuracy"], marker="*", markersize=13, linestyle="none",
                    label=f"teacher ({effort})")


def plot_accuracy_vs_effort(report: dict[str, Any]):
    domains, efforts = domains_and_efforts(report)
    figure, axes = domain_axes(len(domains), labelled(report, "Accuracy within budget vs effort"))
    for ax, domain in zip(axes, domains, strict=True):
        models = curve_models(report)
        for k, model in enumerate(models):
            shift = (k - (len(models) - 1) / 2) * DODGE
            rows = [(i + shift, r) for i, e in enumerate(efforts) if (r := result(report, model, domain, e))]
            ax.plot(
                [x for x, _ in rows],
                [r["accuracy"] for _, r in rows],
                marker=MARKERS[k % len(MARKERS)],
                label=model,
            )
        plot_teachers(ax, report, domain, efforts, lambda effort, r: efforts.index(effort))
        ax.set(
            title=domain, xlabel="effort", xticks=range(len(efforts)), xticklabels=efforts, ylim=(-0.05, 1.05)
        )
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy within budget")
    shared_legend(figure, axes)
    return figure


def plot_accuracy_vs_tokens(report: dict[str, Any]):
    domains, efforts = domains_and_efforts(report)
    figure, axes = domain_axes(
        len(domains), labelled(report, "Runtime scaling: accuracy within budget vs mean generated tokens (L/H/M = effort)")
    )
    for ax, domain in zip(axes, domains, strict=True):
        for k, model in enumerate(curve_models(report)):
            rows = [(e, r) for e in efforts if (r := result(report, model, domain, e))]
            xs, ys = [r["generated_tokens_mean"] for _, r in rows], [r["accuracy"] for _, r in rows]
            (line,) = ax.plot(xs, ys, marker=MARKERS[k % len(MARKERS)], label=model)
            for (effort, _), x, y in zip(rows, xs, ys, strict=True):
                ax.annotate(
                    EFFORT_MARK[effort],
                    (x, y),
                    textcoords="offset points",
                    xytext=(4, 4),
                    color=line.get_color(),
                    fontsize=8,
                )
        plot_teachers(ax, report, domain, efforts, lambda effort, r: r["generated_tokens_mean"])
        ax.set(
            title=domain, xlabel="mean generated tokens per request (log)", xscale="log", ylim=(-0.05, 1.05)
        )
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("accuracy within budget")
    shared_legend(figure, axes)
    return figure


def ratio_pair(report: dict[str, Any]) -> tuple[str, str | None] | None:
    """(subject, reference): the student against each cell's teacher, else the last model against the first."""
    roles = {m["role"]: m["name"] for m in report["models"]}
    if "student" in roles and any(m["role"] == "teacher" for m in report["models"]):
        return roles["student"], None
    names = curve_models(report)
    return (names[-1], names[0]) if len(names) > 1 else None


def plot_ratio_heatmap(report: dict[str, Any]):
    domains, efforts = domains_and_efforts(report)
    subject, reference = ratio_pair(report)
    teachers = {m["cell"]: m["name"] for m in report["models"] if m["role"] == "teacher"}
    grid, labels = [], []
    for domain in domains:
        row, text = [], []
        for effort in efforts:
            ref_name = reference or teachers.get(f"{domain}-{effort}")
            ours, theirs = (
                result(report, subject, domain, effort),
                ref_name and result(report, ref_name, domain, effort),
            )
            ratio = accuracy_ratio(ours, theirs)
            row.append(ratio)
            pair = f"{ours['accuracy']:.2f} / {theirs['accuracy']:.2f}" if ours and theirs else "no reference"
            text.append(("n/a" if math.isnan(ratio) else f"{ratio:.2f}") + f"\n({pair})")
        grid.append(row)
        labels.append(text)
    reference_label = reference or "the cell's teacher"
    figure, ax = plt.subplots(figsize=(1.9 * len(efforts) + 2.5, 1.3 * len(domains) + 1.6))
    finite = [v for row in grid for v in row if not math.isnan(v)]
    top = max([2.0, *finite])
    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="lightgrey")
    image = ax.imshow(grid, cmap=cmap, norm=TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=top))
    for i, row in enumerate(labels):
        for j, text in enumerate(row):
            ax.text(j, i, text, ha="center", va="center", fontsize=9)
    ax.set(
        xticks=range(len(efforts)),
        xticklabels=efforts,
        yticks=range(len(domains)),
        yticklabels=domains,
        xlabel="effort",
        ylabel="domain",
        title=labelled(report, f"Accuracy ratio {subject} / {reference_label}") + "\n(within budget; grey: reference scored 0)",
    )
    figure.colorbar(image, ax=ax, label=f"accuracy ratio ({subject} / {reference_label})")
    return figure


def accuracy_ratio(ours: dict[str, Any] | None, theirs: dict[str, Any] | None) -> float:
    """ours / theirs accuracy; NaN when either is missing or the reference scored 0."""
    if not ours or not theirs or theirs["accuracy"] <= 0:
        return math.nan
    return ours["accuracy"] / theirs["accuracy"]
