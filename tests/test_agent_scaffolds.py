"""Agent scaffolds (#60): every harness round-trips through the expert and the verifier, refuses
malformed calls in its own words, splits train / held-out by its name's hash, never reaches trained
text when held out, and `fixed` keeps today's tasks byte for byte."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict

import pytest

from mopd.base.sft import train_contents
from mopd.envs import prompt_contents
from mopd.envs.agent import FAMILIES, AgentEnv
from mopd.envs.agent.scaffolds import MOPD, SCAFFOLDS, held_out, of_split, scaffold_of
from mopd.envs.agent.verify import contents
from mopd.envs.chat import CHAT_TEMPLATE, messages_for, render_turns
from mopd.envs.splits import trainable

BY_SYNTAX_MALFORMED = {
    "tags": ["<{tool}>SELECT 1", "SELECT 1</{tool}>", "<{tool}>SELECT 1</{tool}><{tool}>SELECT 2</{tool}>",
             "</{tool}>SELECT 1<{tool}>"],
    "json": ['{{"name": "{tool}", "arguments": {{"{argument}": "SELECT 1"', '{{"name": "other", "arguments": {{"{argument}": "SELECT 1"}}}}',
             '{{"name": "{tool}", "arguments": {{"wrong": "SELECT 1"}}}}', '{{"name": "{tool}", "arguments": {{"{argument}": 7}}}}'],
    "function": ['{tool}("SELECT 1")', '{tool}({argument}="SELECT 1"', '{tool}(wrong="SELECT 1")', '{tool}({argument}=1)',
                 '{tool}({argument}="SELECT 1") and more'],
}


def malformed_calls(scaffold) -> list[str]:
    """Broken calls in the scaffold's syntax; a wrapped JSON call is broken inside its tags or in them
    (a bare object there is a final answer, as in its harness)."""
    bad = [b.format(tool=scaffold.tool, argument=scaffold.argument) for b in BY_SYNTAX_MALFORMED[scaffold.syntax]]
    if scaffold.wrap is None:
        return bad
    good = scaffold.call("SELECT 1")
    return [f"<{scaffold.wrap}>{b}</{scaffold.wrap}>" for b in bad] + [good + good, good.removesuffix(f"</{scaffold.wrap}>")]


def transcript_text(task, turns) -> str:
    return "".join(segment.text for segment in render_turns(task.prompt, turns, task.effort, task.meta["system"]))


def tasks_in(scaffold, n: int = 12, effort: str = "high", **options):
    """Test-split tasks: a held-out scaffold never asks a train task."""
    return AgentEnv(scaffolds=[scaffold.name], **options).sample(n, seed=3, split="test", effort=effort)


def calls(scaffold, turns) -> list[str]:
    return [scaffold.find_call(t["content"].split("</think>", 1)[1]) for t in turns if t["role"] == "assistant"][:-1]


# ----------------------------------------------------------------------------- the scaffolds
def test_at_least_six_scaffolds_two_held_out_and_todays_harness_trains():
    assert len(SCAFFOLDS) >= 6 and len({s.name for s in SCAFFOLDS}) == len(SCAFFOLDS)
    assert MOPD.split == "train"
    assert {s.name for s in held_out()} == {"smolagents", "glaive", "qwen-agent", "functionary"}  # by the hash of the name
    assert of_split("dev") and of_split("test")
    assert {s.syntax for s in of_split("train")} == {"tags", "json", "function"}
    assert {s.rows for s in of_split("train")} == {"pipe", "csv", "json"}
    assert {s.role for s in of_split("train")} == {"observation", "user"}


@pytest.mark.parametrize("scaffold", SCAFFOLDS, ids=lambda s: s.name)
def test_expert_demo_parses_back_to_the_same_sql_and_verifies(scaffold):
    env = AgentEnv(scaffolds=[scaffold.name])
    today = AgentEnv()
    for task, plain in zip(tasks_in(scaffold, n=len(FAMILIES) * 3), today.sample(len(FAMILIES) * 3, seed=3, split="test"), strict=True):
        assert task.meta["scaffold"] == scaffold.name and task.meta["observation_role"] == scaffold.role
        demo, reference = env.solve(task), today.solve(plain)
        assert calls(scaffold, demo) == calls(MOPD, reference)  # the same SQL, in this scaffold's syntax
        assert all(scaffold.tool in t["content"] for t in demo if t["role"] == "assistant" and t is not demo[-1])
        assert {t["role"] for t in demo} == {"assistant", scaffold.role}
        assert env.verify(task, demo).reward == 1.0
        assert today.verify(task, demo).reward == 1.0  # the task carries its scaffold to any env


@pytest.mark.parametrize("scaffold", SCAFFOLDS, ids=lambda s: s.name)
def test_malformed_calls_get_the_scaffolds_own_error(scaffold):
    env = AgentEnv(scaffolds=[scaffold.name])
    task = tasks_in(scaffold, n=1)[0]
    for answer in malformed_calls(scaffold):
        episode = env.reset(task)
        observation, done = env.step(episode, f"<think></think>{answer}")
        assert observation == scaffold.error_text(scaffold.malformed), answer
        assert not done and episode.turns[-1]["role"] == scaffold.role
    others = {s.error_text(s.malformed) for s in SCAFFOLDS if s is not scaffold}
    assert scaffold.error_text(scaffold.malformed) not in others
    episode = env.reset(task)
    assert env.step(episode, f"<think></think>{scaffold.call('SELECT x FROM nowhere')}")[0] == \
        scaffold.error_text("no such table: nowhere")
    assert env.step(episode, f"<think></think>{scaffold.call('  ')}")[0] == scaffold.error_text(scaffold.empty)
    assert env.step(episode, f"<think></think>{scaffold.call('DELETE FROM orders WHERE id = 1')}")[0] == scaffold.changed_text(1)


@pytest.mark.parametrize("scaffold", SCAFFOLDS, ids=lambda s: s.name)
def test_a_scaffolds_text_states_that_scaffold_alone(scaffold):
    for wording in ("full", "short"):
        task = tasks_in(scaffold, n=1, system_prompt=wording)[0]
        assert contents(transcript_text(task, AgentEnv().solve(task))) == {scaffold.key}
        assert "{" + "example}" not in task.meta["system"] and "{max_turns}" not in task.meta["system"]


# ----------------------------------------------------------------------------- fixed and rotate
def digest(env: AgentEnv, n: int = 12) -> str:
    """Every task's fields and its rendered expert transcript, over the three splits and efforts."""
    h = hashlib.sha256()
    for split, effort in (("train", "low"), ("dev", "high"), ("test", "max")):
        for task in env.sample(n, seed=5, split=split, effort=effort):
            h.update(json.dumps(asdict(task), sort_keys=True).encode())
            h.update(transcript_text(task, env.solve(task)).encode())
    return h.hexdigest()[:16]


def observations_digest(env: AgentEnv) -> str:
    episode = env.reset(env.sample(1, seed=1)[0])
    answers = ["SELECT * FROM nope</tool_call>", "</tool_call>", "a</tool_call><tool_call>b</tool_call>",
               "UPDATE products SET price = price WHERE id < 3</tool_call>", "SELECT id, name FROM products</tool_call>",
               "DROP TABLE products</tool_call>"]
    outs = [env.step(episode, f"<think></think><tool_call>{answer}")[0] for answer in answers]
    return hashlib.sha256(json.dumps(outs).encode()).hexdigest()[:16]


def test_fixed_reproduces_todays_tasks_byte_for_byte():
    """Literals recorded at 604e782, before scaffolds existed."""
    assert digest(AgentEnv()) == digest(AgentEnv(scaffolds="fixed")) == "a5ea1a2e5a317cce"
    tiny = {"families": ["order_diff"], "max_lookups": 3, "system_prompt": "short", "max_turns": 6}
    assert digest(AgentEnv(**tiny)) == "0209547dd079f98f"
    assert observations_digest(AgentEnv(max_rows=5)) == "f3dabe92035119d6"


def test_rotate_draws_train_scaffolds_per_task_and_records_the_draw():
    env = AgentEnv(scaffolds="rotate")
    tasks = env.sample(60, seed=11)
    drawn = [task.meta["scaffold"] for task in tasks]
    assert set(drawn) == {s.name for s in of_split("train")}
    assert [t.meta["system"] for t in tasks] == [scaffold_of(t.meta).system_prompt("full", *system_args(env)) for t in tasks]
    again = AgentEnv(scaffolds="rotate").sample(60, seed=11, effort="max")
    assert [t.meta["scaffold"] for t in again] == drawn  # the same task, the same scaffold, at any effort
    assert [t.id for t in tasks] == [t.id for t in AgentEnv().sample(60, seed=11)]  # the questions are today's
    restored = env.restore(env.snapshot(env.reset(tasks[0])))
    assert restored.task.meta["scaffold"] == drawn[0]


def system_args(env: AgentEnv) -> tuple:
    from mopd.envs.agent.database import SCHEMA

    return SCHEMA, env.max_rows, env.max_turns


def test_heldout_suites_ask_the_scaffolds_of_their_split():
    env = AgentEnv(scaffolds="heldout")
    for split in ("dev", "test"):
        assert {t.meta["scaffold"] for t in env.sample(40, seed=2, split=split)} == {s.name for s in of_split(split)}


@pytest.mark.parametrize("bad", ["sometimes", ["mopd", "nope"], []])
def test_an_unknown_scaffold_choice_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="scaffolds"):
        AgentEnv(scaffolds=bad)


# ----------------------------------------------------------------------------- the trained-text audit
def test_rotated_training_text_states_no_held_out_scaffold():
    env = AgentEnv(scaffolds="rotate", system_prompt="short")
    tasks = env.sample(30, seed=4, effort="max")
    keys = set().union(*(train_contents(task, env.solve(task)) for task in tasks))  # SFT's check: raises if held out
    assert keys == {s.key for s in of_split("train")}
    assert trainable(prompt_contents(tasks))  # what RL and MOPD record of their prompts


@pytest.mark.parametrize("scaffold", held_out(), ids=lambda s: s.name)
def test_a_planted_held_out_scaffold_is_refused(scaffold):
    task = tasks_in(scaffold, n=1)[0]
    with pytest.raises(ValueError, match="held-out contents"):
        train_contents(task, AgentEnv().solve(task))
    plain = AgentEnv().sample(1, seed=3, effort="high")[0]  # today's prompt, one turn in the held-out syntax
    planted = [{"role": "assistant", "content": f"<think></think>{scaffold.call('SELECT 1')}"}]
    with pytest.raises(ValueError, match="held-out contents"):
        train_contents(plain, planted)


def test_user_role_observations_render_as_user_turns_in_both_templates(tiny_tokenizer):
    from mopd.envs.chat import chat_format

    turns = [{"role": "assistant", "content": "<think>a</think>x"}, {"role": "user", "content": "1 row updated"},
             {"role": "assistant", "content": "<think>b</think>3"}]
    segments = render_turns("q", turns, "low", "sys")
    text = "".join(s.text for s in segments)
    assert "<|user|>1 row updated<|end|><|assistant|><|effort:low|>" in text
    assert not any(s.train and "row updated" in s.text for s in segments)
    tiny_tokenizer.chat_template = CHAT_TEMPLATE
    assert tiny_tokenizer.apply_chat_template(messages_for("q", turns, "sys"), effort="low", tokenize=False) == text
    ids = chat_format(tiny_tokenizer).observation_ids("1 row updated", "low", "user")
    assert tiny_tokenizer.decode(ids) == "<|user|>1 row updated<|end|><|assistant|><|effort:low|>"


# ----------------------------------------------------------------------------- suites and reports
@pytest.mark.parametrize(("path", "split", "asked"), [
    ("eval/tiny-scaffolds.yaml", "test", {"qwen-agent", "functionary"}),
    ("eval/tiny-scaffolds-dev.yaml", "dev", {"smolagents", "glaive"}),
    ("eval/tiny-scaffolds-seen.yaml", "test", {s.name for s in of_split("train")}),
])
def test_scaffold_suites_ask_their_scaffolds(path, split, asked):
    from mopd.bench.suite import load_suite, make_env, select

    suite = load_suite(path)
    assert suite.split == split and suite.n == 128
    suite = select(suite, n=24)
    env = make_env(suite, "agent", {"system_prompt": "short"})
    assert {t.meta["scaffold"] for t in suite.tasks(env, "low")} == asked


@pytest.mark.parametrize(("agent", "message"), [
    ({"scaffolds": ["mopd", "kimi"]}, r"bad\.yaml: field `domains\.agent\.scaffolds`.*unknown scaffold 'kimi'"),
    ({"scaffolds": "sometimes"}, r"bad\.yaml: field `domains\.agent\.scaffolds`.*'sometimes'"),
])
def test_a_suite_naming_an_unknown_scaffold_is_a_named_error(tmp_path, agent, message):
    import yaml

    from mopd.bench.suite import SuiteError, load_suite

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"name": "bad", "split": "test", "n": 1, "domains": {"agent": agent}}))
    with pytest.raises(SuiteError, match=message):
        load_suite(path)
    path.write_text(yaml.safe_dump({"name": "bad", "split": "test", "n": 1, "domains": {"general": {"scaffolds": "heldout"}}}))
    with pytest.raises(SuiteError, match="only the agent domain takes scaffolds"):
        load_suite(path)


def test_seen_in_training_is_read_from_the_runs_records(tmp_path):
    from mopd.bench.scaffolds import scaffolds_seen
    from mopd.envs.splits import TRAINED_ON, TRAINED_TEXT, write_trained_on

    run = tmp_path / "run"
    (run / "recipe.json").parent.mkdir()
    (run / "recipe.json").write_text("{}")
    rotated = AgentEnv(scaffolds="rotate", system_prompt="short").sample(20, seed=1)
    for stage in ("base", "teachers/agent-low"):
        write_trained_on(run / stage, [], TRAINED_ON)
        write_trained_on(run / stage, prompt_contents(rotated if stage == "base" else AgentEnv().sample(2, seed=1)), TRAINED_TEXT)
    asked = AgentEnv(scaffolds=["mopd", "hermes", "functionary"]).sample(30, seed=9, split="test", effort="low")
    seen = scaffolds_seen([("teacher", run / "teachers" / "agent-low", "agent-low", asked),
                           ("plain", run / "teachers" / "agent-low", "agent-low", AgentEnv().sample(3, seed=9, split="test"))])
    assert seen == {("teacher", "agent-low"): {"mopd": True, "hermes": True, "functionary": False}}
    outside = scaffolds_seen([("other", tmp_path / "elsewhere", "agent-low", asked)])
    assert set(outside[("other", "agent-low")].values()) == {None}


def test_the_report_breaks_agent_accuracy_down_by_scaffold():
    from mopd.bench.scaffolds import scaffold_table

    def row(model, effort, rewards):
        return {"model": model, "domain": "agent", "effort": effort, "task_rewards": rewards,
                "task_keys": [f"{i:016x}" for i in range(4)], "task_scaffolds": ["glaive", "mopd", "glaive", "mopd"],
                "scaffolds_seen": {"glaive": False, "mopd": model == "student"}}

    report = {"efforts": {"low": {}, "high": {}}, "suite": {"samples": 1},
              "results": [row("student", "low", [1, 1, 0, 1]), row("student", "high", [0, 1, 0, 1]),
                          row("base", "low", [0, 0, 0, 1]), row("base", "high", [0, 0, 0, 0])]}
    lines = scaffold_table(report, ["base", "student"], {})
    assert lines[0] == "| scaffold | seen in training | effort | answers a model | base | student |"
    glaive = [line for line in lines if line.startswith("| glaive |")]
    assert [line.split(" | ")[1:4] for line in glaive] == [["no", "all", "4"], ["no", "low", "2"], ["no", "high", "2"]]
    assert glaive[1].split(" | ")[5].startswith("0.50")  # the student's low glaive tasks: 1 and 0
    assert all(line.split(" | ")[1] == "by student" for line in lines if line.startswith("| mopd |"))
    assert scaffold_table({**report, "results": [{k: v for k, v in r.items() if k != "task_scaffolds"}
                                                 for r in report["results"]]}, ["base"], {}) == []


@pytest.mark.parametrize("choice", ["heldout", ["mopd", "functionary"]])
def test_train_tasks_never_take_a_held_out_scaffold(choice):
    with pytest.raises(ValueError, match=r"train tasks \(what training draws\) take train scaffolds only"):
        AgentEnv(scaffolds=choice).sample(1, seed=0, split="train")


def test_fixed_keeps_the_tiny_recipes_stage_hashes_and_rotate_changes_every_stage():
    from pathlib import Path

    from mopd.artifacts import config_hash
    from mopd.pipeline import build_stages
    from mopd.recipe import load_recipe, load_teacher_specs
    from mopd.rl.teachers import spec_hash

    def hashes(overrides):
        recipe = load_recipe("recipes/tiny.yaml", overrides)
        stages = {s.name: config_hash(s.name, s.config)[:16] for s in build_stages(recipe, Path("recipes"))}
        specs = load_teacher_specs(recipe, Path("recipes"))
        return stages, spec_hash(specs["agent-max"], recipe, Path("/nonexistent/base"))[:16]

    recorded = ({"base": "6a5a32e4d8b955bc", "teachers": "09f8fd71322ab48c", "distill": "f32fe82627035599",
                 "bench": "eed6bdcd9283dc86"}, "1d406d55aa95e09a")  # at 604e782, before scaffolds existed
    assert hashes([]) == recorded
    rotated, teacher = hashes(["envs.agent.scaffolds=rotate"])
    assert all(rotated[name] != recorded[0][name] for name in recorded[0]) and teacher != recorded[1]
