"""The general domain: expert solves, verifiers accept good and reject bad, splits never overlap."""

import dataclasses

import pytest

from mopd.envs import get_env
from mopd.envs.base import EFFORTS, split_thinking
from mopd.envs.chat import strip_turn_end
from mopd.envs.general import (
    DEFAULT_FAMILIES,
    OWN_FAMILIES,
    GeneralEnv,
    chain_trace,
    contents,
    max_digits,
    normalize_answer,
    task_key,
)
from mopd.envs.splits import SPLITS, content_hash, split_of, trainable
from mopd.recipe import ROOT, load_recipe

RG_EXTRA = ("rg/spell_backward", "rg/leg_counting", "rg/number_sorting")
ALL_FAMILIES = (*DEFAULT_FAMILIES, *RG_EXTRA)


@pytest.fixture(scope="module")
def env():
    return GeneralEnv(families=ALL_FAMILIES)


def content(task):
    return (task.meta["family"], task.prompt, task.meta["answer"])


def test_get_env_builds_the_general_domain_and_rejects_unknown_domains():
    env = get_env("general", families=["add"], add_digits=(2, 3))
    assert isinstance(env, GeneralEnv) and env.families == ("add",)
    with pytest.raises(ValueError, match="unknown domain 'chess'"):
        get_env("chess")


def test_expert_gets_reward_one_on_a_thousand_tasks_across_efforts():
    env = GeneralEnv()
    tasks = [t for effort in EFFORTS for t in env.sample(334, seed=7, effort=effort)][:1000]
    rewards = [env.verify(t, env.solve(t)).reward for t in tasks]
    solved = sum(r == 1.0 for r in rewards) / len(rewards)
    print(f"expert solve rate on {len(tasks)} general tasks: {solved:.4f}")
    assert len(tasks) == 1000 and solved >= 0.99
    assert {t.meta["family"] for t in tasks} == set(DEFAULT_FAMILIES)


def wrong_value(task):
    answer = task.meta["answer"]
    if answer.lstrip("-").isdigit():
        return str(int(answer) + 1)
    return "qqq"  # reasoning-gym gives partial credit to near misses (e.g. a misspelt word)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_verifier_gives_one_to_known_good_and_zero_to_known_bad(env, family):
    tasks = [t for t in env.sample(4 * len(ALL_FAMILIES), seed=3) if t.meta["family"] == family]
    assert tasks, family
    for task in tasks:
        good = env.solve(task)
        thinking, answer = good.removeprefix("<think>").split("</think>")
        assert env.verify(task, good).reward == 1.0
        assert env.verify(task, good + "<|end|>").reward == 1.0
        bad = {
            "wrong value": f"<think>{thinking}</think>{wrong_value(task)}",
            "answer only inside the think block": f"<think>{answer}</think>",
            "no think block": answer,
            "unclosed think block": f"<think>{thinking}{answer}",
        }
        for case, completion in bad.items():
            verdict = env.verify(task, completion)
            assert verdict.reward == 0.0, (family, case, completion, verdict)


@pytest.mark.parametrize("family", OWN_FAMILIES)
def test_own_families_reject_answers_wrapped_in_words(env, family):
    task = next(t for t in env.sample(len(ALL_FAMILIES), seed=5) if t.meta["family"] == family)
    answer = task.meta["answer"]
    for wrapped in (f"The answer is {answer}", f"{answer} apples", f"answer: {answer}"):
        assert env.verify(task, f"<think></think>{wrapped}").reward == 0.0


def test_answers_are_normalised_before_comparison():
    env = GeneralEnv(families=["add"], add_digits=(4, 6))
    task = next(t for t in env.sample(20, seed=1) if int(t.meta["answer"]) >= 10_000)
    answer = task.meta["answer"]
    with_commas = f"{int(answer):,}"
    with_spaces = f"{int(answer):,}".replace(",", " ")
    for variant in (with_commas, with_spaces, f"  {answer} ", f"+{answer}", f"{answer}.", f"{answer}<|end|>"):
        assert env.verify(task, f"<think></think>{variant}").reward == 1.0, variant
    assert normalize_answer("\u221242") == "-42"
    assert normalize_answer(" Paris  France. ") == "Paris France"


def test_train_dev_and_test_never_share_a_question(env):
    drawn = {split: {content(t) for t in env.sample(n, seed=0, split=split)}
             for split, n in (("train", 800), ("dev", 300), ("test", 300))}
    questions = {split: {(prompt, answer) for _, prompt, answer in contents} for split, contents in drawn.items()}
    assert all(questions.values())
    assert not questions["train"] & questions["dev"] and not questions["train"] & questions["test"]
    assert not questions["dev"] & questions["test"]
    assert all(split_of(task_key(prompt, answer)) == split for split in SPLITS for prompt, answer in questions[split])


def test_splits_stay_disjoint_when_the_question_space_is_tiny():
    env = GeneralEnv(families=["add"], add_digits=(1, 1))  # only 100 distinct questions exist
    drawn = {split: {content(t) for t in env.sample(n, seed=0, split=split)}
             for split, n in (("train", 600), ("dev", 100), ("test", 100))}
    assert all(len(contents) >= 2 for contents in drawn.values())
    assert not drawn["train"] & drawn["dev"] and not drawn["train"] & drawn["test"] and not drawn["dev"] & drawn["test"]
    assert len(drawn["train"] | drawn["dev"] | drawn["test"]) <= 100


def test_one_question_has_one_key_and_one_split_whichever_family_draws_it():
    """"Compute 3 + 5." is the same task from `add` and from a two-term `chain`: the key hashes the
    question and the answer, never the family, so the two cannot land in different splits."""
    adds = GeneralEnv(families=["add"], add_digits=(1, 1))
    chains = GeneralEnv(families=["chain"], chain_terms=(2, 2), chain_digits=(1, 1))
    for split in SPLITS:
        by_add = {t.prompt: t.meta["content_hash"] for t in adds.sample(200, seed=1, split=split)}
        shared = [t for t in chains.sample(200, seed=2, split=split) if t.prompt in by_add]
        assert shared, split
        assert all(t.meta["content_hash"] == by_add[t.prompt] for t in shared)
    planted = adds.sample(1, seed=3, split="train")[0]  # a train sum, drawn again by chain into a test list
    relabelled = next(t for seed in range(50) for t in chains.sample(100, seed=seed, split="train")
                      if t.prompt == planted.prompt)
    assert relabelled.meta["content_hash"] == planted.meta["content_hash"] and split_of(planted.meta["content_hash"]) == "train"
    assert task_key("Compute 3 + 5.", "8") == task_key(" compute 3+5 ", "+8") == content_hash("Compute 3 + 5.", "8")
    assert task_key("Compute 3 + 5.", "8") != task_key("Compute 3 + 5.", "9")


def test_sampling_is_deterministic_and_effort_changes_only_the_effort(env):
    first, again = env.sample(40, seed=11), env.sample(40, seed=11)
    assert first == again
    assert env.sample(80, seed=11)[:40] == first  # a longer sample extends a shorter one
    assert [content(t) for t in first] != [content(t) for t in env.sample(40, seed=12)]
    at_max = env.sample(40, seed=11, effort="max")
    assert [dataclasses.replace(t, effort="high") for t in at_max] == first


def test_max_works_out_every_hard_instance_and_high_all_but_long_chains():
    env = GeneralEnv(families=list(OWN_FAMILIES), add_digits=(6, 6), mul_digits=(4, 4), chain_terms=(6, 6))
    assert env.high_chain_terms == 4
    for task in env.sample(30, seed=2):
        low, high, maximal = (env.solve(dataclasses.replace(task, effort=e)).split("</think>")[0] for e in EFFORTS)
        assert low == "<think>" and len(maximal) > len("<think>")
        assert high == ("<think>" if task.meta["family"] == "chain" else maximal), task.prompt


def test_high_effort_works_out_short_chains_and_max_every_chain():
    """Effort decides which work is written, never how: a chain longer than `high_chain_terms`
    is answered straight away below max, and max writes the same lines high would."""
    env = GeneralEnv(families=["chain"], chain_terms=(2, 5), chain_digits=(1, 1), high_chain_terms=3)
    written = {}
    for task in env.sample(200, seed=5):
        terms = task.meta["terms"]
        trace = chain_trace(terms, task.meta["ops"])
        for effort in EFFORTS:
            thinking, answer = split_thinking(env.solve(dataclasses.replace(task, effort=effort)))
            assert strip_turn_end(answer) == task.meta["answer"] and thinking in ("", trace)
            assert len(trace.splitlines()) == len(terms) - 1
            written.setdefault((effort, len(terms)), set()).add(thinking == trace)
    assert written == {
        ("low", 2): {True}, ("low", 3): {True}, ("low", 4): {False}, ("low", 5): {False},
        ("high", 2): {True}, ("high", 3): {True}, ("high", 4): {False}, ("high", 5): {False},
        ("max", 2): {True}, ("max", 3): {True}, ("max", 4): {True}, ("max", 5): {True},
    }
    with pytest.raises(ValueError, match="high_chain_terms=1"):
        GeneralEnv(high_chain_terms=1)


def test_low_effort_writes_the_steps_of_short_one_digit_sums_only():
    env = GeneralEnv(families=["add", "chain"], add_digits=(1, 2), chain_terms=(2, 3), chain_digits=(1, 1))
    task = env.sample(1, seed=0, effort="low")[0]
    for family, terms, ops, answer, thinking in [
        ("chain", [4, 1, 6], ["+", "-"], "-1", "4+1=5\n5-6=-1"),
        ("add", [8, 8], ["+"], "16", "8+8+0=16\ncarry 1"),
        ("add", [4, 65], ["+"], "69", ""),  # a two-digit term: answered straight away
        ("chain", [1, 2, 3, 4], ["+", "+", "+"], "10", ""),  # four steps would not fit the budget
    ]:
        meta = {"family": family, "terms": terms, "ops": ops, "answer": answer}
        one = dataclasses.replace(task, meta=meta)
        assert env.solve(one) == f"<think>{thinking}</think>{answer}"
        assert env.verify(one, env.solve(one)).reward == 1.0


def test_traces_carry_the_column_arithmetic():
    env = GeneralEnv(families=["add"])
    task = dataclasses.replace(env.sample(1, seed=0)[0], prompt="Compute 958 + 67.")
    task.meta.update(terms=[958, 67], ops=["+"], answer="1025")
    assert env.solve(task) == "<think>8+7+0=15\n5+6+1=12\n9+0+1=10\ncarry 1</think>1025"
    high_mul = GeneralEnv(families=["mul"]).sample(1, seed=0)[0]
    high_mul.meta.update(terms=[47, 36], ops=["*"], answer="1692")
    assert env.solve(high_mul).endswith("282+1410=1692</think>1692")


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="unknown families"):
        GeneralEnv(families=["poetry"])
    with pytest.raises(ValueError, match="add_digits"):
        GeneralEnv(add_digits=(5, 2))
    with pytest.raises(ValueError, match="no_such_family"):
        GeneralEnv(families=["rg/no_such_family"])
    with pytest.raises(ValueError, match="split='eval'"):
        GeneralEnv().sample(1, seed=0, split="eval")


def test_effort_knobs_move_chains_to_high_and_two_digit_sums_to_max():
    """`low_chain_terms` and `high_term_digits` move work up the efforts: here low writes two
    one-digit terms, high also three, and only max the column steps of a two-digit sum."""
    env = GeneralEnv(
        families=["add", "chain"], add_digits=(1, 2), chain_terms=(2, 3), chain_digits=(1, 1),
        low_chain_terms=2, high_chain_terms=3, high_term_digits=1,
    )  # fmt: skip
    written = {}
    for task in env.sample(200, seed=5):
        terms = task.meta["terms"]
        kind = f"{task.meta['family']}{len(terms)}" if task.meta["family"] == "chain" else f"add{max_digits(terms)}"
        for effort in EFFORTS:
            thinking, _ = split_thinking(env.solve(dataclasses.replace(task, effort=effort)))
            written.setdefault((kind, effort), set()).add(thinking != "")
    assert written == {
        ("add1", "low"): {True}, ("add1", "high"): {True}, ("add1", "max"): {True},
        ("chain2", "low"): {True}, ("chain2", "high"): {True}, ("chain2", "max"): {True},
        ("chain3", "low"): {False}, ("chain3", "high"): {True}, ("chain3", "max"): {True},
        ("add2", "low"): {False}, ("add2", "high"): {False}, ("add2", "max"): {True},
    }  # fmt: skip
    for bad in ({"low_chain_terms": 1}, {"high_term_digits": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GeneralEnv(**bad)


def test_contents_are_the_questions_a_text_asks_or_works_answered_with_the_truth():
    assert contents("Compute 3 + 5 - 2.") == {task_key("Compute 3 + 5 - 2.", 6)}
    trace = chain_trace([3, 5, 2, 7], ["+", "-", "+"])  # 3+5=8, 8-2=6, 6+7=13
    stated = {task_key("Compute 3 + 5.", 8), task_key("Compute 8 - 2.", 6), task_key("Compute 6 + 7.", 13)}
    assert contents(f"<think>{trace}</think>13") == stated
    assert contents("<think>7+5+0=12\n4+8+1=13\ncarry 1</think>132") == {
        task_key("Compute 7 + 5 + 0.", 12), task_key("Compute 4 + 8 + 1.", 13)
    }
    assert contents("3-5=-2\n-2+4=2") == {task_key("Compute 3 - 5.", -2), task_key("Compute -2 + 4.", 2)}
    assert contents("Compute 2 + 2.</think>5") == {task_key("Compute 2 + 2.", 4)}  # a wrong answer states the question


def test_train_questions_work_out_only_train_questions_and_held_out_splits_keep_every_draw():
    """Issue #42: a chain's trace works sums that are questions of their own (`8-2=6` is "Compute
    8 - 2."); a train question whose steps state a dev or test question is not drawn for training."""
    recipe = load_recipe(ROOT / "recipes/tiny.yaml")
    env = get_env("general", **recipe.env_options("general"))
    train = env.sample(600, 0, "train", "max")
    assert all(trainable(contents(task.prompt + env.solve(task))) for task in train)
    test = env.sample(600, 0, "test", "max")
    assert not all(trainable(contents(env.solve(task))) for task in test)  # the rule is needed: held out, some do
