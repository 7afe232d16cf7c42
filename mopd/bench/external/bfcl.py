"""BFCL v4 function calling (Patil et al., the Berkeley Function Calling Leaderboard): the simple
(Python), multiple, parallel and parallel_multiple categories, scored by BFCL's AST rules
(`bfcl_checker`) against its `possible_answer/` ground truth.

A model reads BFCL's default system prompt for prompted (non-FC) models, with the functions as JSON,
and the question as the user turn; it answers `[func(a=1, b="x"), other(c=2)]`. The problems are the
four categories' files in that order (the first `limit` of each).
"""

from __future__ import annotations

import json

from mopd.bench.external import answer_of
from mopd.bench.external.bfcl_checker import CallError, check_calls, parse_calls
from mopd.bench.external.sources import BFCL_CATEGORIES, bfcl_records
from mopd.envs.base import EFFORTS, Task, Verdict
from mopd.envs.splits import content_hash

# BFCL's DEFAULT_SYSTEM_PROMPT (bfcl_eval/constants/default_prompts.py: python, no tag, JSON docs, plaintext, classic)
SYSTEM_PROMPT = (
    "You are an expert in composing functions.You are given a question and a set of possible functions. Based on "
    "the question, you will need to make one or more function/tool calls to achieve the purpose. If none of the "
    "functions can be used, point it out. If the given question lacks the parameters required by the function, also "
    "point it out.\n\nYou should only return the function calls in your response.\n\nIf you decide to invoke any of "
    "the function(s), you MUST put it in the format of [func_name1(params_name1=params_value1, "
    "params_name2=params_value2...), func_name2(params)].  You SHOULD NOT include any other text in the response."
    "\n\nAt each turn, you should try your best to complete the tasks requested by the user within the current "
    "turn. Continue to output functions to call until you have fulfilled the user's request to the best of your "
    "ability. Once you have no more functions to call, the system will consider the current turn complete and "
    "proceed to the next turn or task.\n\nHere is a list of functions in json format that you can invoke.\n"
    "{functions}\n"
)


class BFCLEnv:
    domain = "bfcl"

    def __init__(self, categories: list[str] | tuple[str, ...] = BFCL_CATEGORIES):
        unknown = [c for c in categories if c not in BFCL_CATEGORIES]
        if unknown or not categories:
            raise ValueError(f"bfcl: unknown categories {unknown}; choose some of {list(BFCL_CATEGORIES)}")
        self.categories = tuple(categories)

    def tasks(self, effort: str, limit: int | None = None) -> list[Task]:
        """Each category's problems in its file's order (the first `limit` of each), asked at `effort`."""
        if effort not in EFFORTS:
            raise ValueError(f"effort must be one of {list(EFFORTS)}, got {effort!r}")
        return [
            task_of(question, answer, category, effort)
            for category in self.categories
            for question, answer in bfcl_records(category)[:limit]
        ]

    def verify(self, task: Task, completion: str) -> Verdict:
        answer = answer_of(completion)
        if answer is None:
            return Verdict(0.0, {"reason": "think block not closed"})
        try:
            calls = parse_calls(answer)
        except CallError as err:
            return Verdict(0.0, {"reason": f"unparsable: {err}", "answer": answer[:300]})
        valid, why = check_calls(task.meta["functions"], calls, task.meta["ground_truth"], task.meta["category"])
        return Verdict(float(valid), {"calls": calls} if valid else {"reason": why, "calls": calls})

    def verify_many(self, tasks: list[Task], completions: list[str]) -> list[Verdict]:
        return [self.verify(task, completion) for task, completion in zip(tasks, completions, strict=True)]


def task_of(question: dict, answer: dict, category: str, effort: str) -> Task:
    turns = question["question"][0]
    system = "\n\n".join(t["content"] for t in turns if t["role"] == "system")
    prompt = "\n\n".join(t["content"] for t in turns if t["role"] == "user")
    functions = question["function"]
    meta = {
        "category": category,
        "functions": functions,
        "ground_truth": answer["ground_truth"],
        "system": (system + "\n\n" if system else "") + SYSTEM_PROMPT.format(functions=json.dumps(functions, indent=4)),
        "content_hash": content_hash(prompt, json.dumps(functions, sort_keys=True)),
    }
    return Task(f"bfcl-{question['id']}", "bfcl", effort, prompt, meta)
