"""Run untrusted Python programs in isolation, many at a time.

Each program runs as its own `python -I -S -B` process, inside bubblewrap when it works:
new user/pid/net/ipc/uts namespaces, a read-only view of only what Python needs, a private
size-capped tmpfs at /tmp, a clean environment, and death with its parent. Where bwrap is
missing or unusable the sandbox refuses to start (`SandboxUnavailable`, with the install hint),
unless the caller opted into the degraded rlimit sandbox (`allow_degraded=True`, the recipe's
`sandbox: {allow_degraded: true}`): a new session, a private temp dir as cwd, a clean environment
and a separate uid when we are root, but the host's network, file system and /proc.

In both modes the program starts with `limits_prelude`, which lowers its own hard rlimits (CPU
time, address space, processes, file size, open files, core dumps) before any untrusted code
runs, so nothing it starts can raise them again. A wall-clock timeout kills the whole process
group. Output goes to unlinked temp files, which the file-size limit caps.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from typing import Literal

log = logging.getLogger(__name__)

Backend = Literal["auto", "bwrap", "rlimit"]
# As root, each worker slot runs programs as its own unprivileged uid (root ignores RLIMIT_NPROC, and
# the rlimit fallback kills leftovers by uid). Blocks of uids differ by process and by Sandbox.
SANDBOX_UID_BASE = 1_000_000
UIDS_PER_PROCESS = 256
_sandbox_count = itertools.count()


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 2
    wall_s: float = 5.0
    # Per process; with max_processes a run holds at most ~1 GiB, so a pool of 4 stays well under
    # what a shared 24 GiB machine can spare.
    memory_bytes: int = 256 << 20
    max_processes: int = 4  # counted inside the sandbox's user namespace: bwrap's init, python, 2 more
    file_bytes: int = 1 << 20
    tmpfs_bytes: int = 16 << 20
    open_files: int = 64


@dataclass(frozen=True)
class Program:
    source: str
    stdin: bytes = b""


@dataclass(frozen=True)
class RunResult:
    status: Literal["exited", "timeout", "error"]
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float


def limits_prelude(limits: Limits) -> str:
    """Python that the sandboxed process runs first: hard limits it can only lower, never raise."""
    pairs = {
        "RLIMIT_CPU": limits.cpu_s,
        "RLIMIT_AS": limits.memory_bytes,
        "RLIMIT_NPROC": limits.max_processes,
        "RLIMIT_FSIZE": limits.file_bytes,
        "RLIMIT_NOFILE": limits.open_files,
        "RLIMIT_CORE": 0,
    }
    lines = [f"_r.setrlimit(_r.{name}, ({value}, {value}))" for name, value in pairs.items()]
    return "import resource as _r\n" + "\n".join(lines) + "\ndel _r\n"


class Sandbox:
    """Runs programs isolated from the host and from each other; `run_many` uses a worker pool."""

    def __init__(
        self, limits: Limits | None = None, workers: int = 4, backend: Backend = "auto", allow_degraded: bool = False
    ):
        self.limits = limits or Limits()
        self.workers = workers
        self.python = sandbox_python()
        self.backend = choose_backend(backend, self.python, allow_degraded)
        block = SANDBOX_UID_BASE + (os.getpid() % 100_000) * UIDS_PER_PROCESS
        first = next(_sandbox_count) * workers
        self._slots: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        for slot in range(workers):
            self._slots.put(block + (first + slot) % UIDS_PER_PROCESS if os.geteuid() == 0 else None)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")

    def run_many(self, programs: list[Program]) -> list[RunResult]:
        return list(self._pool.map(self.run, programs))

    def run(self, program: Program) -> RunResult:
        uid = self._slots.get()
        try:
            return self._run_as(program, uid)
        finally:
            self._slots.put(uid)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _run_as(self, program: Program, uid: int | None) -> RunResult:
        source = limits_prelude(self.limits) + program.source
        if self.backend == "bwrap":
            argv = bwrap_argv(self.python, self.limits) + python_argv(self.python, source)
            return run_process(argv, program.stdin, self.limits.wall_s, "/", {}, uid)
        with tempfile.TemporaryDirectory(prefix="mopd-sandbox-") as workdir:
            env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir}
            cwd = private_workdir(workdir, uid)
            result = run_process(
                python_argv(self.python, source), program.stdin, self.limits.wall_s, cwd, env, uid
            )
            if uid is not None:
                kill_all_processes_of(uid)  # no pid namespace here: catch whatever escaped the group
        return result


def run_process(
    argv: list[str], stdin: bytes, wall_s: float, cwd: str, env: dict, uid: int | None
) -> RunResult:
    prefix, ids = as_user(uid)
    start = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(
                prefix + argv,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                cwd=cwd,
                env=env,
                start_new_session=True,
                close_fds=True,
                **ids,
            )
        except OSError as exc:
            return RunResult("error", None, "", f"could not start the sandbox: {exc}", 0.0)
        status: Literal["exited", "timeout"] = "exited"
        try:
            proc.communicate(stdin, timeout=wall_s)
        except subprocess.TimeoutExpired:
            status = "timeout"
            kill_group(proc)
        except BaseException:
            kill_group(proc)
            raise
        wall = time.monotonic() - start
        return RunResult(status, proc.returncode, read_capped(out), read_capped(err), wall)


def as_user(uid: int | None) -> tuple[list[str], dict]:
    """Command prefix and Popen options that run a command as `uid` (None: as ourselves).

    setpriv keeps Popen on its vfork path; asking Popen itself to switch uid makes it fork our
    whole (possibly model-sized) process first, which costs ~10 ms of CPU per program.
    """
    if uid is None:
        return [], {}
    if shutil.which("setpriv"):
        return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"], {}
    return [], {"user": uid, "group": uid, "extra_groups": []}


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def read_capped(file, cap: int = 1 << 20) -> str:
    file.seek(0)
    return file.read(cap).decode("utf-8", errors="replace")


def kill_all_processes_of(uid: int) -> None:
    """`kill -9 -1` as the slot's uid: signals every process of that uid, and nothing else."""
    prefix, ids = as_user(uid)
    subprocess.run(
        [*prefix, "kill", "-9", "-1"],
        **ids,
        env={},
        check=False,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def private_workdir(workdir: str, uid: int | None) -> str:
    if uid is not None:
        os.chown(workdir, uid, uid)
    os.chmod(workdir, 0o700)
    return workdir


def python_argv(python: str, source: str) -> list[str]:
    return [python, "-I", "-S", "-B", "-c", source]


def bwrap_argv(python: str, limits: Limits) -> list[str]:
    # New user/pid/net/ipc/uts/cgroup namespaces, no nested user namespaces, python itself as the
    # namespace's pid 1 (no bwrap init left behind for the system's init to reap), a clean env.
    argv = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--as-pid-1"]
    argv += ["--new-session", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/lib", "/lib64", "/sbin"):  # symlinks into /usr on merged-/usr systems
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    prefix = os.path.dirname(os.path.dirname(python))
    if not prefix.startswith("/usr/") and prefix != "/usr":
        argv += ["--ro-bind", prefix, prefix]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.tmpfs_bytes), "--tmpfs", "/tmp"]
    argv += ["--remount-ro", "/", "--chdir", "/tmp"]
    return argv


def sandbox_python() -> str:
    """A Python interpreter the sandbox user can execute (the harness needs only the stdlib).

    When we are root the program runs as an unprivileged uid, so the interpreter must be reachable
    by others: a pyenv Python under /root is not, the system one is.
    """
    candidates = [os.path.realpath(sys._base_executable)]
    for name in ("python3", "/usr/bin/python3"):
        found = shutil.which(name)
        if found:
            candidates.append(os.path.realpath(found))
    for path in candidates:
        if os.geteuid() != 0 or executable_by_others(path):
            return path
    raise RuntimeError(
        f"no Python interpreter that an unprivileged sandbox user can execute (tried {candidates}); "
        "install the system python3 (e.g. 'apt-get install python3')"
    )


def executable_by_others(path: str) -> bool:
    if not os.stat(path).st_mode & stat.S_IXOTH:
        return False
    directory = os.path.dirname(path)
    while True:
        if not os.stat(directory).st_mode & stat.S_IXOTH:
            return False
        if directory == "/":
            return True
        directory = os.path.dirname(directory)


class SandboxUnavailable(RuntimeError):
    """bubblewrap cannot isolate programs here, and the degraded sandbox was not opted into."""


INSTALL_HINT = (
    "install bubblewrap ('apt-get install bubblewrap' as root; `make run` and `make test` do it), or accept "
    "the weaker rlimit sandbox with `sandbox: {allow_degraded: true}` in the recipe or --allow-degraded-sandbox"
)
DEGRADED = "DEGRADED rlimit sandbox (host network, file system and /proc shared)"


def choose_backend(requested: Backend, python: str, allow_degraded: bool = False) -> Literal["bwrap", "rlimit"]:
    """bwrap when it works; rlimit only when asked for by name or opted into; else SandboxUnavailable."""
    if requested == "rlimit":
        return "rlimit"
    problem = bwrap_problem(python)
    if problem is None:
        return "bwrap"
    if requested == "bwrap" or not allow_degraded:
        raise SandboxUnavailable(
            f"the code sandbox needs bubblewrap, which does not work here: {problem}. To fix: {INSTALL_HINT}"
        )
    log.warning(
        "bubblewrap is unusable (%s): allow_degraded is set, so code runs in the %s. Programs still get "
        "rlimits, a new session, a private cwd, a clean environment and (as root) their own uid, but "
        "NOT a network namespace, a read-only file system or a private /proc.",
        problem,
        DEGRADED,
    )
    return "rlimit"


def resolve_backend(backend: Backend = "auto", allow_degraded: bool = False) -> Literal["bwrap", "rlimit"]:
    """The backend a `Sandbox(backend=..., allow_degraded=...)` would get here, checked before any work."""
    return choose_backend(backend, sandbox_python(), allow_degraded)


def describe_backend(backend: str) -> str:
    """How a report names the sandbox that judged code."""
    return "bubblewrap sandbox" if backend == "bwrap" else DEGRADED


@cache
def bwrap_problem(python: str) -> str | None:
    """Why bwrap cannot run our interpreter here, or None when a probe program runs fine."""
    if shutil.which("bwrap") is None:
        return "the bwrap executable is not on PATH"
    uid = SANDBOX_UID_BASE - 1 if os.geteuid() == 0 else None
    argv = bwrap_argv(python, Limits()) + python_argv(python, "print('sandbox-ok')")
    result = run_process(argv, b"", 10.0, "/", {}, uid)
    if result.stdout.strip() == "sandbox-ok":
        return None
    return f"probe exited {result.returncode} ({result.status}): {result.stderr.strip()[:300]}"


class SandboxOwner:
    """An env that judges programs in a sandbox pool started at its first program (`sandbox_options`:
    `Sandbox`'s arguments) and closed with the env."""

    sandbox_options: dict
    _sandbox: Sandbox | None = None

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            self._sandbox = Sandbox(**self.sandbox_options)
        return self._sandbox

    def close(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
