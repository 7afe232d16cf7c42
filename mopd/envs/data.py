"""Tasks as `datasets.Dataset`, users' task files, and the verifiers they can name.

A user swaps in their own tasks with a JSONL or parquet file of prompts plus a verifier name:

    tasks = load_task_file("my_tasks.jsonl", verifier="general/exact")
    verdict = verify_task(tasks[0], completion)

Each row needs `prompt`; `id`, `effort` and `meta` (an object) are optional, and every other
field (e.g. `answer`) goes into `task.meta`. The verifier's name is kept in
`task.meta["verifier"]`, so tasks stay verifiable after a trip through a Dataset or JSONL.
A row's split key (`mopd.envs.splits`) is its `meta.content_hash` when given, else the hash of its
prompt and `meta.answer` (empty without one), as the general domain keys its own questions.
Verifiers: "general" (the general domain's own check, by `meta.family`), "general/exact"
(normalised exact match of `meta.answer`), "code" and "agent" (those domains' verifiers).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import datasets

from mopd.envs import get_env
from mopd.envs.base import EFFORTS, Task, Verdict, split_thinking
from mopd.envs.chat import strip_turn_end
from mopd.envs.general import normalize_answer, task_key
from mopd.envs.splits import KEY_CHARS, is_key

VerifyFn = Callable[[Task, Any], Verdict]


# --------------------------------------------------------------------------------- datasets
def tasks_to_dataset(tasks: list[Task]) -> datasets.Dataset:
    """One row per task; `meta` is stored as JSON text because its shape differs by family."""
    return datasets.Dataset.from_dict(
        {
            "id": [t.id for t in tasks],
            "domain": [t.domain for t in tasks],
            "effort": [t.effort for t in tasks],
            "prompt": [t.prompt for t in tasks],
            "meta": [json.dumps(t.meta, sort_keys=True) for t in tasks],
        }
    )


def dataset_to_tasks(dataset: datasets.Dataset) -> list[Task]:
    return [
        Task(row["id"], row["domain"], row["effort"], row["prompt"], json.loads(row["meta"]))
        for row in dataset
    ]


# -------------------------------------------------------------------------------- verifiers
@dataclass(frozen=True)
class Verifier:
    domain: str
    required: tuple[str, ...]  # meta fields a task must carry
    build: Callable[[], VerifyFn]


def exact_answer(task: Task, completion: str) -> Verdict:
    """1 when the normalised text after `</think>` equals the normalised `meta.answer`."""
    parts = split_thinking(completion)
    if parts is None:
        return Verdict(0.0, {"reason": "no closed think block"})
    got, expected = normalize_answer(strip_turn_end(parts[1])), normalize_answer(str(task.meta["answer"]))
    return Verdict(float(got == expected), {"expected": expected, "got": got})


VERIFIERS: dict[str, Verifier] = {
    "general": Verifier("general", ("answer",), lambda: get_env("general").verify),
    "general/exact": Verifier("general", ("answer",), lambda: exact_answer),
    "code": Verifier("code", ("entry", "tests"), lambda: get_env("code").verify),
    "agent": Verifier("agent", ("family", "goal", "db", "max_turns"), lambda: get_env("agent").verify),
}


def register_verifier(name: str, domain: str, verify: VerifyFn, required: tuple[str, ...] = ()) -> None:
    VERIFIERS[name] = Verifier(domain, tuple(required), lambda: verify)
    get_verifier.cache_clear()


def verifier_spec(name: str) -> Verifier:
    if name not in VERIFIERS:
        raise ValueError(f"unknown verifier {name!r}; known: {sorted(VERIFIERS)}")
    return VERIFIERS[name]


@cache
def get_verifier(name: str) -> VerifyFn:
    return verifier_spec(name).build()


def verify_task(task: Task, completion: Any) -> Verdict:
    """Verify with the task's named verifier, or with its domain's own when it names none."""
    return get_verifier(task.meta.get("verifier", task.domain))(task, completion)


# ------------------------------------------------------------------------------- task files
class TaskFileError(ValueError):
    """A user's task file is unreadable or a row lacks what its verifier needs."""


def load_task_file(path: str | Path, verifier: str, effort: str = "high") -> list[Task]:
    """Tasks from a JSONL or parquet file; errors name the file, the line (or row) and the field."""
    path = Path(path)
    spec = verifier_spec(verifier)
    if effort not in EFFORTS:
        raise TaskFileError(f"{path}: effort {effort!r} is not one of {list(EFFORTS)}")
    if not path.is_file():
        raise TaskFileError(f"{path}: no such task file")
    return [_task_from_row(row, where, path, verifier, spec, effort) for where, row in _rows(path)]


def _rows(path: Path) -> Iterator[tuple[str, dict]]:
    if path.suffix == ".jsonl":
        yield from _jsonl_rows(path)
    elif path.suffix == ".parquet":
        import pyarrow.parquet

        try:
            table = pyarrow.parquet.read_table(path)
        except Exception as error:
            raise TaskFileError(f"{path}: not a readable parquet file ({error})") from error
        yield from ((f"row {index}", row) for index, row in enumerate(table.to_pylist()))
    else:
        raise TaskFileError(f"{path}: task files must end in .jsonl or .parquet")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict]]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise TaskFileError(f"{path} line {number}: not valid JSON ({error.msg})") from error
            if not isinstance(row, dict):
                raise TaskFileError(f"{path} line {number}: expected a JSON object, got {type(row).__name__}")
            yield f"line {number}", row


def _task_from_row(row: dict, where: str, path: Path, verifier: str, spec: Verifier, effort: str) -> Task:
    def fail(message: str) -> TaskFileError:
        return TaskFileError(f"{path} {where}: {message}")

    row = dict(row)
    prompt = row.pop("prompt", None)
    if not isinstance(prompt, str) or not prompt:
        raise fail("missing field 'prompt' (a non-empty string)")
    task_id = str(row.pop("id", None) or f"{path.stem}-{where.split()[-1]}")
    task_effort = row.pop("effort", None) or effort
    if task_effort not in EFFORTS:
        raise fail(f"field 'effort' is {task_effort!r}, not one of {list(EFFORTS)}")
    meta = row.pop("meta", None) or {}
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except json.JSONDecodeError as error:
            raise fail(f"field 'meta' is not valid JSON ({error.msg})") from error
    if not isinstance(meta, dict):
        raise fail("field 'meta' must be an object")
    meta = {**meta, **row, "verifier": verifier}
    answer = meta.get("answer")
    meta.setdefault("content_hash", task_key(prompt, "" if answer is None else answer))
    if not is_key(meta["content_hash"]):
        raise fail(f"field 'content_hash' is {meta['content_hash']!r}, not {KEY_CHARS} lower-case hex digits")
    missing = [field for field in spec.required if meta.get(field) is None]
    if missing:
        raise fail(f"missing field {missing[0]!r}, required by verifier {verifier!r}")
    return Task(task_id, spec.domain, task_effort, prompt, meta)
