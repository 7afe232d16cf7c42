"""The code domain: deterministic tasks, disjoint splits, an expert that passes, a verifier that says no."""

from __future__ import annotations

import json
import re

import pytest

from mopd.envs.base import Task
from mopd.envs.code import FAMILIES, CodeEnv, compile_reference, contents, function_from_meta
from mopd.envs.data import dataset_to_tasks, tasks_to_dataset
from mopd.envs.splits import SPLITS, content_hash, split_of, trainable
from mopd.recipe import ROOT, load_recipe


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


def test_train_dev_and_test_never_share_a_function(env):
    drawn = {split: env.sample(n, seed=0, split=split) for split, n in (("train", 600), ("dev", 200), ("test", 200))}
    keys = {split: {t.meta["content_hash"] for t in tasks} for split, tasks in drawn.items()}
    assert keys["train"].isdisjoint(keys["dev"]) and keys["train"].isdisjoint(keys["test"])
    assert keys["dev"].isdisjoint(keys["test"])
    assert len(keys["test"]) > 50  # test is not a handful of repeats
    for split in SPLITS:
        for task in drawn[split]:
            key = content_hash(function_from_meta(task.meta).source)
            assert key == task.meta["content_hash"] and split_of(key) == split


def test_difficulty_knob_sets_the_number_of_steps():
    env = CodeEnv(families=["list_pipeline", "string_ops", "poly"], difficulty=(3, 3))
    steps = {t.meta["family"]: len(t.meta["steps"]) for t in env.sample(6, seed=0)}
    assert steps == {"list_pipeline": 3, "string_ops": 3, "poly": 1}
    assert "n ** 3" in env.sample(3, seed=0)[2].meta["steps"][0][1]


def test_expert_passes_every_task_at_every_effort(env):
    tasks = [t for effort in ("low", "high", "max") for t in env.sample(60, seed=11, effort=effort)]
    verdicts = env.verify_many(tasks, [env.solve(t) for t in tasks])
    failures = [(t.id, v.details) for t, v in zip(tasks, verdicts, strict=True) if v.reward != 1.0]
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
    got = [(task.meta["family"], text, v.reward) for (task, text, _), v in zip(cases, verdicts, strict=True)]
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
    with pytest.raises(ValueError, match="split='eval'"):
        CodeEnv().sample(1, seed=0, split="eval")
    with pytest.raises(ValueError, match=r"meta.entry and a non-empty meta.tests"):
        CodeEnv().verify(Task("t1", "code", "high", "p", {"entry": "f"}), completion("def f(): pass"))
    with pytest.raises(ValueError, match="only generated tasks"):
        CodeEnv().solve(
            Task("t3", "code", "high", "p", {"entry": "f", "tests": [{"args": [1], "expected": 1}]})
        )
    with pytest.raises(ValueError, match="arith_step"):
        CodeEnv(arith_step=(0, 3))
    with pytest.raises(ValueError, match="arith_start"):
        CodeEnv(arith_start=(5, 2))
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


def test_the_function_is_the_key_whatever_examples_and_tests_it_comes_with():
    """At difficulty 1 a function comes back under other examples and tests: the prompts differ,
    the key does not, so a train function planted in a test list is caught by its key."""
    env = CodeEnv(families=["string_ops"], difficulty=(1, 1), n_examples=1)
    train = env.sample(200, 0, "train")
    by_key = {}
    for task in train:
        by_key.setdefault(task.meta["content_hash"], set()).add(task.prompt)
    assert any(len(prompts) > 1 for prompts in by_key.values())
    planted = next(t for t in env.sample(200, 1, "train") if t.prompt not in {p for ps in by_key.values() for p in ps}
                   and t.meta["content_hash"] in by_key)
    test = [*env.sample(20, 0, "test"), planted]
    assert [t for t in test if t.meta["content_hash"] in by_key] == [planted]
    with pytest.raises(ValueError, match="list_reduce: difficulty \\(1, 1\\) leaves too few distinct dev functions"):
        CodeEnv(families=["list_reduce"], difficulty=(1, 1)).sample(1, 0, "dev")  # 13 functions, none in dev


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


def test_wider_arith_ranges_hold_out_more_functions_and_stay_in_range(env):
    """arith_start / arith_step widen the space of sequences, so dev and test hold many functions
    (the defaults leave one or two in each) and every drawn sequence keeps to the ranges."""

    def functions(code_env: CodeEnv, split: str) -> set[str]:
        return {t.meta["content_hash"] for t in code_env.sample(200, seed=1001, split=split)}

    narrow, wide = CodeEnv(families=["arith"]), CodeEnv(families=["arith"], arith_start=(0, 30), arith_step=(1, 9))
    assert len(functions(narrow, "test")) <= 3
    assert len(functions(wide, "test")) >= 15 and not functions(wide, "test") & functions(wide, "train")
    tasks = wide.sample(100, seed=3)
    for task in tasks:
        terms = [int(t) for t in task.prompt.split("begins ")[1].split(".\n")[0].split(", ")]
        assert 0 <= terms[0] <= 30 and 1 <= terms[1] - terms[0] <= 9
    assert [v.reward for v in wide.verify_many(tasks, [wide.solve(t) for t in tasks])] == [1.0] * len(tasks)


def test_linear_states_its_step_so_the_body_maps_two_numbers_of_the_prompt(env):
    """linear gives start and step in words: the reference body is `step * n + start`, with the
    same function (and so the same split) as the arith task of that sequence."""
    tasks = CodeEnv(families=["linear"], arith_start=(0, 30), arith_step=(1, 9)).sample(60, seed=4)
    for task in tasks:
        start, step = map(int, re.search(r"starts at (\d+) and adds (\d+) each time", task.prompt).groups())
        assert 0 <= start <= 30 and 1 <= step <= 9
        assert compile_reference(function_from_meta(task.meta).source)(7) == start + 7 * step
    assert [v.reward for v in env.verify_many(tasks, [env.solve(t) for t in tasks])] == [1.0] * len(tasks)
    same = CodeEnv(families=["arith"], arith_start=(0, 30), arith_step=(1, 9)).sample(60, seed=4)
    shared = {t.meta["content_hash"] for t in tasks} & {t.meta["content_hash"] for t in same}
    assert shared and all(split_of(key) == "train" for key in shared)


def attempt_at(task: Task, effort: str, code: str) -> tuple[Task, str]:
    return Task(task.id, task.domain, effort, task.prompt, task.meta), completion(code)


def test_attempts_grow_with_effort_and_the_examples_decide_when_to_stop(env):
    """Low gets one attempt; high two and max three, each failed one answered with what the
    examples returned; an attempt that passes the examples ends the episode."""
    task = CodeEnv(families=["arith"], n_examples=1).sample(1, seed=3)[0]
    right, wrong = function_from_meta(task.meta).source, wrong_variant(task)
    (example,) = task.meta["examples"]
    n, expected = example["args"][0], example["expected"]
    for effort, attempts in {"low": 1, "high": 2, "max": 3}.items():
        episode = env.reset(Task(task.id, task.domain, effort, task.prompt, task.meta))
        observations = [env.step(episode, completion(wrong)) for _ in range(attempts)]
        assert [done for _, done in observations] == [False] * (attempts - 1) + [True]
        assert all(text == f"f({n}) returned {expected + 1}, expected {expected}" for text, _ in observations[:-1])
        assert env.verify(episode.task, episode).reward == 0.0
        with pytest.raises(ValueError, match="is over"):
            env.step(episode, completion(right))
    episode = env.reset(Task(task.id, task.domain, "max", task.prompt, task.meta))
    assert env.step(episode, completion(wrong))[1] is False
    assert env.step(episode, completion(right)) == (None, True)  # passes the examples: over
    assert env.verify(episode.task, episode).reward == 1.0 and episode.attempts == 2


def test_attempt_feedback_names_errors_and_a_bad_turn_ends_the_episode(env):
    task = CodeEnv(families=["string_ops"], n_examples=1).sample(1, seed=4, effort="high")[0]
    arg = task.meta["examples"][0]["args"][0]
    episode = env.reset(task)
    assert env.step(episode, completion("def f(s):\n    return s[0] + 1")) == (
        f"f({arg!r}) raised TypeError: can only concatenate str (not \"int\") to str", False)
    assert env.step(env.reset(task), "<think>plan</think>") == ("error: no code after </think>", False)
    assert env.step(env.reset(task), "never closes the think block") == (None, True)
    no_examples = Task(task.id, "code", "max", task.prompt, {**task.meta, "examples": []})
    assert env.step(env.reset(no_examples), completion("def f(s):\n    return 1")) == (None, True)
    with pytest.raises(ValueError, match="attempts"):
        CodeEnv(attempts={"high": 0})
    with pytest.raises(ValueError, match="retry_demos"):
        CodeEnv(retry_demos=1.5)


def test_retry_demos_show_a_failed_attempt_its_real_feedback_then_the_right_function(env):
    demos = CodeEnv(families=["string_ops", "list_reduce", "arith"], n_examples=1, retry_demos=1.0)
    for effort in ("low", "high", "max"):
        solutions = [(task, demos.solve(task)) for task in demos.sample(12, seed=5, effort=effort)]
        if effort == "low":  # one attempt: nothing to retry
            assert all(solution == env.solve(task) for task, solution in solutions)
            continue
        # an example such as f([-8]) == 0 may pass whatever is tried: then the demo is the plain one
        retried = [(task, solution) for task, solution in solutions if isinstance(solution, list)]
        assert len(retried) >= 10
        for task, solution in retried:
            assert [turn["role"] for turn in solution] == ["assistant", "observation", "assistant"]
            first, _, last = (turn["content"] for turn in solution)
            assert demos.verify(task, first).reward == 0.0 and last == env.solve(task)
            replayed = demos.replay(task, solution)  # the sandbox gives the same feedback
            assert replayed.turns == solution and replayed.done
            assert demos.verify(task, solution).reward == 1.0
        # all transcripts at once, a turn at a time, mixed with plain completions: the same
        tasks, transcripts = [task for task, _ in solutions], [solution for _, solution in solutions]
        assert [e.turns for e in demos.replay_many(*zip(*retried, strict=True))] == [s for _, s in retried]
        assert demos.verify_many(tasks, transcripts) == [demos.verify(t, s) for t, s in solutions]
    half = CodeEnv(families=["arith"], retry_demos=0.5).sample(40, seed=6, effort="high")
    assert 8 <= sum(isinstance(CodeEnv(families=["arith"], retry_demos=0.5).solve(t), list) for t in half) <= 32


def test_a_batch_of_attempts_gets_what_one_by_one_would(env):
    """`step_many` and `verify_many` run their sandbox programs in parallel; each episode still
    gets the observation and verdict that `step` and `verify` give it alone."""
    tasks = CodeEnv(families=["string_ops", "list_reduce", "arith"], n_examples=1).sample(8, seed=7, effort="max")
    texts = [completion(wrong_variant(t)) if i % 2 else env.solve(t) for i, t in enumerate(tasks)]
    texts[2] = "never closes the think block"
    one_by_one = [env.reset(t) for t in tasks]
    alone = [env.step(episode, text) for episode, text in zip(one_by_one, texts, strict=True)]
    batch = [env.reset(t) for t in tasks]
    assert env.step_many(batch, texts) == alone
    assert [e.turns for e in batch] == [e.turns for e in one_by_one]
    assert {done for _, done in alone} == {True, False}  # the batch holds both kinds
    verdicts = env.verify_many(tasks, batch)
    assert [v.reward for v in verdicts] == [env.verify(t, e).reward for t, e in zip(tasks, one_by_one, strict=True)]
    assert [v.reward for v in verdicts] == [0.0 if i % 2 or i == 2 else 1.0 for i in range(len(tasks))]


def test_contents_are_the_functions_a_text_shows_in_code_blocks_keyed_as_their_tasks(env):
    task = env.sample(1, seed=3, effort="max")[0]
    solution = env.solve(task)
    assert contents(solution) == {task.meta["content_hash"]}
    assert contents(task.prompt) == set()  # the signature alone is no function
    spaced = solution.replace("    ", "  ").replace("def f(", "def  f(")
    assert contents(spaced) == {task.meta["content_hash"]}  # whitespace aside, as the split key


def test_failed_attempts_of_the_tiny_recipe_show_only_train_functions():
    """Issue #42: a failed-attempt demo once showed dev and test functions (113 of 128 test tasks a
    code cell): a slip of a digit or another function of the family, drawn without the split."""
    recipe = load_recipe(ROOT / "recipes/tiny.yaml")
    demos = CodeEnv(**{**recipe.env_options("code"), "retry_demos": 1.0})
    transcripts = [demos.solve(task) for task in demos.sample(300, seed=0, effort="max")]
    shown = [contents(turn["content"]) for transcript in transcripts if isinstance(transcript, list) for turn in transcript]
    assert len(shown) >= 2 * 250  # a failed attempt and the right one, in most transcripts
    assert all(trainable(keys) for keys in shown)
    wrong = {key for keys in shown[::2] for key in keys}
    assert len(wrong) > 50  # many functions were tried, all of them train
