"""The code domain's verifier: the code of a completion, the task checks, the score of a sandboxed
run against the expected outputs, and the functions a text states (`contents`, the split audit)."""

from __future__ import annotations

import json
import re
from typing import Any

from mopd.envs.base import Task, Verdict, split_thinking
from mopd.envs.chat import strip_turn_end
from mopd.envs.code.harness import read_cases
from mopd.envs.sandbox import RunResult
from mopd.envs.splits import content_hash

FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)

DEFINITION = re.compile(r"^def\s+\w+\s*\(.*?(?=^def\s|\Z)", re.DOTALL | re.MULTILINE)


def contents(text: str) -> set[str]:
    """The functions a text states: each definition with a body in a fenced code block, keyed as a
    task's function is (`content_hash` of its source, whitespace and case aside)."""
    return {
        content_hash(definition.strip())
        for block in FENCED.findall(text)
        for definition in DEFINITION.findall(block)
        if "return" in definition
    }


def extract_code(completion: str) -> str | Verdict:
    parts = split_thinking(completion)
    if parts is None:
        return Verdict(0.0, {"reason": "no closed think block"})
    answer = strip_turn_end(parts[1])
    fenced = FENCED.search(answer)
    code = fenced.group(1) if fenced else answer
    if not code.strip():
        return Verdict(0.0, {"reason": "no code after </think>"})
    return code


def check_code_meta(task: Task) -> None:
    tests = task.meta.get("tests")
    if "entry" not in task.meta or not isinstance(tests, list) or not tests:
        raise ValueError(f"task {task.id}: code tasks need meta.entry and a non-empty meta.tests list")
    bad = [
        i
        for i, t in enumerate(tests)
        if not (isinstance(t, dict) and isinstance(t.get("args"), list) and "expected" in t)
    ]
    if bad:
        raise ValueError(f"task {task.id}: meta.tests[{bad[0]}] must be {{'args': [...], 'expected': ...}}")


def score(task: Task, result: RunResult, nonce: str, backend: str) -> Verdict:
    """Compare the child's record to the expected outputs."""
    tests = task.meta["tests"]
    details: dict[str, Any] = {
        "status": result.status,
        "returncode": result.returncode,
        "sandbox": backend,
        "passed": 0,
        "total": len(tests),
    }
    cases = read_cases(result, nonce, len(tests))
    if isinstance(cases, str):
        return Verdict(0.0, {**details, "reason": cases, "stderr": result.stderr[-500:]})
    outcomes = [same_value(case, test["expected"]) for case, test in zip(cases, tests, strict=True)]
    details["passed"] = sum(outcomes)
    if not all(outcomes):
        first = outcomes.index(False)
        details["failed"] = {"args": tests[first]["args"], "got": str(cases[first])[:300]}
    return Verdict(float(all(outcomes)), details)


def failures(examples: list[dict], cases: list[dict] | str) -> str | None:
    """What running the examples showed, a line per failing one; None when they all pass."""
    if isinstance(cases, str):
        return f"error: {cases}"
    lines = []
    for case, example in zip(cases, examples, strict=True):
        call = f"f({', '.join(repr(arg) for arg in example['args'])})"
        if not isinstance(case, dict) or "ok" not in case:
            lines.append(f"{call} raised {str(case.get('error') if isinstance(case, dict) else case)[:200]}")
        elif not same_value(case, example["expected"]):
            lines.append(f"{call} returned {case['ok']!r}, expected {example['expected']!r}")
    return "\n".join(lines) or None


def same_value(case: Any, expected: Any) -> bool:
    """Type-strict equality of plain JSON data (1, 1.0 and True differ)."""
    if not isinstance(case, dict) or "ok" not in case:
        return False
    return json.dumps(case["ok"], sort_keys=True) == json.dumps(expected, sort_keys=True)
