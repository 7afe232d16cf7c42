"""`mopd run` SIGKILLed twice (the whole process group: driver, Ray's gcs, raylet and workers).

Once while the teachers train, once while MOPD distils; each re-run of the same command skips
the finished stages, resumes the killed one from its last checkpoint, and the final run's
artifacts hold every step exactly once.
"""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Five of smoke's teachers (two GRPO steps each, a checkpoint after each), four actors at a time:
# the first kill finds some finished, some half-trained and (usually) one not yet started. Distillation:
# three small steps, a checkpoint after each.
CELLS = ["general-low", "code-low", "agent-low", "general-high", "code-max"]
DISTILL_STEPS = 3
OVERRIDES = [
    "baselines.mixed_rl=null",  # the smoke recipe's baseline: its resume is that of any GRPO run (CI time)
    "curves=null",  # and its learning curves: a bench of snapshots, nothing to resume mid-way
    f"teachers.cells=[{','.join(CELLS)}]",
    "distill.mix={" + ", ".join(f"{cell}: 1" for cell in CELLS) + "}",
    f"distill.steps={DISTILL_STEPS}",
    "distill.prompts_per_step=3",
    "distill.checkpoint_every=1",
]
STAGE_TIMEOUT = 900  # seconds for one run to reach its kill point (or to finish)


# ----------------------------------------------------------------------------- processes
def start_run(out: Path, log: Path) -> subprocess.Popen:
    mopd = Path(sys.executable).parent / "mopd"
    with log.open("w") as f:
        return subprocess.Popen(
            # the overrides before --out: argparse takes no more positionals after an option
            [mopd, "run", "recipes/smoke.yaml", *OVERRIDES, "--out", str(out)],
            cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


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


def run_until(proc: subprocess.Popen, ready: Callable[[], bool], log: Path, what: str) -> None:
    """Poll until `ready()`; fail if the run exits or takes too long first."""
    deadline = time.monotonic() + STAGE_TIMEOUT
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            kill_run(proc)
            pytest.fail(f"no {what} within {STAGE_TIMEOUT} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


# ----------------------------------------------------------------------------- artifacts
def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


def steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in lines(path)]


def teacher_checkpoint(folder: Path) -> int:
    """Step of a teacher's newest complete TRL checkpoint (0: none), as `mopd.rl.grpo.last_checkpoint` sees it."""
    done = [p for p in folder.glob("checkpoints/checkpoint-*") if (p / "trainer_state.json").is_file()]
    return max((int(p.name.removeprefix("checkpoint-")) for p in done), default=0)


def distill_checkpoint(folder: Path) -> int:
    done = [p for p in folder.glob("checkpoints/step-*") if (p / "trainer_state.json").is_file()]
    return max((int(p.name.removeprefix("step-")) for p in done), default=0)


def teacher_state(run: Path) -> dict[str, dict]:
    out = {}
    for cell in CELLS:
        folder = run / "teachers" / cell
        out[cell] = {
            "finished": (folder / "teacher.json").is_file(),
            "checkpoint": teacher_checkpoint(folder),
            "attempts": len(lines(folder / "attempts.jsonl")),
        }
    return out


# ----------------------------------------------------------------------------- the test
@pytest.mark.slow
@pytest.mark.timeout(2700)  # three runs, each given STAGE_TIMEOUT
def test_a_run_killed_in_teachers_and_in_distill_resumes_to_complete_artifacts(tmp_path):
    run = tmp_path / "run"
    started = time.monotonic()

    # 1. killed while the teachers train: one is finished, another has metrics and a checkpoint but
    #    is not finished
    def teachers_finished_and_mid_training() -> bool:
        if (run / "teachers" / "stage.json").exists():
            return False
        state = teacher_state(run)
        return any(s["finished"] for s in state.values()) and any(
            s["checkpoint"] and not s["finished"] and lines(run / "teachers" / c / "metrics.jsonl")
            for c, s in state.items()
        )

    log1 = tmp_path / "run1.log"
    first = start_run(run, log1)
    run_until(
        first, teachers_finished_and_mid_training, log1, "a finished and a checkpointed, unfinished teacher"
    )
    killed, gone_in = kill_run(first)
    assert killed > 3  # the driver and Ray's processes (gcs, raylet, workers) were all there
    assert (run / "base" / "stage.json").is_file() and not (run / "teachers" / "stage.json").exists()
    at_kill = teacher_state(run)
    resumable = {c for c, s in at_kill.items() if s["checkpoint"] and not s["finished"]}
    assert resumable and any(s["finished"] for s in at_kill.values()), at_kill

    # 2. the same command: base skipped, teachers resumed; killed again mid-distillation
    distill = run / "distill"

    def distill_checkpointed() -> bool:
        return (
            not (distill / "stage.json").exists()
            and bool(lines(distill / "metrics.jsonl"))  # not parsed: the trainer may be writing a line
            and distill_checkpoint(distill) > 0
        )

    log2 = tmp_path / "run2.log"
    second = start_run(run, log2)
    run_until(second, distill_checkpointed, log2, "a distill checkpoint")
    kill_run(second)
    assert "base: complete for these inputs" in log2.read_text()
    assert (run / "teachers" / "stage.json").is_file() and not (distill / "stage.json").exists()
    resumed_at = distill_checkpoint(distill)
    kept = lines(distill / "metrics.jsonl")[:resumed_at]  # the steps the checkpoint already holds
    assert 1 <= resumed_at <= DISTILL_STEPS and [json.loads(line)["step"] for line in kept] == list(
        range(1, resumed_at + 1)
    )

    # 3. the same command again, to the end
    log3 = tmp_path / "run3.log"
    third = start_run(run, log3)
    try:
        third.wait(timeout=STAGE_TIMEOUT)
    except subprocess.TimeoutExpired:
        kill_run(third)
        pytest.fail(f"the last run did not finish within {STAGE_TIMEOUT} s:\n{log3.read_text()[-3000:]}")
    output = log3.read_text()
    assert third.returncode == 0, output[-3000:]
    assert not alive(run_processes(third.pid)), "the finished run left processes behind"
    assert "base: complete for these inputs" in output and "teachers: complete for these inputs" in output
    elapsed = time.monotonic() - started

    # every stage is complete, for the hashes the manifest names
    manifest = json.loads((run / "manifest.json").read_text())
    statuses = {name: stage["status"] for name, stage in manifest["stages"].items()}
    assert statuses == {"base": "skipped", "teachers": "skipped", "distill": "done", "bench": "done"}
    for name, stage in manifest["stages"].items():
        assert json.loads((run / name / "stage.json").read_text())["hash"] == stage["hash"]

    # teachers: every step exactly once; finished ones were skipped, half-trained ones resumed
    assert sorted(p.name for p in (run / "teachers").iterdir() if p.is_dir()) == sorted(CELLS)
    for cell in CELLS:
        folder = run / "teachers" / cell
        teacher = json.loads((folder / "teacher.json").read_text())
        assert (folder / "config.json").is_file() and teacher["spec"] == cell
        assert steps(folder / "metrics.jsonl") == list(range(1, teacher["steps"] + 1)), cell
        attempts = [json.loads(line) for line in lines(folder / "attempts.jsonl")]
        before = at_kill[cell]
        if before["finished"]:
            assert len(attempts) == before["attempts"], f"{cell} was finished, yet trained again"
        else:
            assert len(attempts) == before["attempts"] + 1, (cell, attempts)
            assert attempts[-1]["resumed_from"] == before["checkpoint"], (cell, attempts, before)
        assert not (folder / "checkpoints").exists()
    assert any(
        json.loads(lines(run / "teachers" / c / "attempts.jsonl")[-1])["resumed_from"] > 0 for c in resumable
    )

    # distill: steps 1..N exactly once, and the steps before the checkpoint were not redone
    final = lines(distill / "metrics.jsonl")
    assert [json.loads(line)["step"] for line in final] == list(range(1, DISTILL_STEPS + 1))
    assert final[:resumed_at] == kept  # byte for byte: their timings would differ had they run again
    assert distill_checkpoint(distill) == DISTILL_STEPS and (distill / "model" / "config.json").is_file()

    report = json.loads((run / "bench" / "report.json").read_text())
    assert report["results"] and (run / "bench" / "report.md").is_file()
    print(
        f"three runs, two kills: {elapsed:.0f} s; {killed} processes gone {gone_in:.1f} s after the first kill;"
        f" distill resumed at step {resumed_at}; teachers at the first kill: {at_kill}"
    )
