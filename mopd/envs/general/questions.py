"""Questions and answers of the general domain: the question text, its true answer, the canonical
form of an answer, the split key (`task_key`) and the questions a text states (`contents`)."""

from __future__ import annotations

import re
from typing import Any

from mopd.envs.splits import content_hash


def question_for(terms: list[int], ops: list[str]) -> str:
    expression = str(terms[0]) + "".join(f" {op} {term}" for op, term in zip(ops, terms[1:], strict=True))
    return f"Compute {expression}."


def evaluate(terms: list[int], ops: list[str]) -> int:
    total = terms[0]
    for op, term in zip(ops, terms[1:], strict=True):
        total = total * term if op == "*" else total + term if op == "+" else total - term
    return total


def task_key(question: str, answer: Any) -> str:
    """The split key: the question and the answer (as the verifier reads it), not the family that drew them."""
    return content_hash(question, normalize_answer(str(answer)))


QUESTION = re.compile(r"Compute (-?\d+(?: [-+*] -?\d+)*)\.")
EQUATION = re.compile(r"(?<![\w.])(-?\d+(?:[-+*]\d+)+)=-?\d+(?![\d.])")
OPERATION = re.compile(r"\s*([-+*])\s*(-?\d+)")


def contents(text: str) -> set[str]:
    """The questions a text states, answered: each "Compute …." question, and each worked sum of a
    trace (`4+7+1=12`, the question "Compute 4 + 7 + 1."), keyed as the task of that question is
    (`task_key`, with the true answer whatever the text wrote). reasoning-gym questions have no
    common form: their key is the task's own."""
    expressions = QUESTION.findall(text) + EQUATION.findall(text)
    return {task_key(question_for(terms, ops), evaluate(terms, ops)) for terms, ops in map(parse_expression, expressions)}


def parse_expression(expression: str) -> tuple[list[int], list[str]]:
    first = re.match(r"\s*(-?\d+)", expression)
    pairs = OPERATION.findall(expression[first.end():])
    return [int(first.group(1)), *(int(term) for _, term in pairs)], [op for op, _ in pairs]


NUMBER = re.compile(r"[+-]?\d[\d,_ ]*")


def normalize_answer(text: str) -> str:
    """Canonical answer text: no padding or final period; numbers without separators or sign '+'."""
    text = " ".join(text.replace("\u2212", "-").split()).removesuffix(".")
    if NUMBER.fullmatch(text):
        return str(int(re.sub(r"[,_ ]", "", text)))
    return text
