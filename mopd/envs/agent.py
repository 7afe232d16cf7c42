"""The agent domain: multi-turn tool use against a real embedded SQLite database.

Protocol (the system prompt each task carries in `task.meta["system"]` says the same):
- Every assistant turn is `<think>…</think>` then an answer.
- A tool call is one SQL statement inside the answer, exactly one per turn:
  `<tool_call>SELECT price FROM products WHERE name = 'steel bolt'</tool_call>`.
  The environment runs it on the episode's own database and replies with an observation turn
  (role "observation"; its tokens are masked out of training losses):
  column names then rows, cells separated by " | ", at most `max_rows` rows, then "(N rows)";
  or "OK, N rows changed" after a write; or "error: <SQLite's message>".
- An assistant turn without a tool call is the final answer and ends the episode; so does the
  turn limit (`task.meta["max_turns"]` assistant turns). A turn without a closed think block
  ends the episode with reward 0.
- For a question the final answer is the number alone.

Reward (`verify`) comes from the database alone: the verifier rebuilds the task's initial
database, applies the intended change itself, and compares every table with the episode's end
state. Any difference (a missed change, or a write to any other row) gives 0. Questions are
answered against the database, and they must leave it untouched. What the model says it did
never counts.

Every episode runs on a private in-memory database (see `agent_db` for the guard on the tool).
`snapshot` serializes the episode, database included, and `restore` gives back an identical,
independent episode, so every member of a GRPO group starts from the same state (`group`).
The same actions always lead to the same end state, byte for byte.

Train, dev and test never share a database (`mopd.envs.splits`): a task's key is the hash of its
database's rows (`database_key`), and the key puts it, with every question asked of that database,
in exactly one split, whatever the seeds. The key is `task.meta["content_hash"]`. (The same question
text may come back in another split, asked of another database: its answer differs.)
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sqlite3
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from mopd.envs.agent_db import (
    ID_TABLES,
    ITEMS_BY_CATEGORY,
    SCHEMA,
    TABLES,
    WAREHOUSES,
    StatementBudget,
    build_database,
    database_rows,
    db_spec,
    open_guarded,
    open_plain,
)
from mopd.envs.base import EFFORTS, Task, Verdict, split_thinking
from mopd.envs.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, strip_turn_end
from mopd.envs.splits import check_split, content_hash, split_of

SNAPSHOT_MAGIC = b"MOPD-AGENT-1\n"

SYSTEM_PROMPT = """\
You are a database agent working on a SQLite database with these tables (prices in whole dollars):
{schema}
Work in turns. In each turn think inside <think>...</think>, then either call the tool or give your final answer.
To call the tool, write exactly one SQL statement inside <tool_call>...</tool_call>, for example:
<tool_call>SELECT price FROM products WHERE name = 'steel bolt'</tool_call>
The result comes back as an observation: column names and rows with cells separated by " | " (at most {max_rows} rows), "OK, N rows changed" after a write, or "error: ...".
Only SELECT, INSERT, UPDATE and DELETE on these tables are allowed; every write is saved at once. Leave the ids of new rows to the database.
A turn without a tool call is your final answer and ends the episode. When asked a question, answer with the number alone. You have at most {max_turns} turns."""

# The same protocol without the schema or the examples, for models that learn the tables from
# their training transcripts: about a sixth of the tokens, which a tiny model pays on every turn.
SHORT_SYSTEM_PROMPT = """\
SQLite shop database (customers, products, orders, inventory). Each turn: <think>...</think>, then one SQL statement in <tool_call>...</tool_call>, or the final answer (a question's answer is the number alone). At most {max_turns} turns."""
SYSTEM_PROMPTS = {"full": SYSTEM_PROMPT, "short": SHORT_SYSTEM_PROMPT}


@dataclass
class Episode:
    """One conversation with its own database. `turns` hold assistant and observation turns."""

    task: Task
    conn: sqlite3.Connection
    budget: StatementBudget
    turns: list[dict[str, str]] = field(default_factory=list)
    done: bool = False
    final_answer: str | None = None
    error: str | None = None  # a format error that ended the episode

    @property
    def assistant_turns(self) -> int:
        return sum(turn["role"] == "assistant" for turn in self.turns)


class AgentEnv:
    domain = "agent"

    def __init__(self, families: tuple[str, ...] | list[str] | None = None, max_lookups: int = 3,
                 n_products: int = 30, n_customers: int = 15, n_orders: int = 60, max_turns: int = 16,
                 max_rows: int = 50, max_chars: int = 4000, max_statement_steps: int = 20_000_000,
                 max_statement_seconds: float = 2.0, system_prompt: str = "full"):
        self.families = tuple(families or FAMILIES)
        unknown = [name for name in self.families if name not in FAMILIES]
        if unknown:
            raise ValueError(f"AgentEnv families: unknown {unknown}; known: {sorted(FAMILIES)}")
        if not 1 <= max_lookups <= 3:
            raise ValueError(f"AgentEnv max_lookups={max_lookups}: must be 1, 2 or 3")
        if system_prompt not in SYSTEM_PROMPTS:
            raise ValueError(f"AgentEnv system_prompt={system_prompt!r}: must be one of {sorted(SYSTEM_PROMPTS)}")
        db_spec(0, n_products, n_customers, n_orders)  # validates the sizes early
        self.system_prompt = SYSTEM_PROMPTS[system_prompt]
        self.max_lookups = max_lookups
        self.sizes = {"n_products": n_products, "n_customers": n_customers, "n_orders": n_orders}
        self.max_turns = max_turns
        self.max_rows, self.max_chars = max_rows, max_chars
        self.max_statement_steps, self.max_statement_seconds = max_statement_steps, max_statement_seconds

    # ---- tasks ---------------------------------------------------------------------------------

    def sample(self, n: int, seed: int, split: str = "train", effort: str = "high") -> list[Task]:
        check_split(split)
        if effort not in EFFORTS:
            raise ValueError(f"effort={effort!r}: must be one of {EFFORTS}")
        tasks, seen = [], set()
        for index in range(n):
            for attempt in range(1000):
                content = self._generate(random.Random(f"agent/{split}/{seed}/{index}/{attempt}"), split)
                identity = content and task_identity(content)
                if identity and identity not in seen:
                    break
            else:
                raise RuntimeError(f"could not generate agent task {index} for seed {seed}; loosen the knobs")
            seen.add(identity)
            tasks.append(self._task(content, identity, split, effort))
        return tasks

    def _generate(self, rng: random.Random, split: str) -> dict[str, Any] | None:
        family = rng.choice(self.families)
        lookups = rng.randint(1, self.max_lookups)
        spec = self._database_of_split(rng, split)
        conn = open_plain(build_database(spec))
        goal = FAMILIES[family].make(rng, conn, lookups)
        conn.close()
        return goal and {"family": family, "goal": goal, "db": spec}

    def _database_of_split(self, rng: random.Random, split: str) -> dict[str, int]:
        while True:
            spec = db_spec(rng.randrange(2**31), **self.sizes)
            if split_of(database_key(spec)) == split:
                return spec

    def _task(self, content: dict[str, Any], identity: str, split: str, effort: str) -> Task:
        family = FAMILIES[content["family"]]
        system = self.system_prompt.format(schema=SCHEMA, max_rows=self.max_rows, max_turns=self.max_turns)
        meta = {**content, "content_hash": database_key(content["db"]), "max_turns": self.max_turns, "system": system}
        return Task(id=f"agent-{split}-{identity[:16]}", domain=self.domain, effort=effort,
                    prompt=family.prompt(content["goal"]), meta=meta)

    # ---- episodes ------------------------------------------------------------------------------

    def reset(self, task: Task) -> Episode:
        check_task(task)
        return self._episode(task, build_database(task.meta["db"]))

    def _episode(self, task: Task, data: bytes) -> Episode:
        conn = open_guarded(data)
        budget = StatementBudget(conn, self.max_statement_steps, self.max_statement_seconds)
        return Episode(task=task, conn=conn, budget=budget)

    def step(self, episode: Episode, assistant_text: str) -> tuple[str | None, bool]:
        """Take one assistant turn; return (observation or None, done)."""
        if episode.done:
            raise ValueError(f"episode of task {episode.task.id} is over; reset or restore to continue")
        episode.turns.append({"role": "assistant", "content": assistant_text})
        parts = split_thinking(assistant_text)
        if parts is None:
            episode.error = f"assistant turn {episode.assistant_turns} has no closed </think> block"
            episode.done = True
            return None, True
        answer = strip_turn_end(parts[1])
        call = find_tool_call(answer)
        if call is None:
            episode.final_answer = answer
            episode.done = True
            return None, True
        observation = self._run_tool(episode, call)
        episode.turns.append({"role": "observation", "content": observation})
        episode.done = episode.assistant_turns >= episode.task.meta.get("max_turns", self.max_turns)
        return observation, episode.done

    def _run_tool(self, episode: Episode, call: str | ToolCallError) -> str:
        if isinstance(call, ToolCallError):
            return f"error: {call}"
        if not call.strip():
            return "error: the tool call is empty"
        try:
            with episode.budget:
                cursor = episode.conn.execute(call)
                if cursor.description is None:
                    return f"OK, {cursor.rowcount} row{'' if cursor.rowcount == 1 else 's'} changed"
                return self._format_rows(cursor)
        except sqlite3.Error as error:
            return f"error: {_explain(error)}"
        except (OverflowError, ValueError) as error:
            return f"error: {error}"

    def _format_rows(self, cursor: sqlite3.Cursor) -> str:
        rows = cursor.fetchmany(self.max_rows + 1)
        more = len(rows) > self.max_rows
        lines = [" | ".join(column[0] for column in cursor.description)]
        lines += [" | ".join(_cell(value) for value in row) for row in rows[: self.max_rows]]
        lines.append(f"(first {self.max_rows} rows; more not shown)" if more else f"({len(rows)} row{'' if len(rows) == 1 else 's'})")
        text = "\n".join(lines)
        return text if len(text) <= self.max_chars else text[: self.max_chars] + "\n(output truncated)"

    def snapshot(self, episode: Episode) -> bytes:
        """The whole episode as bytes: a magic line, a JSON header (task, turns, status), the database."""
        header = json.dumps({"task": asdict(episode.task), "turns": episode.turns, "done": episode.done,
                             "final_answer": episode.final_answer, "error": episode.error}).encode()
        return b"".join((SNAPSHOT_MAGIC, len(header).to_bytes(4, "little"), header, episode.conn.serialize()))

    def restore(self, data: bytes) -> Episode:
        if not data.startswith(SNAPSHOT_MAGIC):
            raise ValueError("AgentEnv.restore: these bytes are not an AgentEnv snapshot")
        start = len(SNAPSHOT_MAGIC) + 4
        end = start + int.from_bytes(data[len(SNAPSHOT_MAGIC): start], "little")
        header = json.loads(data[start:end])
        episode = self._episode(Task(**header.pop("task")), memoryview(data)[end:])
        for name, value in header.items():
            setattr(episode, name, value)
        return episode

    def group(self, task: Task, n: int) -> list[Episode]:
        """n independent episodes that all start from the same database state (a GRPO group)."""
        state = self.snapshot(self.reset(task))
        return [self.restore(state) for _ in range(n)]

    # ---- verification --------------------------------------------------------------------------

    def verify(self, task: Task, attempt: Episode | list[dict[str, str]] | str) -> Verdict:
        """Grade an episode, a transcript (its assistant turns are replayed) or a single assistant turn."""
        episode = attempt if isinstance(attempt, Episode) else self.replay(task, attempt)
        details: dict[str, Any] = {"family": task.meta["family"], "turns": episode.assistant_turns,
                                   "finished": episode.final_answer is not None}
        if episode.error:
            return Verdict(0.0, {**details, "error": episode.error})
        check_task(task)
        expected_conn = open_plain(build_database(task.meta["db"]))
        last_ids = {table: expected_conn.execute(f"SELECT MAX(id) FROM {table}").fetchone()[0] for table in ID_TABLES}
        expected_answer = FAMILIES[task.meta["family"]].apply(expected_conn, task.meta["goal"])
        diff = diff_databases(episode.conn.serialize(), expected_conn.serialize(), last_ids)
        details.update(diff)
        ok = not diff["missing_rows"] and not diff["unexpected_rows"]
        if expected_answer is not None:
            answer = parse_number(episode.final_answer)
            details.update(answer=answer, expected_answer=expected_answer)
            ok = ok and answer == expected_answer
        return Verdict(1.0 if ok else 0.0, details)

    def replay(self, task: Task, transcript: list[dict[str, str]] | str) -> Episode:
        """Re-run a transcript's assistant turns on a fresh database; its observations are ignored."""
        if isinstance(transcript, str):
            transcript = [{"role": "assistant", "content": transcript}]
        episode = self.reset(task)
        for turn in transcript:
            if turn.get("role") == "assistant" and not episode.done:
                self.step(episode, turn["content"])
        return episode

    # ---- expert --------------------------------------------------------------------------------

    def solve(self, task: Task) -> list[dict[str, str]]:
        """The expert's transcript, made by really running its tool calls in an episode."""
        session = _Session(self, task)
        FAMILIES[task.meta["family"]].solve(session, task.meta["goal"])
        return session.episode.turns


# ---- tool calls, observations, answers ---------------------------------------------------------


def contents(text: str) -> set[str]:
    """The databases a text states: none of its own. A content here is a whole database
    (`database_key`), and an agent text shows rows of only the one its episode runs on (the
    observations; the expert's traces and corrupted answers copy from them), whose key is the task's
    own and is recorded with it. Rows out of context cannot name a database: they recur across many."""
    return set()


def check_task(task: Task) -> None:
    """Tasks may come from users' files: say which field is wrong instead of failing deep inside."""
    missing = [name for name in ("family", "goal", "db") if name not in task.meta]
    if missing:
        raise ValueError(f"agent task {task.id!r}: meta lacks {missing} (an AgentEnv task carries family, goal, db)")
    if task.meta["family"] not in FAMILIES:
        raise ValueError(f"agent task {task.id!r}: meta.family {task.meta['family']!r} is not one of {sorted(FAMILIES)}")
    db = task.meta["db"]
    if not isinstance(db, dict) or set(db) != {"seed", "n_products", "n_customers", "n_orders"}:
        raise ValueError(f"agent task {task.id!r}: bad meta.db {db!r}: needs seed, n_products, n_customers, n_orders")
    try:
        db_spec(**db)
    except (TypeError, ValueError) as error:
        raise ValueError(f"agent task {task.id!r}: bad meta.db {db!r}: {error}") from error


class ToolCallError(str):
    """A malformed tool call, reported back to the model as an observation."""


def find_tool_call(answer: str) -> str | ToolCallError | None:
    """The SQL inside the answer's one tool call; None for a final answer."""
    opens, closes = answer.count(TOOL_CALL_OPEN), answer.count(TOOL_CALL_CLOSE)
    if opens == closes == 0:
        return None
    if opens != 1 or closes != 1 or answer.index(TOOL_CALL_OPEN) > answer.index(TOOL_CALL_CLOSE):
        return ToolCallError(f"write exactly one {TOOL_CALL_OPEN}...{TOOL_CALL_CLOSE} per turn")
    return answer.split(TOOL_CALL_OPEN, 1)[1].split(TOOL_CALL_CLOSE, 1)[0].strip()


def _explain(error: sqlite3.Error) -> str:
    if str(error) == "interrupted":
        return "the statement ran too long and was stopped"
    if str(error) in ("not authorized", "authorization denied"):
        return "not authorized (only SELECT, INSERT, UPDATE and DELETE on the task's tables are allowed)"
    return str(error)


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bytes):
        return f"<blob of {len(value)} bytes>"
    text = str(value)
    return text if len(text) <= 200 else text[:200] + "…"


def parse_rows(observation: str | None) -> list[list[str]]:
    """The rows of a result observation (header and footer dropped)."""
    if observation is None or observation.startswith(("error:", "OK,")):
        raise ValueError(f"expected rows, got observation {observation!r}")
    return [line.split(" | ") for line in observation.splitlines()[1:-1]]


def parse_number(answer: str | None) -> int | None:
    """The final answer as an integer: the number alone, '$' and thousands separators allowed."""
    if answer is None:
        return None
    text = answer.strip().removeprefix("$").replace(",", "").removesuffix(".")
    return int(text) if re.fullmatch(r"-?\d+", text) else None


def database_key(spec: dict[str, int]) -> str:
    """The split key of every task on this database: the hash of its rows, not of the spec that made them."""
    return content_hash(json.dumps(database_rows(spec)))


def task_identity(content: dict[str, Any]) -> str:
    """One task's identity (question and database), for its id and to draw no task twice in a sample."""
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def diff_databases(actual: bytes, expected: bytes, last_ids: dict[str, int]) -> dict[str, Any]:
    """Rows expected but absent, and rows present but not expected, over all tables.

    Rows that existed at the start are matched whole: their primary keys make them unique, so
    SQL's EXCEPT is exact. New rows' ids are the database's choice, so a new row (id above the
    initial largest, `last_ids`) is matched without its id, as a multiset.
    """
    conn = open_plain(actual)
    conn.execute("ATTACH ':memory:' AS expected")
    conn.deserialize(expected, name="expected")
    missing, unexpected = [], []
    for table in TABLES:
        old = f"WHERE id <= {last_ids[table]}" if table in last_ids else ""
        missing += _rows_only_in(conn, "expected", "main", table, old)
        unexpected += _rows_only_in(conn, "main", "expected", table, old)
        if table in last_ids:
            want, have = (Counter(row[1:] for row in conn.execute(
                f"SELECT * FROM {schema}.{table} WHERE id > {last_ids[table]}")) for schema in ("expected", "main"))
            missing += [[table, None, *row] for row in (want - have).elements()]
            unexpected += [[table, None, *row] for row in (have - want).elements()]
    conn.close()
    return {"missing_rows": len(missing), "unexpected_rows": len(unexpected),
            "diff_examples": {"missing": missing[:3], "unexpected": unexpected[:3]}}


def _rows_only_in(conn: sqlite3.Connection, schema: str, other: str, table: str, where: str) -> list[list[Any]]:
    query = f"SELECT * FROM {schema}.{table} {where} EXCEPT SELECT * FROM {other}.{table} {where}"
    return [[table, *row] for row in conn.execute(query)]


def sql_list(values: list[Any]) -> str:
    return ", ".join(f"'{v}'" if isinstance(v, str) else str(v) for v in values)


def spoken_list(values: list[str], quote: str = "'") -> str:
    quoted = [f"{quote}{v}{quote}" for v in values]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"


# ---- the expert's session ----------------------------------------------------------------------


class _Session:
    """The expert talking to a real episode: each call is stepped and its observation parsed back."""

    def __init__(self, env: AgentEnv, task: Task):
        self.env, self.effort = env, task.effort
        self.episode = env.reset(task)

    def query(self, think: str, sql: str) -> list[list[str]]:
        observation, _ = self.env.step(self.episode, f"<think>{think}</think>{TOOL_CALL_OPEN}{sql}{TOOL_CALL_CLOSE}")
        return parse_rows(observation)

    def write(self, think: str, sql: str) -> None:
        observation, _ = self.env.step(self.episode, f"<think>{think}</think>{TOOL_CALL_OPEN}{sql}{TOOL_CALL_CLOSE}")
        if not (observation or "").startswith("OK,"):
            raise RuntimeError(f"expert write failed: {sql!r} -> {observation!r}")

    def finish(self, think: str, answer: Any) -> None:
        self.env.step(self.episode, f"<think>{think}</think>{answer}")

    def think(self, low: str = "", high: str = "", max: str = "", lead: str = "") -> str:
        """The scratchpad for this effort: at max `lead` comes before `high` and `max` after it;
        low is short or empty."""
        return {"low": low, "high": high, "max": " ".join(t for t in (lead, high, max) if t)}[self.effort]


# ---- task families -------------------------------------------------------------------------------
# Each family: make(rng, conn, lookups) -> goal or None (this database does not fit);
# prompt(goal) -> str; apply(conn, goal) -> the answer for questions, else None after
# writing the intended change; solve(session, goal) plays the expert's episode.


@dataclass(frozen=True)
class Family:
    make: Callable[[random.Random, sqlite3.Connection, int], dict[str, Any] | None]
    prompt: Callable[[dict[str, Any]], str]
    apply: Callable[[sqlite3.Connection, dict[str, Any]], int | None]
    solve: Callable[[_Session, dict[str, Any]], None]


def _make_order_total(rng: random.Random, conn: sqlite3.Connection, lookups: int) -> dict[str, Any]:
    names = [name for (name,) in conn.execute(
        "SELECT name FROM customers WHERE id IN (SELECT customer_id FROM orders) ORDER BY id")]
    return {"customers": rng.sample(names, min(lookups, len(names)))}


def _prompt_order_total(goal: dict[str, Any]) -> str:
    who = spoken_list(goal["customers"])
    together = " together" if len(goal["customers"]) > 1 else ""
    return (f"What is the total value (quantity times unit price, summed over all orders) of the orders "
            f"placed by {'customers' if together else 'customer'} {who}{together}? Answer with the number only.")


def _apply_order_total(conn: sqlite3.Connection, goal: dict[str, Any]) -> int:
    return conn.execute(
        "SELECT SUM(o.quantity * o.unit_price) FROM orders o JOIN customers c ON c.id = o.customer_id "
        f"WHERE c.name IN ({sql_list(goal['customers'])})").fetchone()[0]


def _solve_order_total(s: _Session, goal: dict[str, Any]) -> None:
    names = sql_list(goal["customers"])
    if s.effort == "low":
        rows = s.query("", "SELECT SUM(o.quantity * o.unit_price) FROM orders o JOIN customers c "
                           f"ON c.id = o.customer_id WHERE c.name IN ({names})")
        return s.finish("", rows[0][0])
    ids = [row[0] for row in s.query(
        f"I need the id of each customer ({names}), then the sum of quantity × unit_price over their orders.",
        f"SELECT id, name FROM customers WHERE name IN ({names})")]
    id_list = ", ".join(ids)
    total_sql = f"SELECT SUM(quantity * unit_price) FROM orders WHERE customer_id IN ({id_list})"
    if s.effort == "high":
        total = s.query(f"The customer ids are {id_list}. Now I sum their orders.", total_sql)[0][0]
        return s.finish(f"The orders add up to {total}.", total)
    lines = s.query(f"The customer ids are {id_list}. I will list every order and add them up myself, "
                    "then check the sum with SQL.",
                    f"SELECT id, quantity, unit_price FROM orders WHERE customer_id IN ({id_list}) ORDER BY id")
    running, steps = 0, []
    for order_id, quantity, price in lines:
        running += int(quantity) * int(price)
        steps.append(f"order {order_id}: {quantity} × {price} = {int(quantity) * int(price)}; running total {running}.")
    total = s.query("\n".join([*steps, f"By hand the total is {running}. Let me confirm with SQL."]), total_sql)[0][0]
    verdict = "they agree" if int(total) == running else "they differ, so I trust the SQL sum"
    s.finish(f"SQL gives {total} and my sum gives {running}: {verdict}. The answer is {total}.", total)


def _make_order_count(rng: random.Random, conn: sqlite3.Connection, lookups: int) -> dict[str, Any]:
    ids = [cid for (cid,) in conn.execute("SELECT DISTINCT customer_id FROM orders ORDER BY customer_id")]
    return {"customer_ids": sorted(rng.sample(ids, min(lookups, len(ids))))}


def _prompt_order_count(goal: dict[str, Any]) -> str:
    ids = [f"#{cid}" for cid in goal["customer_ids"]]
    who = f"customer {ids[0]}" if len(ids) == 1 else f"customers {spoken_list(ids, quote='')} together"
    return f"How many orders were placed by {who}? Answer with the number only."


def _apply_order_count(conn: sqlite3.Connection, goal: dict[str, Any]) -> int:
    return conn.execute(
        f"SELECT COUNT(*) FROM orders WHERE customer_id IN ({sql_list(goal['customer_ids'])})").fetchone()[0]


def _solve_order_count(s: _Session, goal: dict[str, Any]) -> None:
    ids = sql_list(goal["customer_ids"])
    # The max sentence goes before the ids, not between them and the SQL that copies them: placed
    # after, the tiny teacher's SQL named another customer (agent-max 0.29 against high 0.92).
    count = s.query(s.think(high=f"I count the orders with customer_id in ({ids}).",
                            lead="COUNT(*) gives the number of rows, so no listing is needed."),
                    f"SELECT COUNT(*) FROM orders WHERE customer_id IN ({ids})")[0][0]
    s.finish(s.think(high=f"There are {count} such orders.", max=f"The answer is {count}."), count)


ORDER_DIFF_DRAWS = 200


def _make_order_diff(rng: random.Random, conn: sqlite3.Connection, lookups: int) -> dict[str, Any] | None:
    """A customer with at most nine orders against `lookups` others who together placed fewer.
    Many draws per database: of four customers drawn at random few qualify, and with 20 draws only
    13% of the tasks of `max_lookups: 3` compared four customers (28% with 200)."""
    counts = dict(conn.execute("SELECT customer_id, COUNT(*) FROM orders GROUP BY customer_id"))
    for _ in range(ORDER_DIFF_DRAWS):
        chosen = sorted(rng.sample(sorted(counts), lookups + 1), key=counts.get, reverse=True)
        more, fewer = chosen[0], chosen[1:]
        if sum(counts[c] for c in fewer) < counts[more] <= 9:
            return {"more": more, "fewer": fewer}
    return None


def _prompt_order_diff(goal: dict[str, Any]) -> str:
    others = [f"#{c}" for c in goal["fewer"]]
    than = f"customer {others[0]}" if len(others) == 1 else f"customers {spoken_list(others, quote='')} together"
    return f"How many more orders did customer #{goal['more']} place than {than}? Answer with the number only."


def _apply_order_diff(conn: sqlite3.Connection, goal: dict[str, Any]) -> int:
    count = "SELECT COUNT(*) FROM orders WHERE customer_id = ?"
    more = conn.execute(count, (goal["more"],)).fetchone()[0]
    return more - sum(conn.execute(count, (c,)).fetchone()[0] for c in goal["fewer"])


def _solve_order_diff(s: _Session, goal: dict[str, Any]) -> None:
    """One query counts every customer's orders, the largest count first; then one-digit
    subtractions, one line each: all done in the head at low, the first written out at high (the
    rest in the head), every one written out at max.

    When high wrote only a lone subtraction, the tiny base scored the same at low and high (0.26 /
    0.25 on 256 tasks): writing one subtraction did not help, keeping two or more in the head is
    what fails. So each effort leaves a different number in the head (all, all but one, none):
    this is where effort pays in the agent domain. One query, not a COUNT per
    customer: with two, the tiny base lost track at low effort of whom it had already counted (it
    asked for the same customer again in 44 of 64 samples).
    """
    ids = [goal["more"], *goal["fewer"]]
    rows = s.query(s.think(high=f"I count the orders of {spoken_list([f'#{c}' for c in ids], quote='')}, "
                                "the largest count first.",
                           lead="GROUP BY gives all the counts in one query."),
                   f"SELECT customer_id, COUNT(*) FROM orders WHERE customer_id IN ({sql_list(ids)}) "
                   "GROUP BY customer_id ORDER BY COUNT(*) DESC")
    counts = [int(count) for _, count in rows]
    lines, left = [], counts[0]
    for count in counts[1:]:
        lines.append(f"{left}-{count}={left - count}")
        left -= count
    work = "\n".join(lines)
    placed = spoken_list([f"#{customer} placed {count}" for customer, count in rows], quote="")
    first_step = lines[0] if s.effort == "high" else ""  # max writes them all after the lead
    s.finish(s.think(high=first_step, max=work, lead=f"{placed}."), left)


FACTOR_WORDS = {2: "twice", 3: "three times"}


def _make_set_price(rng: random.Random, conn: sqlite3.Connection, lookups: int) -> dict[str, Any] | None:
    prices = dict(conn.execute("SELECT name, price FROM products ORDER BY id"))
    target, *sources = rng.sample(sorted(prices), lookups + 1)
    factor = rng.choice(sorted(FACTOR_WORDS))
    if factor * sum(prices[name] for name in sources) == prices[target]:
        return None  # doing nothing would already be right
    return {"target": target, "sources": sources, "factor": factor}


def _prompt_set_price(goal: dict[str, Any]) -> str:
    sources = goal["sources"]
    of_what = f"the price of '{sources[0]}'" if len(sources) == 1 else f"the combined price of {spoken_list(sources)}"
    return f"Set the price of '{goal['target']}' to {FACTOR_WORDS[goal['factor']]} {of_what}."


def _apply_set_price(conn: sqlite3.Connection, goal: dict[str, Any]) -> None:
    total = conn.execute(f"SELECT SUM(price) FROM products WHERE name IN ({sql_list(goal['sources'])})").fetchone()[0]
    conn.execute("UPDATE products SET price = ? WHERE name = ?", (goal["factor"] * total, goal["target"]))


def _solve_set_price(s: _Session, goal: dict[str, Any]) -> None:
    target, factor, sources = goal["target"], goal["factor"], sql_list(goal["sources"])
    if s.effort == "low":
        s.write("", f"UPDATE products SET price = {factor} * (SELECT SUM(price) FROM products "
                    f"WHERE name IN ({sources})) WHERE name = '{target}'")
        return s.finish("", "Done.")
    rows = s.query(s.think(high=f"First I read the price of {sources}.",
                           max=f"Then the new price of '{target}' is {factor} × their sum; "
                               "I will check the write afterwards."),
                   f"SELECT name, price FROM products WHERE name IN ({sources})")
    total = sum(int(price) for _, price in rows)
    new_price = factor * total
    sum_text = " + ".join(price for _, price in rows)
    s.write(s.think(high=f"Their price sum is {total}, so '{target}' must cost {factor} × {total} = {new_price}.",
                    max=f"Spelled out: {sum_text} = {total}; {factor} × {total} = {new_price}."),
            f"UPDATE products SET price = {new_price} WHERE name = '{target}'")
    if s.effort == "max":
        s.query("One row should have changed. Let me read it back.",
                f"SELECT name, price FROM products WHERE name = '{target}'")
    s.finish(s.think(high="The update is done.", max=f"It reads back {new_price}, as intended."),
             f"Done: '{target}' now costs {new_price}.")


def _make_move_stock(rng: random.Random, conn: sqlite3.Connection, lookups: int) -> dict[str, Any] | None:
    categories = rng.sample(sorted(ITEMS_BY_CATEGORY), lookups)
    cheapest = [_unique_cheapest(conn, category) for category in categories]
    if None in cheapest:
        return None
    quantity = rng.randint(1, 20)
    sources = [w for w in WAREHOUSES if all(_stock(conn, product, w) > quantity for product in cheapest)]
    if not sources:
        return None
    source = rng.choice(sources)
    target = rng.choice([w for w in WAREHOUSES if w != source])
    return {"categories": categories, "quantity": quantity, "source": source, "target": target}


def _unique_cheapest(conn: sqlite3.Connection, category: str) -> int | None:
    rows = conn.execute("SELECT id, price FROM products WHERE category = ? ORDER BY price, id LIMIT 2",
                        (category,)).fetchall()
    if not rows or (len(rows) == 2 and rows[0][1] == rows[1][1]):
        return None
    return rows[0][0]


def _stock(conn: sqlite3.Connection, product_id: int, warehouse: str) -> int:
    row = conn.execute("SELECT quantity FROM inventory WHERE product_id = ? AND warehouse = ?",
                       (product_id, warehouse)).fetchone()
    return row[0] if row else 0


def _prompt_move_stock(goal: dict[str, Any]) -> str:
    categories = goal["categories"]
    which = (f"in category '{categories[0]}'" if len(categories) == 1
             else f"in each of the categories {spoken_list(categories)}")
    return (f"Move {goal['quantity']} units of the cheapest product {which} from warehouse "
            f"'{goal['source']}' to warehouse '{goal['target']}'.")


def _apply_move_stock(conn: sqlite3.Connection, goal: dict[str, Any]) -> None:
    for category in goal["categories"]:
        product = _unique_cheapest(conn, category)
        conn.execute("UPDATE inventory SET quantity = quantity - ? WHERE product_id = ? AND warehouse = ?",
                     (goal["quantity"], product, goal["source"]))
        conn.execute("INSERT INTO inventory VALUES (?, ?, ?) ON CONFLICT (product_id, warehouse) "
                     "DO UPDATE SET quantity = quantity + excluded.quantity", (product, goal["target"], goal["quantity"]))


def _solve_move_stock(s: _Session, goal: dict[str, Any]) -> None:
    n, source, target = goal["quantity"], goal["source"], goal["target"]
    if s.effort == "low":
        for category in goal["categories"]:
            (product,), = s.query("", f"SELECT id FROM products WHERE category = '{category}' ORDER BY price LIMIT 1")
            s.write("", f"UPDATE inventory SET quantity = quantity - {n} WHERE product_id = {product} "
                        f"AND warehouse = '{source}'")
            s.write("", f"INSERT INTO inventory (product_id, warehouse, quantity) VALUES ({product}, '{target}', {n}) "
                        "ON CONFLICT (product_id, warehouse) DO UPDATE SET quantity = quantity + excluded.quantity")
        return s.finish("", "Done.")
    cheapest, note = {}, s.think(
        high="For each category I find the two cheapest products: the cheapest one moves, and the second "
             "shows it is unique.",
        max=f"Then I check their stock in '{source}' and '{target}', move {n} units with one write per "
            "warehouse, and read the stock back at the end.")
    for category in goal["categories"]:
        rows = s.query(note, f"SELECT id, name, price FROM products WHERE category = '{category}' "
                             "ORDER BY price LIMIT 2")
        (product, name, price), runner_up = rows[0], rows[1:]
        cheapest[category] = product
        note = s.think(high=f"In '{category}' the cheapest is '{name}' (id {product}) at {price}.",
                       max=f"The next one costs {runner_up[0][2]}, more than {price}." if runner_up else "")
    ids = ", ".join(cheapest.values())
    stock_rows = s.query(f"{note} Now the stock of {ids}.",
                         f"SELECT product_id, warehouse, quantity FROM inventory WHERE product_id IN ({ids}) "
                         "ORDER BY product_id, warehouse")
    stock = {(product, warehouse): int(quantity) for product, warehouse, quantity in stock_rows}
    for product in cheapest.values():
        have = stock[(product, source)]
        s.write(s.think(high=f"Product {product} has {have} in '{source}', enough to take {n}.",
                        max=f"That leaves {have} - {n} = {have - n}."),
                f"UPDATE inventory SET quantity = quantity - {n} WHERE product_id = {product} AND warehouse = '{source}'")
        if (product, target) in stock:
            there = stock[(product, target)]
            s.write(s.think(high=f"'{target}' already holds {there} of product {product}; I add {n}.",
                            max=f"It will hold {there} + {n} = {there + n}."),
                    f"UPDATE inventory SET quantity = quantity + {n} WHERE product_id = {product} "
                    f"AND warehouse = '{target}'")
        else:
            s.write(s.think(high=f"'{target}' has no row for product {product} yet, so I insert one with {n} units."),
                    f"INSERT INTO inventory (product_id, warehouse, quantity) VALUES ({product}, '{target}', {n})")
    if s.effort == "max":
        s.query("Let me read the stock back to check both warehouses.",
                f"SELECT product_id, warehouse, quantity FROM inventory WHERE product_id IN ({ids}) "
                "ORDER BY product_id, warehouse")
    s.finish(s.think(high="All units are moved."), f"Done: moved {n} units from '{source}' to '{target}'.")


def _make_place_order(rng: random.Random, conn: sqlite3.Connection, lookups: int) -> dict[str, Any] | None:
    warehouse = rng.choice(WAREHOUSES)
    stocked = [(name, quantity) for name, quantity in conn.execute(
        "SELECT p.name, i.quantity FROM inventory i JOIN products p ON p.id = i.product_id "
        "WHERE i.warehouse = ? AND i.quantity >= 1 ORDER BY p.id", (warehouse,))]
    if len(stocked) < lookups:
        return None
    customer = rng.choice([name for (name,) in conn.execute("SELECT name FROM customers ORDER BY id")])
    lines = [[name, rng.randint(1, min(9, quantity))] for name, quantity in rng.sample(stocked, lookups)]
    return {"customer": customer, "warehouse": warehouse, "lines": lines}


def _prompt_place_order(goal: dict[str, Any]) -> str:
    items = [f"{quantity} × '{name}'" for name, quantity in goal["lines"]]
    listed = items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
    return (f"Customer '{goal['customer']}' buys {listed} from warehouse '{goal['warehouse']}'. Record one "
            "new order per product at the product's current price, and take the units out of that "
            "warehouse's stock.")


def _apply_place_order(conn: sqlite3.Connection, goal: dict[str, Any]) -> None:
    for name, quantity in goal["lines"]:
        conn.execute("INSERT INTO orders (customer_id, product_id, quantity, unit_price) "
                     "SELECT c.id, p.id, ?, p.price FROM customers c, products p WHERE c.name = ? AND p.name = ?",
                     (quantity, goal["customer"], name))
        conn.execute("UPDATE inventory SET quantity = quantity - ? WHERE warehouse = ? AND product_id = "
                     "(SELECT id FROM products WHERE name = ?)", (quantity, goal["warehouse"], name))


def _solve_place_order(s: _Session, goal: dict[str, Any]) -> None:
    customer, warehouse, lines = goal["customer"], goal["warehouse"], goal["lines"]
    if s.effort == "low":
        for name, quantity in lines:
            s.write("", "INSERT INTO orders (customer_id, product_id, quantity, unit_price) SELECT c.id, p.id, "
                        f"{quantity}, p.price FROM customers c, products p WHERE c.name = '{customer}' "
                        f"AND p.name = '{name}'")
            s.write("", f"UPDATE inventory SET quantity = quantity - {quantity} WHERE warehouse = '{warehouse}' "
                        f"AND product_id = (SELECT id FROM products WHERE name = '{name}')")
        return s.finish("", "Done.")
    (customer_id,), = s.query(s.think(high="I need the customer's id, then each product's id and current price.",
                                      max=f"I will also check the stock in '{warehouse}' before writing, and "
                                          "read everything back at the end."),
                              f"SELECT id FROM customers WHERE name = '{customer}'")
    names = sql_list([name for name, _ in lines])
    products = {name: (product, price) for product, name, price in s.query(
        f"'{customer}' has id {customer_id}.", f"SELECT id, name, price FROM products WHERE name IN ({names})")}
    ids = ", ".join(product for product, _ in products.values())
    if s.effort == "max":
        stock = s.query("Now the stock of these products in the warehouse.",
                        f"SELECT product_id, quantity FROM inventory WHERE warehouse = '{warehouse}' "
                        f"AND product_id IN ({ids})")
        have = dict(stock)
        checks = [f"'{name}' (id {products[name][0]}): {have[products[name][0]]} in stock, {quantity} needed."
                  for name, quantity in lines]
    else:
        checks = []
    values = ", ".join(f"({customer_id}, {products[name][0]}, {quantity}, {products[name][1]})"
                       for name, quantity in lines)
    prices = " ".join(f"'{name}' is id {products[name][0]} at {products[name][1]}." for name, _ in lines)
    s.write(" ".join([prices, *checks, "I record one order row per product."]),
            f"INSERT INTO orders (customer_id, product_id, quantity, unit_price) VALUES {values}")
    for name, quantity in lines:
        s.write(s.think(high=f"Take {quantity} of '{name}' out of '{warehouse}'."),
                f"UPDATE inventory SET quantity = quantity - {quantity} WHERE warehouse = '{warehouse}' "
                f"AND product_id = {products[name][0]}")
    if s.effort == "max":
        s.query("Let me read the new orders back.",
                f"SELECT customer_id, product_id, quantity, unit_price FROM orders WHERE customer_id = {customer_id} "
                f"AND product_id IN ({ids}) ORDER BY id DESC LIMIT {len(lines)}")
    s.finish(s.think(high="The orders are recorded and the stock is updated."),
             f"Done: recorded {len(lines)} order(s) for '{customer}'.")


FAMILIES: dict[str, Family] = {
    "order_total": Family(_make_order_total, _prompt_order_total, _apply_order_total, _solve_order_total),
    "order_count": Family(_make_order_count, _prompt_order_count, _apply_order_count, _solve_order_count),
    "order_diff": Family(_make_order_diff, _prompt_order_diff, _apply_order_diff, _solve_order_diff),
    "set_price": Family(_make_set_price, _prompt_set_price, _apply_set_price, _solve_set_price),
    "move_stock": Family(_make_move_stock, _prompt_move_stock, _apply_move_stock, _solve_move_stock),
    "place_order": Family(_make_place_order, _prompt_place_order, _apply_place_order, _solve_place_order),
}
