"""How long `make test` and `make run` take from a fresh clone: the times the README states.

    python scripts/fresh_clone.py --out docs/results/fresh-clone.json        (both, `make test` first)
    python scripts/fresh_clone.py --targets test --out docs/results/fresh-clone-test.json

Each target runs in its own fresh clone of the repository's committed HEAD (uncommitted changes are not
in it, so the times belong to the commit recorded), one after the other, from nothing: each clone builds
its own .venv from the package index and fetches its own `.cache/` (bubblewrap, a system package, is
installed only where it is missing). Each target's wall time, its exit status, the load average before
and after (a shared machine reads slower) and, for `make run`, every stage's seconds from its
`stage.json` go to `--out` (JSON) and a `.md` beside it. A failing target is recorded and makes the
script exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("test", "run")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="results JSON (a .md is written beside it)")
    parser.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS), help="make targets, in order")
    parser.add_argument("--keep", action="store_true", help="keep the clones (their paths are recorded)")
    args = parser.parse_args(argv)

    commit = git("rev-parse", "HEAD")
    result = {"command": shlex.join(["python", "scripts/fresh_clone.py", *(argv if argv is not None else sys.argv[1:])]),
              "commit": commit, "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(),
              "targets": {}}  # fmt: skip
    for target in args.targets:
        clone = fresh_clone(commit)
        result["targets"][target] = {"clone": str(clone), **timed_make(clone, target)}
        write(result, Path(args.out))  # after each target: a later failure keeps what was measured
        if not args.keep:
            shutil.rmtree(clone, ignore_errors=True)
    print(Path(args.out).with_suffix(".md").read_text())
    return 0 if all(t["exit_status"] == 0 for t in result["targets"].values()) else 1


def fresh_clone(commit: str) -> Path:
    clone = Path(tempfile.mkdtemp(prefix="mopd-fresh-"))
    subprocess.run(["git", "clone", "--quiet", "--no-local", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", commit], check=True)
    return clone


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def machine() -> dict:
    """Stdlib only: this runs before any .venv exists."""
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "processor": cpu_model()}  # fmt: skip


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return match.group(1) if match else platform.processor()


def timed_make(clone: Path, target: str) -> dict:
    """`make <target>` in the clone: wall seconds, exit status, load, the log's tail and its own facts."""
    log = clone.parent / f"{clone.name}-make-{target}.log"
    load_before = os.getloadavg()
    began = time.monotonic()
    with log.open("w") as sink:
        status = subprocess.call(["make", target], cwd=clone, stdout=sink, stderr=subprocess.STDOUT)
    seconds = time.monotonic() - began
    text = log.read_text(errors="replace")
    record = {"seconds": round(seconds, 1), "exit_status": status, "load_before": load_before,
              "load_after": os.getloadavg(), "log": str(log), "tail": text.splitlines()[-5:]}  # fmt: skip
    if target == "test":
        record["pytest"] = pytest_summary(text)
    if target == "run":
        record["stage_seconds"] = stage_seconds(clone / "runs" / "tiny")
    return record


def pytest_summary(text: str) -> dict:
    """The counts and seconds of pytest's last summary line ("533 passed, 2 warnings in 554.21s")."""
    lines = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed)", line) and " in " in line]
    if not lines:
        return {}
    last = lines[-1]
    counts = {word.rstrip("s") if word.startswith("error") else word: int(n)
              for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", last)}  # fmt: skip
    seconds = re.search(r" in ([\d.]+)s", last)
    return {**counts, "seconds": float(seconds.group(1)) if seconds else None}


def stage_seconds(run: Path) -> dict[str, float]:
    """Each finished stage's seconds, from its stage.json (teachers: the stage, not the sum of cells)."""
    seconds = {}
    for marker in sorted(run.glob("**/stage.json")):
        stage = marker.parent.relative_to(run).as_posix()
        if "/" in stage and not stage.startswith("baselines/"):
            continue  # a teacher cell's own marker: the teachers stage holds their total
        seconds[stage] = json.loads(marker.read_text()).get("seconds")
    return seconds


def write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"# From a fresh clone: commit {result['commit'][:7]}, {result['date']}",
        "",
        f"Command: `{result['command']}`, each target in its own fresh clone. "
        f"Machine: {m['cpu_count']} CPUs ({m['processor']}), {m['platform']}, Python {m['python']}.",
        "",
        "| target | minutes | exit | load before → after (1 min) | detail |",
        "|---|---:|---:|---|---|",
    ]
    for target, r in result["targets"].items():
        lines.append(f"| `make {target}` | {r['seconds'] / 60:.1f} | {r['exit_status']} | "
                     f"{r['load_before'][0]:.1f} → {r['load_after'][0]:.1f} | {detail(target, r)} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def detail(target: str, record: dict) -> str:
    if target == "test":
        p = record.get("pytest") or {}
        return (f"{p.get('passed', 0)} passed, {p.get('failed', 0)} failed, {p.get('error', 0)} errors; "
                f"pytest {p.get('seconds') or 0:.0f} s")  # fmt: skip
    stages = record.get("stage_seconds") or {}
    return "stages (s): " + ", ".join(f"{k} {v:.0f}" for k, v in stages.items() if v is not None)


if __name__ == "__main__":
    sys.exit(main())
