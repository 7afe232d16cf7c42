"""`mopd sweep`: one recipe over several pipeline seeds, then its claims with intervals over seeds.

Each seed is an ordinary `mopd run` of the recipe with `seed=<s>` into `<out>/seed-<s>/`, so it
resumes the same way: re-running the sweep skips every finished stage and redoes only what a crash
or a kill left unfinished. Runs go one after another by default (a laptop has the cores for one);
`--parallel N` starts N at once, for a Ray cluster (`RAY_ADDRESS` set), where every run's teachers
and workers are placed on the cluster's nodes. After each finished seed the summary of the seeds
done so far is rewritten (`mopd.bench.seeds`): summary.json, summary.md and summary.png in `<out>`.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console

from mopd.bench.seeds import summarise, write_summary
from mopd.recipe import RecipeError

console = Console(stderr=True)


class SweepError(RecipeError):
    """A sweep's seeds did not all finish; the message names them and their logs."""


SEEDS_EXPECTED = "expected comma-separated seeds and ranges, e.g. 0,1,2 or 0-17 or 0-2,5,9-11"
SEED_ITEM = re.compile(r"^(\d+)(?:\s*-\s*(\d+))?$")


def parse_seeds(text: str) -> list[int]:
    """`--seeds`: seeds (`5`) and inclusive ranges (`0-17`), comma-separated, in the order given; every seed
    a non-negative integer, given once, and at least one."""
    items = [item.strip() for item in text.split(",")]
    if items == [""]:
        raise RecipeError(f"--seeds {text!r}: give at least one seed; {SEEDS_EXPECTED}")
    seeds = [seed for item in items for seed in seed_item(item, text)]
    repeated = sorted(seed for seed, times in Counter(seeds).items() if times > 1)
    if repeated:
        named = f"seed{'s' if len(repeated) > 1 else ''} {', '.join(map(str, repeated))}"
        raise RecipeError(f"--seeds {text!r}: {named} given more than once; give each seed once")
    return seeds


def seed_item(item: str, text: str) -> list[int]:
    """The seeds of one comma-separated item of `--seeds`: `5` or the inclusive range `0-17`."""
    match = SEED_ITEM.match(item)
    if match is None:
        what = "an empty item" if not item else "a negative seed" if item.startswith("-") else f"{item!r} is not a seed or a range"
        raise RecipeError(f"--seeds {text!r}: {what}; {SEEDS_EXPECTED}")
    first, last = int(match[1]), int(match[2] or match[1])
    if last < first:
        raise RecipeError(f"--seeds {text!r}: the range {item} runs backwards; write {last}-{first}")
    return list(range(first, last + 1))


def format_seeds(seeds: list[int]) -> str:
    """`seeds` as `--seeds` text that parses back to the same list: runs of three or more consecutive seeds as ranges."""
    items: list[list[int]] = []
    for seed in seeds:
        if items and seed == items[-1][-1] + 1:
            items[-1].append(seed)
        else:
            items.append([seed])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) >= 3 else ",".join(map(str, run)) for run in items)


def run_sweep(recipe: str, seeds: list[int], out: Path, overrides: list[str], parallel: int = 1) -> Path:
    """Run the recipe once per seed (resuming finished work), then write the summary into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["mopd", "sweep", recipe, "--seeds", format_seeds(seeds), "--out", str(out), *overrides])
    finished: dict[int, Path] = {}
    failed: list[int] = []
    lock = threading.Lock()

    def one(seed: int) -> None:
        ok = run_seed(recipe, seed, out, overrides, quiet=parallel > 1)
        with lock:
            if not ok:
                failed.append(seed)
                return
            finished[seed] = out / f"seed-{seed}"
            write_summary(summarise(dict(sorted(finished.items()))), out, command)

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        list(pool.map(one, seeds))
    if failed:
        where = ", ".join(str(out / f"seed-{s}.log") for s in sorted(failed)) if parallel > 1 else "the output above"
        raise SweepError(f"seed(s) {sorted(failed)} did not finish (see {where}); re-run the same command to resume")
    console.print(f"[bold green]sweep complete[/bold green]: {out / 'summary.md'}")
    return out / "summary.md"


def run_seed(recipe: str, seed: int, out: Path, overrides: list[str], quiet: bool) -> bool:
    """`mopd run` of one seed in its own process (its own engines, memory and Ray driver)."""
    argv = [sys.executable, "-m", "mopd.cli", "run", recipe, *overrides, f"seed={seed}", "--out", str(out / f"seed-{seed}")]
    console.print(f"[bold]▶ seed {seed}[/bold]: {shlex.join(argv[1:])}")
    start = time.time()
    log = out / f"seed-{seed}.log"
    if quiet:
        with log.open("a") as sink:
            code = subprocess.call(argv, stdout=sink, stderr=subprocess.STDOUT)
    else:
        code = subprocess.call(argv)
    status = "[green]✓[/green]" if code == 0 else f"[red]✗ exit {code}[/red]"
    console.print(f"{status} seed {seed} in {time.time() - start:.0f} s" + (f" (log: {log})" if quiet else ""))
    return code == 0
