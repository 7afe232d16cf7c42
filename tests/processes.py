"""A run's processes, found and killed as a whole: the driver, Ray's gcs and raylet, and its workers."""

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest


def processes() -> dict[int, tuple[int, int, int, str, str]]:
    """pid → (ppid, process group, session, start time, state) of every live process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # fields from the 3rd on; the name may hold spaces
        state, started = fields[0], fields[19]
        ppid, group, session = (int(field) for field in fields[1:4])
        if state not in ("Z", "X"):  # a zombie has exited; only its parent's wait() is missing
            out[int(entry.name)] = (ppid, group, session, started, state)
    return out


def run_processes(leader: int) -> set[tuple[int, str]]:
    """(pid, start time) of every process of the run: its group, its session and all descendants."""
    table = processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_) in table.items():
        children.setdefault(ppid, []).append(pid)
    found = {pid for pid, (_, group, session, *_) in table.items() if leader in (group, session)}
    stack = [leader, *found]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return {(pid, table[pid][3]) for pid in found if pid in table}


def alive(members: set[tuple[int, str]]) -> set[tuple[int, str]]:
    table = processes()
    return {(pid, started) for pid, started in members if pid in table and table[pid][3] == started}


def kill_run(proc: subprocess.Popen) -> tuple[int, float]:
    """SIGKILL the run's process group, wait until every process of the run is gone.

    Returns how many processes there were and the seconds until the last was gone. Ray's workers
    sit in process groups of their own (same session): they go when their raylet does.
    """
    members = run_processes(proc.pid)
    start = time.monotonic()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    # the raylet's workers notice its death within seconds, but one still importing Ray (an actor
    # about to start) only once its imports are done: ~30 s on a loaded 2-core box
    deadline = time.monotonic() + 120
    while alive(members) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = alive(members) | alive(run_processes(proc.pid))
    assert not survivors, f"processes of the killed run outlived SIGKILL of its group: {describe(survivors)}"
    return len(members), time.monotonic() - start


def describe(members: set[tuple[int, str]]) -> list[str]:
    out = []
    for pid, _ in sorted(members):
        try:
            out.append(
                f"{pid}: {(Path('/proc') / str(pid) / 'cmdline').read_text().replace(chr(0), ' ')[:120]}"
            )
        except OSError:
            out.append(f"{pid}: gone")
    return out


def run_until(proc: subprocess.Popen, ready: Callable[[], bool], log: Path, what: str, timeout: float) -> None:
    """Poll until `ready()`; fail if the run exits or takes `timeout` seconds first."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            kill_run(proc)
            pytest.fail(f"no {what} within {timeout} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
