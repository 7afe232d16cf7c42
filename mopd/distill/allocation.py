"""How each MOPD step's prompts are split over the mix's cells (`distill.allocation`).

    static   every step draws cells in proportion to `distill.mix` (systematic sampling)
    gap      every `allocation_every` steps the split is made again: `allocation_floor` prompts to every
             cell, the rest in proportion to the student's gap to the cell's teacher, the reverse KL of
             its recent samples (the token-weighted mean of `<cell>/reverse_kl` over the steps of the
             window, clipped at 0); before any step is measured, the mix

A step's split reads only steps that had finished when its prompts were drawn: with one-step-off
sampling (`max_staleness` ≥ 1) step n+1 is drawn while step n trains, so the window ends one step
earlier. It is the same on resume (the records come back from metrics.jsonl). A cell that had no
sample in the window counts at the largest measured gap, so it is measured next.

`allocation/<cell>` in metrics.jsonl is each step's share of prompts per cell; `write_allocation_plot`
draws it as a cells × steps map (`allocation.png` in the distill stage's folder).
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Mapping
from pathlib import Path

from mopd.distill.routing import RouteTable
from mopd.recipe import DistillSpec


class Allocation:
    """The cells of each step's prompts, from the mix or from the measured gaps."""

    def __init__(self, table: RouteTable, spec: DistillSpec, records: list[dict] | None = None):
        self.table, self.spec = table, spec
        self.lag = 1 if spec.max_staleness > 0 else 0
        self.gaps: dict[int, dict[str, tuple[float, float]]] = {}  # step → cell → (reverse KL, tokens)
        self.lock = threading.Lock()  # the producer thread draws while the loop observes
        for record in records or []:
            self.observe(record["step"], record)

    def observe(self, step: int, metrics: Mapping[str, float]) -> None:
        """Keep a finished step's per-cell reverse KL and token count."""
        measured = {
            cell: (metrics[f"{cell}/reverse_kl"], metrics[f"{cell}/tokens"])
            for cell in self.table.weights
            if f"{cell}/reverse_kl" in metrics
        }
        with self.lock:
            self.gaps[step] = measured

    def cells(self, step: int, rng: random.Random) -> list[str]:
        """The cell of each of the step's `prompts_per_step` prompts, shuffled."""
        n = self.spec.prompts_per_step
        weights = self.weights(step)
        if weights is None:
            return self.table.sample_cells(n, rng)
        floor = self.spec.allocation_floor
        cells = [cell for cell in self.table.weights for _ in range(floor)]
        cells += systematic_sample(weights, n - len(cells), rng)
        rng.shuffle(cells)
        return cells

    def weights(self, step: int) -> dict[str, float] | None:
        """The gap of each cell for the step's block; None: the mix (static, or nothing measured yet)."""
        if self.spec.allocation == "static":
            return None
        window = self.window(step)
        with self.lock:
            measured = [self.gaps[s] for s in window if s in self.gaps]
        if not measured:
            return None
        return cell_gaps(measured, list(self.table.weights))

    def window(self, step: int) -> range:
        """The steps whose gaps set the split of `step`'s block: the `allocation_every` steps before it,
        ending `lag` steps earlier (one-step-off: the step still training when the block's first
        prompts are drawn has no gaps yet)."""
        every = self.spec.allocation_every
        block_start = step - (step - 1) % every
        end = block_start - self.lag  # exclusive
        return range(max(1, end - every), end)


def cell_gaps(measured: list[dict[str, tuple[float, float]]], cells: list[str]) -> dict[str, float]:
    """Per cell, the token-weighted mean reverse KL over the steps that sampled it, clipped at 0;
    a cell with no sample counts at the largest gap; all gaps 0: every cell alike."""
    gaps = {}
    for cell in cells:
        pairs = [step[cell] for step in measured if cell in step and step[cell][1] > 0]
        tokens = sum(t for _, t in pairs)
        if tokens:
            gaps[cell] = max(0.0, sum(kl * t for kl, t in pairs) / tokens)
    largest = max(gaps.values(), default=0.0)
    gaps = {cell: gaps.get(cell, largest) for cell in cells}
    return gaps if sum(gaps.values()) > 0 else dict.fromkeys(cells, 1.0)


def systematic_sample(weights: Mapping[str, float], n: int, rng: random.Random) -> list[str]:
    """n cells in proportion to the weights: each gets ⌊n·w⌋ or ⌈n·w⌉ (`RouteTable.sample_cells`)."""
    if n <= 0:
        return []
    return RouteTable(routes={}, weights={c: w for c, w in weights.items() if w > 0}).sample_cells(n, rng)


def step_allocation(cells: list[str], routed: list[str]) -> dict[str, float]:
    """`allocation/<cell>`: each routed cell's share of the step's samples (0 for one not drawn)."""
    return {f"allocation/{cell}": cells.count(cell) / max(len(cells), 1) for cell in routed}


def write_allocation_plot(records: list[dict], cells: list[str], out: Path) -> Path:
    """allocation.png: each cell's share of each step's prompts (cells × steps), and its mean over the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    grid = [[r.get(f"allocation/{cell}", math.nan) for r in records] for cell in cells]
    means = [sum(v for v in row if not math.isnan(v)) / max(len(row), 1) for row in grid]
    figure, ax = plt.subplots(figsize=(max(6.0, 0.22 * len(steps) + 3.0), 0.42 * len(cells) + 1.6))
    image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=0.0, interpolation="nearest",
                      extent=(steps[0] - 0.5, steps[-1] + 0.5, len(cells) - 0.5, -0.5))  # fmt: skip
    ax.set(yticks=range(len(cells)), yticklabels=[f"{c} ({m:.2f})" for c, m in zip(cells, means, strict=True)],
           xlabel="step", title="MOPD allocation: share of each step's prompts per cell (mean over the run)")  # fmt: skip
    figure.colorbar(image, ax=ax, label="share of the step's prompts")
    figure.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(figure)
    return out
