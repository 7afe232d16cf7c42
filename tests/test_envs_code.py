"""The code domain: deterministic tasks, disjoint splits, an expert that passes, a verifier that says no."""

from __future__ import annotations

import json

import pytest

from mopd.envs.base import Task
from mopd.envs.code import FAMILIES, CodeEnv, content_hash, function_from_meta, split_of
from mopd.envs.data import dataset_to_tasks, tasks_to_dataset


@pytest.fixture(scope="module")
def env():
    env = CodeEnv(workers=4)
    yield env
    env.close()


def completion(code: str, thinking: str = "plan") -> str:
    return f"<think>{thinking}</think>\n```python\n{code}\n```"


def wrong_variant(task: Task) -> str:
    """The reference solution with a return value that always differs from the right one."""
    function = function_from_meta(task.meta)
    change = {"list[int]": " + [0]", "str": " + 'z'", "int": " + 1"}[function.return_type]
    return function.source + change


def test_sampling_is_deterministic_and_covers_every_family(env):
    first, again = env.sample(12, seed=3), env.sample(12, seed=3)
    assert first == again
    assert first != env.sample(12, seed=4)
    assert {t.meta["family"] for t in first} == set(FAMILIES)
    for task in first:
        assert task.domain == "code" and task.meta["signature"] in task.prompt
        assert all(repr(case["args"][0]) in task.prompt for case in task.meta["examples"])
        assert json.loads(json.dumps(task.meta)) == task.meta


def test_train_and_eval_never_share_a_function(env):
    train = [t for seed in range(3) for t in env.sample(300, seed=seed, split="train")]
    evals = [t for seed in range(3) for t in env.sample(300, seed=seed, split="eval")]
    train_hashes = {t.meta["content_hash"] for t in train}
    eval_hashes = {t.meta["content_hash"] for t in evals}
    assert train_hashes.isdisjoint(eval_hashes)
    assert len(eval_hashes) > 100  # eval is not a handful of repeats
    for task, split in [*((t, "train") for t in train), *((t, "eval") for t in evals)]:
        source = function_from_meta(task.meta).source
        assert content_hash(source) == task.meta["content_hash"] and split_of(source) == split


def test_difficulty_knob_sets_the_number_of_steps():
    env = CodeEnv(families=["list_pipeline", "string_ops", "poly"], difficulty=(3, 3))
    steps = {t.meta["family"]: len(t.meta["steps"]) for t in env.sample(6, seed=0)}
    assert steps == {"list_pipeline": 3, "string_ops": 3, "poly": 1}
    assert "n ** 3" in env.sample(3, seed=0)[2].meta["steps"][0][1]


def test_expert_passes_every_task_at_every_effort(env):
    tasks = [t for effort in ("low", "high", "max") for t in env.sample(60, seed=11, effort=effort)]
    verdicts = env.verify_many(tasks, [env.solve(t) for t in tasks])
    failures = [(t.id, v.details) for t, v in zip(tasks, verdicts) if v.reward != 1.0]
    assert failures == []
    assert all(v.details["passed"] == v.details["total"] == env.n_tests for v in verdicts)


def test_scratchpad_grows_with_effort(env):
    task = env.sample(2, seed=5)[1]
    lengths = {}
    for effort in ("low", "high", "max"):
        solved = env.solve(Task(task.id, task.domain, effort, task.prompt, task.meta))
        lengths[effort] = len(solved.partition("</think>")[0])
    assert lengths["low"] == len("<think>")
    assert lengths["low"] < lengths["high"] < lengths["max"]


def test_known_good_scores_one_and_known_bad_zero_for_each_family(env):
    tasks = env.sample(len(FAMILIES), seed=7)
    cases = []
    for task in tasks:
        source = function_from_meta(task.meta).source
        cases += [
            (task, completion(source), 1.0),
            (task, source.join(["<think></think>", "<|end|>"]), 1.0),  # unfenced code is fine
            (task, completion(wrong_variant(task)), 0.0),
            (task, source, 0.0),  # no think block
            (task, "<think>" + source, 0.0),  # unclosed think block
            (task, "<think>all done</think>", 0.0),  # no code
            (task, completion("def f(x:\n    return"), 0.0),  # syntax error
            (task, completion(source.replace("def f(", "def g(")), 0.0),  # wrong name
        ]
    verdicts = env.verify_many([c[0] for c in cases], [c[1] for c in cases])
    got = [(task.meta["family"], text, v.reward) for (task, text, _), v in zip(cases, verdicts)]
    assert got == [(task.meta["family"], text, reward) for task, text, reward in cases]


def test_tasks_round_trip_through_a_dataset(env):
    tasks = env.sample(6, seed=2, effort="max")
    back = dataset_to_tasks(tasks_to_dataset(tasks))
    assert back == tasks
    assert [v.reward for v in env.verify_many(back, [env.solve(t) for t in back])] == [1.0] * 6


def test_bad_options_and_tasks_are_named():
    with pytest.raises(ValueError, match="unknown families"):
        CodeEnv(families=["sorting"])
    with pytest.raises(ValueError, match="difficulty"):
        CodeEnv(difficulty=(2, 1))
    with pytest.raises(ValueError, match="split"):
        CodeEnv().sample(1, seed=0, split="test")
    with pytest.raises(ValueError, match=r"meta.entry and a non-empty meta.tests"):
        CodeEnv().verify(Task("t1", "code", "high", "p", {"entry": "f"}), completion("def f(): pass"))
    with pytest.raises(ValueError, match="only generated tasks"):
        CodeEnv().solve(
            Task("t3", "code", "high", "p", {"entry": "f", "tests": [{"args": [1], "expected": 1}]})
        )
    with pytest.raises(ValueError, match=r"meta.tests\[0\]"):
        CodeEnv().verify(Task("t2", "code", "high", "p", {"entry": "f", "tests": [{"args": 1}]}), "x")


def test_results_travel_exactly_and_only_plain_values_count(env):
    """The sandbox's hand-written JSON keeps every value intact; anything not plain data scores 0."""
    values = ['a"b\\c\n\t', "é€😀\x00\ud800", "", 1.5, -0.0, 10**30, True, None, [1, {"k": [None, "v"]}]]
    task = Task(
        "exact", "code", "high", "p", {"entry": "f", "tests": [{"args": [v], "expected": v} for v in values]}
    )
    assert env.verify(task, completion("def f(x):\n    return x")).reward == 1.0
    strict = Task("strict", "code", "high", "p", {"entry": "f", "tests": [{"args": [1], "expected": 1}]})
    impostors = ["True", "1.0", "(1,)", "[1]", "{1}", "float('inf')", "type('I', (int,), {})(1)", "'1'"]
    verdicts = env.verify_many(
        [strict] * len(impostors), [completion(f"def f(x):\n    return {v}") for v in impostors]
    )
    assert [v.reward for v in verdicts] == [0.0] * len(impostors)


def test_iid_eval_draws_may_reuse_training_functions():
    options = {"families": ["string_ops"], "difficulty": (1, 1), "n_examples": 1}
    train = {t.meta["content_hash"] for t in CodeEnv(**options).sample(200, 0, "train")}
    disjoint = {t.meta["content_hash"] for t in CodeEnv(**options).sample(40, 0, "eval")}
    iid = {t.meta["content_hash"] for t in CodeEnv(**options, disjoint_eval=False).sample(40, 0, "eval")}
    assert not disjoint & train
    assert len(iid & train) > len(iid) // 2


def test_arith_works_out_its_step_on_paper_above_low_effort(env):
    """The step of the sequence is not in the words: high and max write the subtraction that
    gives it before the code, low writes the code straight away."""
    tasks = CodeEnv(families=["arith"]).sample(30, seed=2)
    for task in tasks:
        terms = [int(t) for t in task.prompt.split("begins ")[1].split(".\n")[0].split(", ")]
        step = terms[1] - terms[0]
        assert terms[2] - terms[1] == step and 1 <= step <= 4
        written = f"{terms[1]}-{terms[0]}={step}"
        solved = {e: env.solve(Task(task.id, task.domain, e, task.prompt, task.meta)) for e in ("low", "high", "max")}
        for effort, text in solved.items():
            thinking = text.partition("</think>")[0]
            assert (written in thinking) == (effort != "low"), (effort, thinking)
        assert f"y = {step} * n" in solved["low"] or (step == 1 and "y = n" in solved["low"])
    verdicts = env.verify_many(tasks, [env.solve(t) for t in tasks])
    assert [v.reward for v in verdicts] == [1.0] * len(tasks)
