"""The agent domain: expert success, end-state rewards, the tool guard, snapshots, determinism, splits."""

from __future__ import annotations

import itertools
import json
import os
import random
import sqlite3
import time
from dataclasses import replace

import pytest

from benchmarks.agent_env import main
from mopd.envs.agent import FAMILIES, AgentEnv, database_key, parse_rows, task_identity
from mopd.envs.agent.database import FIRST_NAMES, TABLES, _build, build_database, open_plain
from mopd.envs.base import Task, split_thinking
from mopd.envs.chat import render_turns
from mopd.envs.data import dataset_to_tasks, tasks_to_dataset, verify_task
from mopd.envs.splits import SPLITS, content_hash, split_of


@pytest.fixture(scope="module")
def env() -> AgentEnv:
    return AgentEnv()


def think_length(transcript: list[dict[str, str]]) -> int:
    return sum(len(split_thinking(turn["content"])[0]) for turn in transcript if turn["role"] == "assistant")


def tool(sql: str) -> str:
    return f"<think></think><tool_call>{sql}</tool_call>"


def test_expert_solves_at_least_99_percent_of_1000_tasks_at_every_effort(env):
    tasks = [task for seed, effort in enumerate(("low", "high", "max"))
             for task in env.sample(334 if effort == "low" else 333, seed=seed, effort=effort)]
    assert len(tasks) == 1000
    rewards = [env.verify(task, env.solve(task)).reward for task in tasks]
    assert sum(r == 1.0 for r in rewards) / len(rewards) >= 0.99
    assert {task.meta["family"] for task in tasks} == set(FAMILIES)


def test_scratchpad_grows_with_effort(env):
    tasks = env.sample(40, seed=7, effort="low")
    lengths = {effort: sum(think_length(env.solve(replace(task, effort=effort))) for task in tasks)
               for effort in ("low", "high", "max")}
    assert lengths["low"] < lengths["high"] < lengths["max"]


def test_transcript_alternates_assistant_and_masked_observation_turns(env):
    task = env.sample(1, seed=3, effort="high")[0]
    transcript = env.solve(task)
    roles = [turn["role"] for turn in transcript]
    assert roles[-1] == "assistant" and roles.count("observation") == len(roles) // 2
    assert all(a != b for a, b in itertools.pairwise(roles))
    segments = render_turns(task.prompt, transcript, task.effort, task.meta["system"])
    observation_segments = [s for s in segments if s.text.startswith("<|observation|>")]
    assert len(observation_segments) == roles.count("observation")
    assert not any(s.train for s in observation_segments)


def test_reward_counts_the_database_not_the_claim(env):
    task = first_of("set_price")
    assert env.verify(task, [{"role": "assistant", "content": "<think>easy</think>Done, price updated."}]).reward == 0
    good = env.solve(task)
    assert env.verify(task, good).reward == 1
    forged = [dict(turn, content="OK, 0 rows changed") if turn["role"] == "observation" else turn for turn in good]
    assert env.verify(task, forged).reward == 1  # observations in a transcript are recomputed, not trusted


def test_a_write_to_any_other_row_scores_zero(env):
    for family in ("set_price", "move_stock", "place_order"):
        task = first_of(family)
        transcript = env.solve(task)
        stray = tool("UPDATE customers SET city = 'Atlantis' WHERE id = 1")
        verdict = env.verify(task, [*transcript[:-1], {"role": "assistant", "content": stray},
                                    transcript[-1]])
        assert verdict.reward == 0 and verdict.details["unexpected_rows"] == 1, family


@pytest.mark.parametrize("family", ["order_total", "order_count", "order_diff"])
def test_question_answers_are_checked_against_the_database(env, family):
    task = first_of(family)
    transcript = env.solve(task)
    verdict = env.verify(task, transcript)
    expected = verdict.details["expected_answer"]
    assert verdict.reward == 1 and verdict.details["answer"] == expected
    final = transcript[-1]["content"].split("</think>")[0] + "</think>"
    assert env.verify(task, [*transcript[:-1], {"role": "assistant", "content": f"{final}{expected + 1}"}]).reward == 0
    assert env.verify(task, [*transcript[:-1], {"role": "assistant", "content": f"{final}${expected:,}.<|end|>"}]).reward == 1
    assert env.verify(task, f"<think>guess</think>{expected}").reward == 1  # no lookup needed if you know it
    vandal = tool("DELETE FROM orders WHERE id = 1")
    assert env.verify(task, [{"role": "assistant", "content": vandal}, transcript[-1]]).reward == 0


def test_new_rows_are_graded_without_their_ids_but_extra_rows_count(env):
    task = replace(first_of("place_order"), effort="low")  # low effort: one INSERT per order line
    transcript = env.solve(task)
    pairs = [transcript[i:i + 4] for i in range(0, len(transcript) - 1, 4)]  # insert + update per line
    reordered = [turn for pair in reversed(pairs) for turn in pair] + transcript[-1:]
    assert len(task.meta["goal"]["lines"]) > 1
    assert env.verify(task, reordered).reward == 1
    twice = [*transcript[:2], *transcript]
    assert env.verify(task, twice).details["unexpected_rows"] >= 1 and env.verify(task, twice).reward == 0


def test_missing_or_unclosed_think_block_scores_zero(env):
    task = first_of("set_price")
    good = env.solve(task)
    for broken in (good[0]["content"].replace("</think>", ""), "<think>I will update it" + good[0]["content"][-80:]):
        verdict = env.verify(task, [{"role": "assistant", "content": broken}, *good[1:]])
        assert verdict.reward == 0 and "think" in verdict.details["error"]


def test_turn_limit_ends_the_episode():
    env = AgentEnv(max_turns=3)
    episode = env.reset(env.sample(1, seed=0)[0])
    done = [env.step(episode, tool("SELECT 1"))[1] for _ in range(3)]
    assert done == [False, False, True] and episode.assistant_turns == 3
    with pytest.raises(ValueError, match="is over"):
        env.step(episode, tool("SELECT 1"))


def test_tool_guard_refuses_escapes_and_bounds_work(tmp_path):
    env = AgentEnv(max_turns=100)
    episode = env.reset(env.sample(1, seed=1)[0])
    before = episode.conn.serialize()
    outside = tmp_path / "stolen.db"
    attacks = {
        f"ATTACH DATABASE '{outside}' AS stolen": "not authorized",
        f"VACUUM INTO '{outside}'": "not authorized",
        "PRAGMA journal_mode = DELETE": "not authorized",
        "PRAGMA max_page_count = 100000000": "not authorized",
        "CREATE TABLE notes (x)": "not authorized",
        "DROP TABLE orders": "not authorized",
        "BEGIN": "not authorized",
        "SELECT load_extension('/tmp/evil.so')": "not authorized",
        "UPDATE products SET price = abs(random()) % 100": "not authorized",
        "SELECT datetime('now')": "not authorized",
        "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT count(*) FROM r": "ran too long",
        "SELECT zeroblob(1000000000)": "too big",
        "SELECT 1; DELETE FROM orders": "one statement",
        "": "empty",
    }
    for sql, message in attacks.items():
        started = time.perf_counter()
        observation, _ = env.step(episode, tool(sql))
        assert observation.startswith("error:") and message in observation, (sql, observation)
        assert time.perf_counter() - started < 3.0, sql
    assert not os.path.exists(outside)
    assert episode.conn.serialize() == before
    assert "one <tool_call>" in env.step(episode, "<think></think><tool_call>SELECT 1")[0]
    assert env.step(episode, tool("PRAGMA table_info(products)"))[0].startswith("cid | name")


def test_observations_are_bounded_in_rows_and_size(env):
    episode = env.reset(env.sample(1, seed=2)[0])
    many, _ = env.step(episode, tool("SELECT a.id, b.id FROM orders a, orders b"))
    assert len(many.splitlines()) == env.max_rows + 2 and "more not shown" in many
    wide, _ = env.step(episode, tool("SELECT group_concat(name, ' ') FROM products, customers"))
    assert len(wide) <= env.max_chars + len("\n(output truncated)")


def test_snapshot_restore_is_byte_identical_and_groups_are_independent(env):
    task = first_of("move_stock")
    transcript = env.solve(task)
    episode = env.reset(task)
    env.step(episode, transcript[0]["content"])
    env.step(episode, tool("UPDATE inventory SET quantity = quantity + 1 WHERE warehouse = 'north'"))
    restored = env.restore(env.snapshot(episode))
    assert restored.conn.serialize() == episode.conn.serialize()
    assert restored.turns == episode.turns and restored.task == episode.task
    with pytest.raises(ValueError, match="not an AgentEnv snapshot"):
        env.restore(b"SQLite format 3\x00")

    group = env.group(task, 4)
    start = group[0].conn.serialize()
    assert all(member.conn.serialize() == start for member in group)
    env.step(group[0], tool("DELETE FROM inventory"))
    assert all(member.conn.serialize() == start for member in group[1:])
    assert start == env.reset(task).conn.serialize()


def test_same_actions_give_the_same_end_state(env):
    task = first_of("place_order")
    actions = [turn["content"] for turn in env.solve(task) if turn["role"] == "assistant"]
    ends = []
    for _ in range(2):
        episode = env.reset(task)
        for action in actions:
            env.step(episode, action)
        ends.append(episode.conn.serialize())
    assert ends[0] == ends[1] != build_database(task.meta["db"])
    assert env.sample(5, seed=9) == env.sample(5, seed=9)


def test_train_dev_and_test_never_share_a_database(env):
    drawn = {split: env.sample(n, seed=0, split=split) for split, n in (("train", 120), ("dev", 40), ("test", 40))}
    for split in SPLITS:
        assert {split_of(task.meta["content_hash"]) for task in drawn[split]} == {split}
        assert all(task.meta["content_hash"] == database_key(task.meta["db"]) for task in drawn[split])
    keys = [{t.meta["content_hash"] for t in drawn[split]} for split in SPLITS]
    assert not keys[0] & keys[1] and not keys[0] & keys[2] and not keys[1] & keys[2]
    identities = {task_identity({k: t.meta[k] for k in ("family", "goal", "db")}) for ts in drawn.values() for t in ts}
    assert len(identities) == 200


def test_the_key_is_the_databases_rows_and_every_question_on_it_shares_it(env):
    """The key hashes what the tables hold (read back from the built database here), so two
    questions on one database, or a train question re-asked in a test list, carry one key."""
    task = env.sample(1, seed=3, split="train")[0]
    conn = open_plain(build_database(task.meta["db"]))
    rows = {table: [list(row) for row in conn.execute(f"SELECT * FROM {table} ORDER BY rowid")] for table in TABLES}
    assert task.meta["content_hash"] == content_hash(json.dumps(rows))
    other_family = next(name for name in FAMILIES if name != task.meta["family"])
    goal = next(filter(None, (FAMILIES[other_family].make(random.Random(seed), conn, 1) for seed in range(100))))
    content = {"family": other_family, "goal": goal, "db": task.meta["db"]}
    planted = env._task(content, task_identity(content), "test", "high")
    assert planted.prompt != task.prompt and planted.meta["content_hash"] == task.meta["content_hash"]
    test = [*env.sample(20, seed=3, split="test"), planted]
    assert [t for t in test if t.meta["content_hash"] == task.meta["content_hash"]] == [planted]
    other_db = {**task.meta["db"], "seed": task.meta["db"]["seed"] + 1}
    assert database_key(other_db) != task.meta["content_hash"]


def test_tasks_round_trip_through_a_dataset_and_stay_verifiable(env):
    tasks = env.sample(8, seed=4, effort="max")
    back = dataset_to_tasks(tasks_to_dataset(tasks))
    assert back == tasks
    assert json.loads(json.dumps(tasks[0].meta)) == tasks[0].meta
    assert all(verify_task(task, env.solve(task)).reward == 1 for task in back)  # through the registry


def test_benchmark_command_writes_its_numbers(tmp_path):
    out = tmp_path / "bench" / "agent.json"
    main(["--out", str(out), "--db-bytes", "200000", "--repeats", "20", "--episodes", "10", "--expert-tasks", "6"])
    report = json.loads(out.read_text())
    snapshots = report["snapshot_restore"]
    assert snapshots["restore_byte_identical"] and snapshots["db_bytes"] > 100_000
    assert 0 < snapshots["snapshot_ms"]["wall"]["p50"] <= snapshots["snapshot_ms"]["wall"]["p99"]
    assert report["step_throughput"]["default_db"]["steps_per_s"] > 0
    assert report["expert"]["tasks"] == 6 and report["machine"]["cpu_count"] == os.cpu_count()


def test_bad_options_name_the_problem():
    with pytest.raises(ValueError, match="unknown"):
        AgentEnv(families=["sql_injection"])
    with pytest.raises(ValueError, match="n_products"):
        AgentEnv(n_products=10_000)
    with pytest.raises(ValueError, match="split='eval'"):
        AgentEnv().sample(1, seed=0, split="eval")
    task = AgentEnv().sample(1, seed=0)[0]
    with pytest.raises(ValueError, match=r"meta lacks \['goal'\]"):
        AgentEnv().verify(replace(task, meta={k: v for k, v in task.meta.items() if k != "goal"}), "<think></think>1")
    with pytest.raises(ValueError, match=r"meta\.family 'chess'"):
        AgentEnv().reset(replace(task, meta={**task.meta, "family": "chess"}))
    with pytest.raises(ValueError, match=r"bad meta\.db"):
        AgentEnv().reset(replace(task, meta={**task.meta, "db": {"seed": 1}}))


def test_initial_database_is_rebuilt_identically_from_its_spec(env):
    spec = env.sample(1, seed=5)[0].meta["db"]
    uncached = _build.__wrapped__(spec["seed"], spec["n_products"], spec["n_customers"], spec["n_orders"])
    assert uncached == build_database(spec)
    conn = sqlite3.connect(":memory:")
    conn.deserialize(uncached)
    assert conn.execute("SELECT COUNT(*) FROM products").fetchone()[0] == spec["n_products"]


def first_of(family: str) -> Task:
    return AgentEnv(families=[family]).sample(1, seed=21, effort="high")[0]


def test_short_system_prompt_keeps_the_protocol_and_drops_the_schema(env):
    short = AgentEnv(families=["order_total"], max_lookups=1, system_prompt="short")
    tasks = short.sample(30, seed=0, effort="high")
    system = tasks[0].meta["system"]
    assert "<tool_call>" in system and "<think>" in system and "CREATE TABLE" not in system
    assert len(system) * 5 < len(env.sample(1, seed=0)[0].meta["system"])
    assert all(short.verify(task, short.solve(task)).reward == 1.0 for task in tasks)
    with pytest.raises(ValueError, match="system_prompt='long'"):
        AgentEnv(system_prompt="long")


def test_order_count_names_customers_by_number_only():
    """The family for tiny models: the only thing to copy from the prompt is a number."""
    tasks = AgentEnv(families=["order_count"], max_lookups=2).sample(20, seed=3, effort="low")
    for task in tasks:
        assert not any(name in task.prompt for name in FIRST_NAMES)
        assert all(f"#{cid}" in task.prompt for cid in task.meta["goal"]["customer_ids"])
        for effort in ("low", "high", "max"):
            transcript = AgentEnv(families=["order_count"]).solve(replace(task, effort=effort))
            assert len(transcript) == 3  # one COUNT query, its observation, the answer
        high, maximal = (AgentEnv(families=["order_count"]).solve(replace(task, effort=e))[0]["content"]
                         for e in ("high", "max"))
        # max thinks more, but before the ids: the SQL follows them exactly as at high
        assert maximal.endswith(high.removeprefix("<think>")) and len(maximal) > len(high)
    assert {len(task.meta["goal"]["customer_ids"]) for task in tasks} == {1, 2}


def test_order_diff_subtracts_on_paper_the_first_step_at_high_and_every_step_at_max():
    """Where effort pays in the agent domain: the same lookup of every count, then one-digit
    subtractions in the last think block: none at low, the first at high (the rest in the head),
    every one at max."""
    env = AgentEnv(families=["order_diff"], system_prompt="short", max_turns=6, max_lookups=3)
    tasks = env.sample(40, seed=4, effort="low")
    assert {len(task.meta["goal"]["fewer"]) for task in tasks} == {1, 2, 3}
    for task in tasks:
        goal = task.meta["goal"]
        ids = [goal["more"], *goal["fewer"]]
        assert all(f"#{customer}" in task.prompt for customer in ids)
        for effort in ("low", "high", "max"):
            transcript = env.solve(replace(task, effort=effort))
            verdict = env.verify(task, transcript)
            answer = verdict.details["expected_answer"]
            assert verdict.reward == 1 and 1 <= answer <= 9
            assert len(transcript) == 3  # one query counting all, its observation, the answer
            rows = parse_rows(transcript[1]["content"])
            assert int(rows[0][0]) == goal["more"] and sorted(int(row[0]) for row in rows) == sorted(ids)
            counts = [int(row[1]) for row in rows]
            assert counts == sorted(counts, reverse=True)  # the largest count first
            lines, left = [], counts[0]
            for count in counts[1:]:
                lines.append(f"{left}-{count}={left - count}")
                left -= count
            assert left == answer
            last_thought = split_thinking(transcript[-1]["content"])[0]
            written = {"low": [], "high": lines[:1], "max": lines}[effort]
            assert last_thought.endswith("\n".join(written)), (effort, last_thought)
            assert all(line not in last_thought for line in lines if line not in written)


def test_max_answer_share_caps_how_many_questions_one_answer_answers():
    """order_diff's differences lean to 1 (more than half of a split's draws); with the cap no answer answers more
    than its share of any prefix of a draw, a shorter draw is the start of a longer one (the bench takes the first n
    distinct tasks of a longer draw), and no cap leaves the draws as they were."""
    from collections import Counter

    from mopd.envs.agent.env import question_answer

    skewed = AgentEnv(families=["order_diff"], max_lookups=3).sample(32, 1001, "test", "max")
    capped_env = AgentEnv(families=["order_diff"], max_lookups=3, max_answer_share=0.25)
    capped = capped_env.sample(32, 1001, "test", "max")
    assert Counter(question_answer(t.meta) for t in skewed).most_common(1)[0][1] > 8  # the skew the cap is for
    assert Counter(question_answer(t.meta) for t in capped).most_common(1)[0][1] <= 8
    assert [t.id for t in capped] == [t.id for t in capped_env.sample(32, 1001, "test", "max")]
    assert [t.id for t in capped_env.sample(16, 1001, "test", "max")] == [t.id for t in capped[:16]]
    assert [t.id for t in AgentEnv(families=["order_diff"], max_lookups=3, max_answer_share=None).sample(32, 1001, "test", "max")] == [
        t.id for t in skewed
    ]
    with pytest.raises(ValueError, match="max_answer_share=0"):
        AgentEnv(max_answer_share=0)
