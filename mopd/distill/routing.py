"""The route table: every sample goes to exactly one teacher, by its cell key `domain-effort`.

The table is built from the recipe's mix and the teacher checkpoints, and checked before any
work starts: a cell in the mix with no teacher, a teacher checkpoint that is missing or
unreadable, and a teacher whose tokenizer or vocabulary differs from the student's are all
`RoutingError`s naming what is wrong. Cells that point at the same checkpoint share one teacher.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from mopd.envs.base import Task


class RoutingError(ValueError):
    """A mix, teacher checkpoint or tokenizer that MOPD cannot route; the message names it."""


def cell_of(task: Task) -> str:
    return f"{task.domain}-{task.effort}"


@dataclass(frozen=True)
class RouteTable:
    routes: dict[str, Path]  # cell → teacher checkpoint
    weights: dict[str, float]  # cell → sampling weight (> 0)

    @property
    def teachers(self) -> dict[Path, list[str]]:
        """Distinct checkpoints and the cells each one teaches (aliases share one scorer)."""
        out: dict[Path, list[str]] = {}
        for cell, path in self.routes.items():
            out.setdefault(path, []).append(cell)
        return out

    def teacher_for(self, cell: str) -> Path:
        if cell not in self.routes:
            raise RoutingError(f"no teacher for cell {cell!r}; routed cells: {sorted(self.routes)}")
        return self.routes[cell]

    def sample_cells(self, n: int, rng: random.Random) -> list[str]:
        """n cells in proportion to the weights, shuffled: each cell gets ⌊n·w⌋ or ⌈n·w⌉ samples,
        n·w on average (systematic sampling), so no cell is starved for long stretches."""
        order = list(self.weights)
        rng.shuffle(order)
        total, offset, edge = sum(self.weights.values()), rng.random(), 0.0
        cells = []
        for cell in order:
            start, edge = edge, edge + n * self.weights[cell] / total
            cells += [cell] * (math.ceil(edge - offset) - math.ceil(start - offset))
        rng.shuffle(cells)
        return cells


def build_route_table(mix: dict[str, float], teacher_dirs: dict[str, str | Path]) -> RouteTable:
    weights = {cell: float(w) for cell, w in mix.items() if w > 0}
    if not weights:
        raise RoutingError(f"distill.mix has no cell with a positive weight: {mix}")
    missing = [cell for cell in weights if cell not in teacher_dirs]
    if missing:
        raise RoutingError(
            f"distill.mix samples {missing} but no teacher is given for them; "
            f"teachers exist for {sorted(teacher_dirs)}"
        )
    routes = {cell: Path(teacher_dirs[cell]).resolve() for cell in weights}
    return RouteTable(routes, weights)


def check_teachers(table: RouteTable, student_dir: str | Path) -> None:
    """Fail before any work if a teacher cannot score the student's token ids."""
    student = Path(student_dir)
    student_vocab = read_checkpoint(student, role="student")
    for teacher, cells in table.teachers.items():
        teacher_vocab = read_checkpoint(teacher, role=f"teacher of {', '.join(cells)}")
        check_same_vocabulary(student, student_vocab, teacher, teacher_vocab)


@dataclass(frozen=True)
class Vocabulary:
    size: int  # config.vocab_size: rows of the output layer
    tokens: dict[str, int]  # the tokenizer's token → id


def read_checkpoint(path: Path, role: str) -> Vocabulary:
    """The checkpoint's vocabulary, after checking its config, weights and tokenizer are readable."""
    if not path.is_dir():
        raise RoutingError(f"{role} checkpoint {path} does not exist")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise RoutingError(f"{role} checkpoint {path}: unreadable config.json ({err})") from None
    check_weights_readable(path, role)
    return Vocabulary(size=int(config.get("vocab_size", -1)), tokens=load_tokenizer(path, role).get_vocab())


def check_weights_readable(path: Path, role: str) -> None:
    from safetensors import safe_open

    shards = sorted(path.glob("*.safetensors"))
    if not shards and not any(path.glob("*.bin")):
        raise RoutingError(f"{role} checkpoint {path} has no weights (*.safetensors or *.bin)")
    for shard in shards:
        try:
            with safe_open(shard, framework="pt") as f:
                f.keys()
        except Exception as err:  # safetensors raises its own error types for torn files
            raise RoutingError(f"{role} checkpoint {path}: unreadable weights {shard.name} ({err})") from None


def load_tokenizer(path: Path, role: str):
    from transformers import AutoTokenizer

    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise RoutingError(f"{role} checkpoint {path} has no tokenizer (tokenizer.json); save it beside the model")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise RoutingError(f"{role} checkpoint {path}: no readable tokenizer ({err})") from None


def check_same_vocabulary(student: Path, student_vocab: Vocabulary, teacher: Path, teacher_vocab: Vocabulary) -> None:
    if student_vocab.size != teacher_vocab.size:
        raise RoutingError(
            f"teacher {teacher} has vocab_size {teacher_vocab.size} but student {student} has "
            f"{student_vocab.size}: a teacher must score the student's token ids"
        )
    if student_vocab.tokens != teacher_vocab.tokens:
        differ = sorted(set(student_vocab.tokens.items()) ^ set(teacher_vocab.tokens.items()))[:3]
        raise RoutingError(
            f"teacher {teacher} and student {student} have different tokenizers "
            f"(e.g. token → id {differ}): a teacher must score the student's token ids"
        )
