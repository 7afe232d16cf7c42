"""Train, dev and test: a task's split is a function of its canonical content, never of a seed.

    key = content_hash(question, answer)        # what decides the task, normalised
    split_of(key) in ("train", "dev", "test")   # 80% / 10% / 10% of the hash space

Every domain derives one key per task from what decides it, independent of the family or the
generator that produced it: general hashes the question and the answer, code the hidden function
(its examples and tests follow from it), agent the database the question runs against. Each
env's `sample(n, seed, split)` keeps only candidates whose key falls in `split`, so no seed, family
or sample size can put one content into two splits. The key travels as `task.meta["content_hash"]`.

Text a model is trained on states contents of its own: a failed attempt shows another function, a
trace works a sub-sum that is itself a question. Each domain lists the contents a text states
(`mopd.envs.text_contents`: code, each function in a code block; general, each question it asks or
sum it works with its answer; agent, none beyond its task's database, see `mopd.envs.agent`), and one
rule decides what may be trained on: `trainable(keys)`, every content of the text is of the train
split. The generators choose only trainable candidates (the expert's traces, failed-attempt demos,
corrupted answers) and the base's SFT refuses any example that breaks the rule.

Training stages write the keys they trained on (`write_trained_on`: sorted, one per line) into
their directory: the task keys (`trained_on.txt`) and the content keys found in the text they trained
on (`trained_text.txt`). `mopd bench` reads both back (`read_trained_on`) and counts overlaps per cell.
"""

from __future__ import annotations

import hashlib
import os
import unicodedata
from collections.abc import Iterable
from pathlib import Path

SPLITS: tuple[str, ...] = ("train", "dev", "test")
BUCKETS = 100
TEST_BUCKETS = range(0, 10)
DEV_BUCKETS = range(10, 20)
KEY_CHARS = 16  # 64 bits: no collision among millions of tasks
TRAINED_ON = "trained_on.txt"  # the content keys of the tasks a stage trained on
TRAINED_TEXT = "trained_text.txt"  # the content keys stated in the text a stage trained on
RECORDS = (TRAINED_ON, TRAINED_TEXT)


def normalize(text: str) -> str:
    """Canonical text: Unicode-normalised, case-folded, with no whitespace and no final period."""
    text = unicodedata.normalize("NFKC", str(text)).replace("\u2212", "-").casefold()
    return "".join(text.split()).rstrip(".")


def content_hash(*parts: str) -> str:
    """The content key of a task: a hash of its normalised parts, in order."""
    joined = "\x1f".join(normalize(part) for part in parts)
    return hashlib.sha256(joined.encode()).hexdigest()[:KEY_CHARS]


def is_key(key: object) -> bool:
    return isinstance(key, str) and len(key) == KEY_CHARS and all(c in "0123456789abcdef" for c in key)


def split_of(key: str) -> str:
    bucket = int(hashlib.sha256(f"split:{key}".encode()).hexdigest()[:8], 16) % BUCKETS
    if bucket in TEST_BUCKETS:
        return "test"
    if bucket in DEV_BUCKETS:
        return "dev"
    return "train"


def trainable(keys: Iterable[str]) -> bool:
    """The one rule for text a model is trained on: every content it states is of the train split."""
    return all(split_of(key) == "train" for key in keys)


def check_split(split: str, where: str = "split") -> str:
    if split not in SPLITS:
        raise ValueError(f"{where}={split!r}: must be one of {list(SPLITS)} (dev for tuning, test for reports)")
    return split


# ------------------------------------------------------------------------- training records
def write_trained_on(stage_dir: str | Path, keys: Iterable[str], record: str = TRAINED_ON) -> Path:
    """Write the sorted, distinct content keys a stage trained on (`record`: its tasks' keys, or
    `TRAINED_TEXT` for the contents its text states); atomic (temp file, rename)."""
    path = Path(stage_dir) / record
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{key}\n" for key in sorted(set(keys))))
    os.replace(tmp, path)
    return path


def read_trained_on(stage_dir: str | Path, record: str = TRAINED_ON) -> set[str] | None:
    """The keys a stage recorded, or None when it wrote no such record."""
    path = Path(stage_dir) / record
    if not path.is_file():
        return None
    return {line.strip() for line in path.read_text().splitlines() if line.strip()}


def task_keys(tasks: Iterable) -> list[str]:
    """Each task's content key (`meta["content_hash"]`); a task without one cannot be recorded or audited."""
    keys = []
    for task in tasks:
        key = task.meta.get("content_hash")
        if not is_key(key):
            raise ValueError(f"task {task.id} ({task.domain}) has no content key: meta['content_hash'] is {key!r}")
        keys.append(key)
    return keys
