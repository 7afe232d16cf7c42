"""The program the sandbox runs on a candidate, and the reading of the record it writes.

Verification never trusts the program. The sandboxed child receives only the code, the entry
name, the hidden INPUTS and a per-run nonce; it calls `f` on each input and writes one
nonce-tagged record of plain JSON values. The expected outputs never enter the sandbox: the
parent parses the record (plain data only, whatever the child did to its own json or builtins)
and compares it, type-strictly, to the expected outputs. Exit status, prints, exceptions and
objects with a lying `__eq__` therefore cannot make a pass; only the right values can.
"""

from __future__ import annotations

import json
import marshal

from mopd.envs.base import Task
from mopd.envs.sandbox import Program, RunResult

# Runs inside the sandbox. It sees the candidate's code, the entry name, the inputs and the nonce;
# never the expected outputs. Whatever the candidate does to this process only changes what it
# writes, and the parent trusts nothing but plain JSON values that equal the expected ones.
# It imports only built-in modules (`import json` alone would double the cost of a run): the
# payload arrives marshalled, and `encode` writes JSON for plain values and refuses anything else.
HARNESS = r"""
import marshal, sys

def encode(value, depth=0):
    kind = type(value)
    if depth > 100:
        raise TypeError("nested too deep")
    if value is None or kind is bool:
        return {None: "null", True: "true", False: "false"}[value]
    if kind is int:
        return str(value)
    if kind is float and value - value == 0:  # finite
        return repr(value)
    if kind is str:
        return '"' + "".join(map(encode_char, value)) + '"'
    if kind is list:
        return "[" + ",".join(encode(v, depth + 1) for v in value) + "]"
    if kind is dict and all(type(k) is str for k in value):
        return "{" + ",".join(encode(k) + ":" + encode(v, depth + 1) for k, v in value.items()) + "}"
    raise TypeError(f"returned a {kind.__name__}, not a plain list/dict/str/int/float/bool/None")

def encode_char(c):
    code = ord(c)
    if 32 <= code < 127:
        return "\\" + c if c in '"\\' else c
    if code < 0x10000:
        return "\\u%04x" % code
    code -= 0x10000
    return "\\u%04x\\u%04x" % (0xD800 + (code >> 10), 0xDC00 + (code & 0x3FF))

def run(payload):
    namespace = {"__name__": "candidate"}
    try:
        exec(compile(payload["code"], "<candidate>", "exec"), namespace)
        function = namespace[payload["entry"]]
    except BaseException as exc:
        return '{"error":' + encode(f"defining the code failed: {type(exc).__name__}: {exc}"[:500]) + "}"
    cases = []
    for args in payload["inputs"]:
        try:
            cases.append('{"ok":' + encode(function(*args)) + "}")
        except BaseException as exc:
            cases.append('{"error":' + encode(f"{type(exc).__name__}: {exc}"[:200]) + "}")
    return '{"cases":[' + ",".join(cases) + "]}"

payload = marshal.loads(sys.stdin.buffer.read())
channel = sys.stdout
record = run(payload)
channel.write("\n" + payload["nonce"] + record + "\n")
channel.flush()
"""


def harness_program(code: str, task: Task, nonce: str) -> Program:
    payload = {
        "code": code,
        "entry": task.meta["entry"],
        "inputs": [t["args"] for t in task.meta["tests"]],
        "nonce": nonce,
    }
    return Program(HARNESS, marshal.dumps(payload, 4))


def read_cases(result: RunResult, nonce: str, expected: int) -> list[dict] | str:
    """The child's one nonce-tagged record, parsed as plain data: a result per input, or why not."""
    records = [line[len(nonce) :] for line in result.stdout.splitlines() if line.startswith(nonce)]
    if len(records) != 1:
        return f"{len(records)} result records (need exactly 1)"
    try:
        record = json.loads(records[0])
    except (ValueError, RecursionError):
        return "unreadable result record"
    cases = record.get("cases") if isinstance(record, dict) else None
    if not isinstance(cases, list) or len(cases) != expected:
        error = record.get("error") if isinstance(record, dict) else None
        return str(error or "malformed result record")[:500]
    return cases
