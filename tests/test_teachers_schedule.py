"""Teacher scheduling: the longest teacher starts first, and no more run at once than the cluster fits;
the driver shows each running teacher's progress, live on a terminal and as plain lines in a file."""

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

import mopd.cluster
from mopd.cluster import StatusLines, run_in_slots
from mopd.recipe import Resources, load_recipe, load_teacher_specs
from mopd.rl.teachers import expected_cost, longest_first, progress_line, summary_line, teacher_slots

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny():
    recipe = load_recipe(ROOT / "recipes/tiny.yaml")
    return recipe, load_teacher_specs(recipe)


def test_cost_grows_with_steps_and_with_effort(tiny):
    recipe, specs = tiny
    code_max = specs["code-max"]
    longer = code_max.model_copy(update={"steps": 2 * code_max.steps})
    assert expected_cost(longer, recipe) == pytest.approx(2 * expected_cost(code_max, recipe))

    def per_step(cell):
        return expected_cost(specs[cell], recipe) / specs[cell].steps

    assert per_step("code-max") > per_step("general-low")
    assert per_step("general-max") > per_step("general-low")  # max effort thinks at length


def test_start_order_is_by_decreasing_cost_of_the_specs(tiny, capsys):
    recipe, specs = tiny
    queue = longest_first(specs, recipe)
    costs = [expected_cost(specs[cell], recipe) for cell in queue]
    assert sorted(queue) == sorted(specs) and costs == sorted(costs, reverse=True)
    assert capsys.readouterr().out.startswith(f"teachers start longest first: {queue[0]} (")

    fewer = {**specs, queue[0]: specs[queue[0]].model_copy(update={"steps": 1})}
    assert longest_first(fewer, recipe)[-1] == queue[0]  # computed from the specs, not fixed per cell


class FakeCluster:
    """Runs each started job for `durations[job]` ticks; `wait_one` advances time to the next finish."""

    def __init__(self, durations, slots):
        self.durations, self.slots, self.clock = durations, slots, 0
        self.running: dict[str, int] = {}  # job -> finish time
        self.started, self.finished, self.most_at_once = [], [], 0

    def start(self, job):
        assert job not in self.started, f"{job} started twice"
        assert len(self.running) < self.slots, f"{job} started while {sorted(self.running)} fill every slot"
        self.started.append(job)
        self.running[job] = self.clock + self.durations[job]
        self.most_at_once = max(self.most_at_once, len(self.running))

    def wait_one(self):
        job = min(self.running, key=self.running.get)
        self.clock = self.running.pop(job)
        self.finished.append(job)
        return job


@pytest.mark.parametrize("slots", [1, 2, 3, 20])
def test_slots_bound_the_teachers_running_at_once(slots):
    durations = {"a": 9, "b": 7, "c": 7, "d": 4, "e": 2, "f": 1}
    cluster = FakeCluster(durations, slots)
    run_in_slots(list(durations), slots, cluster.start, cluster.wait_one)
    assert cluster.started == list(durations)
    assert sorted(cluster.finished) == sorted(durations) and not cluster.running
    assert cluster.most_at_once == min(slots, len(durations))


def test_longest_first_beats_longest_last_on_two_slots():
    durations = {"short1": 1, "short2": 1, "short3": 2, "long": 4}
    makespans = {}
    for name, order in {
        "longest first": ["long", "short3", "short1", "short2"],
        "longest last": list(durations),
    }.items():
        cluster = FakeCluster(durations, slots=2)
        run_in_slots(order, 2, cluster.start, cluster.wait_one)
        makespans[name] = cluster.clock
    assert makespans == {"longest first": 4, "longest last": 5}


def test_a_failing_teacher_stops_the_schedule():
    started = []

    def wait_one():
        raise RuntimeError("teacher failed past its restarts")

    with pytest.raises(RuntimeError, match="past its restarts"):
        run_in_slots(["a", "b", "c"], 2, started.append, wait_one)
    assert started == ["a", "b"]


def test_slots_are_what_the_cluster_fits_of_the_hungriest_spec(tiny, monkeypatch):
    _, specs = tiny
    one_cpu, two_cpus = (
        specs["code-max"],
        specs["code-low"].model_copy(update={"resources": Resources(num_cpus=2)}),
    )
    gpu = one_cpu.model_copy(update={"resources": Resources(num_cpus=1, num_gpus=1)})
    monkeypatch.setattr(mopd.cluster.ray, "cluster_resources", lambda: {"CPU": 5.0, "GPU": 2.0})
    assert teacher_slots([one_cpu]) == 5
    assert teacher_slots([one_cpu, two_cpus]) == 2
    assert teacher_slots([one_cpu, gpu]) == 2
    monkeypatch.setattr(mopd.cluster.ray, "cluster_resources", lambda: {"CPU": 1.0})
    assert teacher_slots([two_cpus]) == 1  # never zero: Ray queues it until the cluster grows


def metrics(rewards, seconds=(2.0, 0.5, 1.5)):
    generate, verify, train = seconds
    return [
        {"step": step, "reward": reward, "time_generate": generate, "time_verify": verify, "time_train": train}
        for step, reward in enumerate(rewards, start=1)
    ]


def test_a_teacher_line_says_step_reward_and_seconds_per_step():
    assert progress_line("code-max", 40, []) == "code-max      starting"
    line = progress_line("code-max", 40, metrics([0.1, 0.25, 0.4125]))
    assert line == "code-max      step 3/40  reward 0.412  4.0 s/step"
    held_out = {"base": {"reward": 0.38}, "teacher": {"reward": 0.52}, "margin": 0.14}
    summary = summary_line("code-max", metrics([0.21, 0.3, 0.48]), 611.6, held_out)
    assert summary == "code-max      done: 3 steps  reward 0.210 → 0.480  612 s  held-out 0.38 → 0.52"
    assert summary_line("agent-low", [], 3.2, {}) == "agent-low     done: no steps  3 s"


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_piped_progress_is_plain_lines_at_most_every_30_seconds():
    out, clock = io.StringIO(), FakeClock()
    with StatusLines(Console(file=out, width=40), every=30.0, clock=clock) as status:  # a pipe: not a terminal
        status.update("code-max", progress_line("code-max", 40, []))
        for step in range(1, 5):
            clock.now += 20.0  # a step every 20 s
            status.update("code-max", progress_line("code-max", 40, metrics([0.5] * step)))
            status.update("general-low", progress_line("general-low", 8, metrics([0.25] * step)))
        status.finish("code-max", summary_line("code-max", metrics([0.5] * 4), 80.0, {}))
    text = out.getvalue()
    assert text.splitlines() == [
        "code-max      starting",
        "general-low   step 1/8  reward 0.250  4.0 s/step",
        "code-max      step 2/40  reward 0.500  4.0 s/step",  # 40 s after the last: printed
        "general-low   step 3/8  reward 0.250  4.0 s/step",
        "code-max      step 4/40  reward 0.500  4.0 s/step",
        "code-max      done: 4 steps  reward 0.500 → 0.500  80 s",  # longer than the width: not wrapped
    ]
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f]", text)  # no \r, no escape codes


def test_on_a_terminal_the_lines_are_redrawn_in_place():
    out = io.StringIO()
    with StatusLines(Console(file=out, force_terminal=True, width=80)) as status:
        status.update("code-max", progress_line("code-max", 40, metrics([0.5])))
        status.update("code-low", progress_line("code-low", 40, []))
        status.update("code-max", progress_line("code-max", 40, metrics([0.5, 0.75])))
        status.finish("code-low", "code-low      done: no steps  3 s")
    text = out.getvalue()
    assert "\x1b[1A" in text  # the cursor moves up: the live lines are rewritten, not appended
    assert "code-low      done: no steps  3 s\n" in text
    last_frame = text.rsplit("\x1b[2K", 1)[1]
    assert "code-max      step 2/40  reward 0.750" in last_frame and "code-low" not in last_frame
