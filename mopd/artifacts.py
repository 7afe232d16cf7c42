"""Crash-safe artifacts: atomic files and directories, config hashes, resumable metrics logs, and where
a stage directory keeps its checkpoint.

Every stage reads and writes directories. Nothing half-written ever sits at a final path: files
and checkpoint directories are written beside their target and renamed into place, so a crash, a
kill or a full disk leaves the previous artifact intact.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def config_hash(*parts: Any) -> str:
    """A stable hash of JSON-serialisable parts (dict key order does not matter)."""
    blob = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def write_text_atomic(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes 0600 files; keep the usual mode
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json_atomic(path: str | Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: str | Path, default: Any = None) -> Any:
    path = Path(path)
    return json.loads(path.read_text()) if path.is_file() else default


def set_aside(directory: Path) -> Path:
    """Move `directory` to `<name>.previous/` beside it, replacing an older one; returns the new place."""
    previous = directory.with_name(directory.name + ".previous")
    shutil.rmtree(previous, ignore_errors=True)
    directory.rename(previous)
    return previous


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a fresh sibling directory; on success it replaces `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes 0700 directories
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class MetricsLog:
    """`metrics.jsonl`, one JSON object per step; resuming from a checkpoint drops later steps.

    A run killed after logging step 12 but checkpointed at step 10 redoes steps 11–12; truncating
    on resume keeps every step exactly once.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def records(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line torn by a kill
                out.append(json.loads(line))
        return out

    def resume_after(self, step: int) -> None:
        """Keep only records with `step` ≤ the checkpointed step (atomically)."""
        kept = [r for r in self.records() if r.get("step", -1) <= step]
        write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def log(self, step: int, **metrics: Any) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}, default=float) + "\n")
            f.flush()
            os.fsync(f.fileno())


# ----------------------------------------------------------------------------- learning-curve snapshots
def curve_snapshot(stage_dir: str | Path, step: int) -> Path:
    """Where a training stage keeps its policy after `step` for the `curves` stage: `curve/step-NNNNNN`."""
    return Path(stage_dir) / "curve" / f"step-{step:06d}"


def curve_snapshots(stage_dir: str | Path) -> dict[int, Path]:
    """step → snapshot of a stage's complete snapshots (each written whole by `atomic_dir`)."""
    found = sorted((Path(stage_dir) / "curve").glob("step-*"))
    return {int(path.name.removeprefix("step-")): path for path in found if (path / "config.json").is_file()}


# ----------------------------------------------------------------------------- stage directories
def checkpoint_in(stage_dir: str | Path) -> Path:
    """A stage directory's HF checkpoint: its `model/` folder where that holds one and the directory
    itself does not, else the directory itself."""
    stage_dir = Path(stage_dir)
    model = stage_dir / "model"
    return model if (model / "config.json").is_file() and not (stage_dir / "config.json").is_file() else stage_dir
