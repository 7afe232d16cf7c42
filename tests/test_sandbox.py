"""Attack suite: hostile programs are contained, score 0, and leave this test process unharmed.

Every hostile program of a suite runs in one parallel batch (the sandbox's worker pool); the tests
then check what each one achieved. They run in the default mode, which is bwrap: a machine without
it fails here loudly, as the sandbox itself refuses to start there unless degraded mode is opted into.
The network probes target only a listener this test opens on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from mopd.artifacts import read_json
from mopd.bench.report import markdown
from mopd.cli import main
from mopd.envs.code import CodeEnv
from mopd.envs.sandbox import (
    DEGRADED,
    SANDBOX_UID_BASE,
    UIDS_PER_PROCESS,
    Limits,
    Program,
    Sandbox,
    SandboxUnavailable,
    bwrap_problem,
    choose_backend,
    describe_backend,
)
from mopd.pipeline import Pipeline, Stage
from mopd.recipe import Recipe

LIMITS = Limits(cpu_s=1, wall_s=3.0)
TEST_PID = os.getpid()
ETC_PASSWD = Path("/etc/passwd")


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------- the outside world
@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """Things a contained program must not reach: files, a local server, a bystander process."""
    root = tmp_path_factory.mktemp("outside")
    root.chmod(0o777)  # even world-writable: only the sandbox protects them
    sentinel = root / "sentinel.txt"
    sentinel.write_text("untouched")
    sentinel.chmod(0o666)
    # A host directory anyone may enter and write (unlike pytest's 0700 tmp root), holding a
    # world-readable secret: only the sandbox's own file system keeps a program from it.
    host = Path(tempfile.mkdtemp(prefix="mopd-host-"))
    host.chmod(0o777)
    marker = f"MOPD-SECRET-{secrets.token_hex(8)}"
    secret = host / "secret.txt"
    secret.write_text(marker)
    secret.chmod(0o644)
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    bystander = subprocess.Popen(["sleep", "120"])
    world = {
        "root": root,
        "sentinel": sentinel,
        "host": host,
        "secret": secret,
        "marker": marker,
        "server": server,
        "port": server.getsockname()[1],
        "bystander": bystander,
        "passwd_sha": sha(ETC_PASSWD),
    }
    yield world
    bystander.kill()
    bystander.wait()
    server.close()
    shutil.rmtree(host, ignore_errors=True)
    Path(f"/tmp/mopd-escape-{TEST_PID}").unlink(missing_ok=True)


def assert_listener_accepted_nothing(server: socket.socket) -> None:
    with pytest.raises(BlockingIOError):
        server.accept()


def hostile_programs(world: dict) -> dict[str, str]:
    sentinel, port, bystander = str(world["sentinel"]), world["port"], world["bystander"].pid
    secret, created = str(world["secret"]), str(world["host"] / "created_by_sandbox")
    return {
        "fork_bomb": """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
""",
        "fork_count": """
import os, time
forks = 0
for _ in range(200):
    try:
        if os.fork() == 0:
            time.sleep(2)
            os._exit(0)
        forks += 1
    except OSError:
        break
print("FORKS", forks)
""",
        "memory_bomb": """
blob = bytearray(8 << 30)
print("ALLOCATED")
""",
        "memory_creep": """
chunks = []
while True:
    chunks.append(bytearray(64 << 20))
    print("CHUNK", len(chunks), flush=True)
""",
        "infinite_loop": "while True:\n    pass\n",
        "sleep_forever": "import time\ntime.sleep(600)\n",
        "network": f"""
import socket
for address in [("127.0.0.1", {port}), ("localhost", {port})]:
    try:
        socket.create_connection(address, timeout=1).sendall(b"hello")
        print("CONNECTED", address)
    except OSError as exc:
        print("blocked", address, exc)
""",
        "read_host_file": f"""
try:
    print("LEAK", open({secret!r}).read())
except OSError as exc:
    print("refused", exc)
""",
        "create_outside": f"""
for path in [{created!r}, "/tmp/mopd-escape-{TEST_PID}"]:
    try:
        open(path, "x").write("pwned")
        print("CREATED", path)
    except OSError as exc:
        print("refused", path, exc)
""",
        "write_outside": f"""
import os
for path, mode in [({sentinel!r}, "w"), ("/etc/passwd", "a"), ("/usr/evil", "w"), ("/evil", "w")]:
    try:
        with open(path, mode) as f:
            f.write("pwned")
        print("WROTE", path)
    except OSError as exc:
        print("refused", path, exc)
for action in (lambda: os.remove({sentinel!r}), lambda: os.chmod("/etc/passwd", 0o777)):
    try:
        action()
        print("WROTE by", action)
    except OSError as exc:
        print("refused", exc)
""",
        "read_outside": f"""
for path in [{__file__!r}, {sentinel!r}, "/etc/shadow", "/etc/passwd", "/root/.bashrc"]:
    try:
        print("LEAK", path, open(path).read()[:20])
    except OSError as exc:
        print("refused", path, exc)
""",
        "read_parent": f"""
import os
for name in ["environ", "cmdline", "mem", "maps", "status"]:
    try:
        data = open("/proc/{TEST_PID}/" + name, "rb").read(200)
        if data:
            print("LEAK", name, data[:40])
    except OSError as exc:
        print("refused", name, exc)
for pid in os.listdir("/proc"):
    try:
        if b"py" + b"test" in open(f"/proc/{{pid}}/cmdline", "rb").read():  # not in our own source
            print("LEAK: the test runner is visible as", pid)
    except OSError:
        pass
""",
        "kill_parent": f"""
import os, signal
for pid in (os.getppid(), {TEST_PID}, {bystander}):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError as exc:
        print("refused", pid, exc)
os.kill(-1, signal.SIGKILL)
""",
        "kill_all_by_shell": "import os\nos.system('kill -9 -1; pkill -9 -f pytest; killall -9 python3')\n",
        "escaped_daemon": f"""
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(2)
        open({sentinel!r}, "w").write("written later by a daemon")
        os._exit(0)
    os._exit(0)
print("left a daemon behind")
""",
        "big_file": """
with open("/tmp/big", "wb") as f:
    f.write(b"0" * (64 << 20))
print("WROTE BIG")
""",
        "fill_tmp": """
for i in range(64):
    with open(f"/tmp/f{i}", "wb") as f:
        f.write(b"0" * ((1 << 20) - 1))
print("FILLED")
""",
        "flood_stdout": "import sys\nsys.stdout.write('x' * (64 << 20))\n",
        "nested_userns": """
import os
try:
    os.unshare(os.CLONE_NEWUSER)
    print("UNSHARED")
except (OSError, AttributeError) as exc:
    print("refused", exc)
""",
    }


def sandbox_uid_processes() -> list[int]:
    """Live processes running as one of this test process's sandbox uids.

    Zombies don't count: they hold no memory and run nothing, and their parent reaps them.
    """
    block = SANDBOX_UID_BASE + (TEST_PID % 100_000) * UIDS_PER_PROCESS
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if block <= uid < block + UIDS_PER_PROCESS and state != "Z":
            found.append(int(pid))
    return found


def leftovers_after(seconds: float = 3.0) -> list[int]:
    """Sandbox processes still alive `seconds` after a run: SIGKILLed ones take a moment to go."""
    deadline = time.monotonic() + seconds
    while (found := sandbox_uid_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def run_suite(backend: str, world: dict, names: list[str] | None = None) -> tuple[dict, float]:
    programs = hostile_programs(world)
    names = names or list(programs)
    sandbox = Sandbox(LIMITS, workers=len(names), backend=backend)
    assert sandbox.backend == ("bwrap" if backend == "auto" else backend)  # the default mode is bwrap
    start = time.monotonic()
    results = sandbox.run_many([Program(programs[name]) for name in names])
    sandbox.close()
    return dict(zip(names, results, strict=True)), time.monotonic() - start


# -------------------------------------------------------------------------------- bwrap suite
def test_bwrap_is_installed_and_usable():
    assert shutil.which("bwrap"), "bubblewrap is missing: install it ('apt-get install bubblewrap')"
    assert Sandbox(backend="bwrap").backend == "bwrap"


@pytest.fixture(scope="module")
def bwrap_suite(outside):
    results, elapsed = run_suite("auto", outside)
    return results, elapsed, leftovers_after()


def test_resource_bombs_are_contained(bwrap_suite):
    results, elapsed, leftovers = bwrap_suite
    assert elapsed < LIMITS.wall_s + 10
    for name in ("fork_bomb", "infinite_loop", "sleep_forever", "memory_creep"):
        assert results[name].returncode != 0, name
    assert results["sleep_forever"].status == "timeout"
    forks = int(results["fork_count"].stdout.split()[-1])
    assert 0 < forks < LIMITS.max_processes
    assert "ALLOCATED" not in results["memory_bomb"].stdout and "MemoryError" in results["memory_bomb"].stderr
    chunks = results["memory_creep"].stdout.split()
    assert int(chunks[-1]) * (64 << 20) <= LIMITS.memory_bytes
    assert leftovers == [], "sandboxed processes outlived their run"


def test_no_network(bwrap_suite, outside):
    results, _, _ = bwrap_suite
    assert "CONNECTED" not in results["network"].stdout
    assert results["network"].stdout.count("blocked") == 2
    assert_listener_accepted_nothing(outside["server"])


def test_file_system_is_read_only_and_private(bwrap_suite, outside):
    results, _, _ = bwrap_suite
    assert "WROTE" not in results["write_outside"].stdout
    assert results["write_outside"].stdout.count("refused") == 6
    assert "LEAK" not in results["read_outside"].stdout
    host_file = results["read_host_file"]
    assert "refused" in host_file.stdout and outside["marker"] not in host_file.stdout + host_file.stderr
    assert "CREATED " + str(outside["host"]) not in results["create_outside"].stdout
    assert not (outside["host"] / "created_by_sandbox").exists()
    assert not Path(f"/tmp/mopd-escape-{TEST_PID}").exists()  # its /tmp is a private tmpfs
    assert "WROTE BIG" not in results["big_file"].stdout
    assert "FILLED" not in results["fill_tmp"].stdout
    assert len(results["flood_stdout"].stdout) <= LIMITS.file_bytes
    assert outside["sentinel"].read_text() == "untouched"
    assert sha(ETC_PASSWD) == outside["passwd_sha"]


def test_parent_is_invisible_and_unkillable(bwrap_suite, outside):
    results, _, _ = bwrap_suite
    assert "LEAK" not in results["read_parent"].stdout
    os.kill(TEST_PID, 0)
    assert outside["bystander"].poll() is None
    assert "UNSHARED" not in results["nested_userns"].stdout


def test_escaped_daemon_dies_with_its_sandbox(bwrap_suite, outside):
    results, _, leftovers = bwrap_suite
    assert "left a daemon behind" in results["escaped_daemon"].stdout
    assert leftovers == []
    time.sleep(2.0)
    assert outside["sentinel"].read_text() == "untouched"


# ------------------------------------------------------------------------------ reward hacks
CORRECT = "def f(xs):\n    return [x + 1 for x in xs]\n"


def reward_hacks(world: dict) -> dict[str, str]:
    hidden = str(world["root"] / "hidden_tests.json")
    return {
        "exit_zero_early": "import os\nos._exit(0)\n",
        "sys_exit_zero": "import sys\nsys.exit(0)\n",
        "print_pass": "print('PASS')\nprint('OK')\nprint('Ran 8 tests: OK')\ndef f(xs):\n    return None\n",
        "raise_system_exit": "def f(xs):\n    raise SystemExit(0)\n",
        "raise_keyboard_interrupt": "def f(xs):\n    raise KeyboardInterrupt\n",
        "patch_builtins": (
            "import builtins\nbuiltins.type = lambda *a: list\nbuiltins.isinstance = lambda *a: True\n"
            "def f(xs):\n    return object()\n"
        ),
        "patch_harness_json": (
            'import json\njson.dumps = lambda *a, **k: \'{"cases": "all passed"}\'\n'
            "def f(xs):\n    return None\n"
        ),
        "patch_unittest": (
            "import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n"
            "unittest.TestResult.wasSuccessful = lambda self: True\ndef f(xs):\n    return None\n"
        ),
        "always_equal_object": (
            "class Anything:\n    def __eq__(self, other):\n        return True\n"
            "    def __ne__(self, other):\n        return False\n    __hash__ = object.__hash__\n"
            "def f(xs):\n    return Anything()\n"
        ),
        "always_equal_list": "class L(list):\n    def __eq__(self, other):\n        return True\ndef f(xs):\n    return L()\n",
        "always_equal_int": "class I(int):\n    def __eq__(self, other):\n        return True\ndef f(xs):\n    return I(0)\n",
        "forged_record": (
            "import json, os, sys\ndef f(xs):\n    payload = sys._getframe(1).f_globals['payload']\n"
            "    cases = [{'ok': args[0]} for args in payload['inputs']]\n"
            "    sys.stdout.write('\\n' + payload['nonce'] + json.dumps({'cases': cases}) + '\\n')\n"
            "    sys.stdout.flush()\n    os._exit(0)\n"
        ),
        "record_bomb": (
            "import os, sys\ndef f(xs):\n    nonce = sys._getframe(1).f_globals['payload']['nonce']\n"
            "    sys.stdout.write('\\n' + nonce + '[' * 200000 + ']' * 200000 + '\\n')\n"
            "    sys.stdout.flush()\n    os._exit(0)\n"
        ),
        "read_hidden_tests": (
            "import json\nanswers = {json.dumps(t['args']): t['expected'] for t in json.load(open("
            f"{hidden!r}))}}\ndef f(*args):\n    return answers[json.dumps(list(args))]\n"
        ),
        "read_parent_memory": (f"def f(xs):\n    return open('/proc/{TEST_PID}/environ').read()\n"),
        "kill_parent_in_call": (
            "import os, signal\ndef f(xs):\n    os.kill(os.getppid(), signal.SIGKILL)\n"
            f"    os.kill({TEST_PID}, signal.SIGKILL)\n    os.kill(-1, signal.SIGKILL)\n    return [x + 1 for x in xs]\n"
        ),
        "examples_only": "def f(xs):\n    return [2]\n",
        "loop_in_call": "def f(xs):\n    while True:\n        pass\n",
    }


def host_hacks(world: dict) -> dict[str, str]:
    """Hacks that win only where the host leaks in: each returns the right answer only after its attack
    worked, so a reward of 1 means the attack got through. The degraded rlimit sandbox shares the
    host's network and file system: there these win (see the issue's measurements)."""
    answers = "\n".join(["import json", "ANSWERS = {json.dumps([[1, 2]]): [2, 3], json.dumps([[]]): [], json.dumps([[5]]): [6]}"])
    lookup = "    return ANSWERS[json.dumps([xs])]\n"
    return {
        "connect_loopback": (
            f"import socket\n{answers}\ndef f(xs):\n"
            f"    socket.create_connection(('127.0.0.1', {world['port']}), timeout=1).close()\n{lookup}"
        ),
        "read_host_file": (
            f"{answers}\nSECRET = open({str(world['secret'])!r}).read()\ndef f(xs):\n"
            f"    assert SECRET.startswith('MOPD-SECRET-')\n{lookup}"
        ),
        "create_outside": (
            f"{answers}\nopen({str(world['host'] / 'created_by_hack')!r}, 'x').close()\ndef f(xs):\n{lookup}"
        ),
    }


def hack_verdicts(backend: str, world: dict, hacks: dict[str, str]) -> tuple[dict, object]:
    env = CodeEnv(families=["list_pipeline"], workers=8, limits=LIMITS, backend=backend)
    task = env.sample(1, seed=0)[0]
    tests = [
        {"args": [[1, 2]], "expected": [2, 3]},
        {"args": [[]], "expected": []},
        {"args": [[5]], "expected": [6]},
    ]
    task = type(task)(task.id, task.domain, task.effort, task.prompt, {**task.meta, "tests": tests})
    hidden = world["root"] / "hidden_tests.json"
    hidden.write_text(json.dumps(tests))
    hidden.chmod(0o644)  # readable by anyone who can reach it
    hacks = {"correct": CORRECT, **hacks}
    completions = [f"<think>hm</think>\n```python\n{code}```" for code in hacks.values()]
    verdicts = env.verify_many([task] * len(hacks), completions)
    env.close()
    return dict(zip(hacks, verdicts, strict=True)), task


@pytest.mark.parametrize("backend", ["auto", "rlimit"])
def test_reward_hacks_score_zero(backend, outside):
    # the default mode faces every hack; the degraded one only those that need no host access
    hacks = {**reward_hacks(outside), **(host_hacks(outside) if backend == "auto" else {})}
    verdicts, _ = hack_verdicts(backend, outside, hacks)
    assert verdicts.pop("correct").reward == 1.0
    assert len(verdicts) >= 15
    assert {v.details["sandbox"] for v in verdicts.values()} == {"bwrap" if backend == "auto" else "rlimit"}
    won = {name: v.details for name, v in verdicts.items() if v.reward != 0.0}
    assert won == {}
    os.kill(TEST_PID, 0)
    assert outside["bystander"].poll() is None
    assert verdicts["loop_in_call"].details["status"] in ("timeout", "exited")
    if backend == "auto":
        assert_listener_accepted_nothing(outside["server"])
        assert not (outside["host"] / "created_by_hack").exists()


# ---------------------------------------------------------------------------- rlimit fallback
def test_rlimit_fallback_contains_bombs_and_killers(outside):
    names = [
        "fork_bomb",
        "fork_count",
        "memory_bomb",
        "infinite_loop",
        "write_outside",
        "read_outside",
        "read_parent",
        "kill_parent",
        "escaped_daemon",
        "big_file",
    ]
    results, elapsed = run_suite("rlimit", outside, names)
    assert elapsed < LIMITS.wall_s + 10
    assert int(results["fork_count"].stdout.split()[-1]) < LIMITS.max_processes
    assert results["fork_bomb"].returncode != 0 and results["infinite_loop"].returncode != 0
    assert "ALLOCATED" not in results["memory_bomb"].stdout
    assert "WROTE" not in results["write_outside"].stdout + results["big_file"].stdout
    # Degraded mode: the file system and /proc are shared, so only what permissions protect is safe.
    for secret in (
        f"LEAK {outside['sentinel']}",
        "LEAK /etc/shadow",
        "LEAK environ",
        "LEAK mem",
        "LEAK maps",
    ):
        assert secret not in results["read_outside"].stdout + results["read_parent"].stdout
    assert outside["sentinel"].read_text() == "untouched"
    assert sha(ETC_PASSWD) == outside["passwd_sha"]
    assert outside["bystander"].poll() is None
    assert leftovers_after() == []  # the escaped daemon was killed by uid


@pytest.fixture
def no_bwrap(monkeypatch):
    """bwrap looked up on a PATH that lacks it, as on a fresh machine."""
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda cmd, *a, **k: None if cmd == "bwrap" else real_which(cmd, *a, **k))
    bwrap_problem.cache_clear()
    yield
    bwrap_problem.cache_clear()


def test_without_bwrap_the_sandbox_refuses_with_the_install_hint(no_bwrap):
    for make in (lambda: Sandbox(), lambda: Sandbox(backend="bwrap"), lambda: CodeEnv().sandbox):
        with pytest.raises(SandboxUnavailable) as refused:
            make()
        message = str(refused.value)
        assert "bwrap executable is not on PATH" in message
        assert "apt-get install bubblewrap" in message and "allow_degraded: true" in message


def test_without_bwrap_the_opt_in_runs_the_degraded_sandbox_and_says_so(no_bwrap, caplog, outside):
    with caplog.at_level(logging.WARNING, logger="mopd.envs.sandbox"):
        env = CodeEnv(families=["list_pipeline"], workers=2, limits=LIMITS, allow_degraded=True)
        task = env.sample(1, seed=0)[0]
        verdict = env.verify(task, env.solve(task))
        env.close()
    assert verdict.reward == 1.0 and verdict.details["sandbox"] == "rlimit"
    assert "DEGRADED" in caplog.text
    with pytest.raises(SandboxUnavailable):  # the opt-in never weakens an explicit request for bwrap
        choose_backend("bwrap", "/nonexistent/python3", allow_degraded=True)


def test_a_task_files_code_rows_are_judged_in_the_sandbox_the_run_opted_into(no_bwrap, tmp_path, capsys):
    from mopd.distill.trainer import TaskFileEnv
    from mopd.envs.data import load_task_file

    env = CodeEnv(families=["list_pipeline"])
    rows = [{"prompt": t.prompt, "effort": t.effort, "meta": t.meta} for t in env.sample(2, seed=0)]
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = load_task_file(data, verifier="code")[0]
    with pytest.raises(SandboxUnavailable):
        TaskFileEnv({}).verify(task, env.solve(task))
    verdict = TaskFileEnv({"code": {"allow_degraded": True, "limits": LIMITS}}).verify(task, env.solve(task))
    assert verdict.reward == 1.0 and verdict.details["sandbox"] == "rlimit"

    out = tmp_path / "pair"
    argv = ["distill", "--teacher", str(tmp_path / "t"), "--student", str(tmp_path / "s"), "--out", str(out),
            "--data", str(data), "--verifier", "code"]  # fmt: skip
    assert main(argv) == 2  # refused before any model loads, in one line
    err = capsys.readouterr().err.strip()
    assert err.startswith("mopd distill: error: the code sandbox needs bubblewrap") and "Traceback" not in err


def test_pipeline_refuses_before_any_work_and_labels_what_it_judged(no_bwrap, tmp_path):
    ran = []
    stages = [Stage("base", {}, lambda ctx: ran.append("base")), Stage("code", {}, lambda ctx: ran.append("code"), judges_code=True)]
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        Pipeline(Recipe(name="t"), tmp_path / "refused", stages).run()
    assert ran == [] and not (tmp_path / "refused").exists()

    degraded = Recipe(name="t", sandbox={"allow_degraded": True})
    assert degraded.env_options("code") == {"allow_degraded": True} and degraded.env_options("agent") == {}
    Pipeline(degraded, tmp_path / "run", stages).run()
    assert ran == ["base", "code"]
    assert "code_sandbox" not in read_json(tmp_path / "run" / "base" / "stage.json")
    assert read_json(tmp_path / "run" / "code" / "stage.json")["code_sandbox"] == DEGRADED


def test_cli_refuses_without_a_traceback_unless_opted_in(no_bwrap, capsys):
    recipe = str(Path(__file__).resolve().parent.parent / "recipes" / "tiny.yaml")
    assert main(["validate", recipe]) == 2
    err = capsys.readouterr().err
    assert "apt-get install bubblewrap" in err and "--allow-degraded-sandbox" in err and "Traceback" not in err
    assert main(["validate", recipe, "--allow-degraded-sandbox"]) == 0
    assert f"code will be judged in the {DEGRADED}" in capsys.readouterr().out


def test_bench_report_names_the_degraded_sandbox():
    report = {
        "suite": {"name": "unit", "path": "unit.yaml", "n": 1, "seeds": [1001], "samples": 1, "temperature": 1.0},
        "machine": {"cpu_count": 2, "torch": "x", "platform": "y"},
        "backend": "hf", "efforts": {"low": {"budget_tokens": 16}}, "models": [], "results": [],
        "code_sandbox": describe_backend("rlimit"),
    }  # fmt: skip
    assert f"Code verified in the {DEGRADED}." in markdown(report)


def test_probes_do_detect_leaks_without_a_sandbox(outside):
    """Control: the harmless probes really leak when run as a plain child, so their silence above counts."""
    programs = hostile_programs(outside)
    probes = (("read_outside", "LEAK"), ("read_parent", "LEAK"), ("network", "CONNECTED"), ("read_host_file", "LEAK"))
    for name, marker in probes:
        out = subprocess.run(
            ["python3", "-c", programs[name]], capture_output=True, text=True, timeout=30
        ).stdout
        assert marker in out, name
    assert outside["marker"] in out  # the host file's secret, as read by a plain child
    for _ in range(2):  # the network probe's two connections
        connection, _ = outside["server"].accept()
        connection.close()
