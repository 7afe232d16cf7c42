"""AgentEnv: sampling tasks by split, episodes on a guarded database, snapshots, verification
against the database the verifier writes itself, and the expert's transcripts."""

from __future__ import annotations

import json
import math
import random
import sqlite3
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from mopd.envs.agent.database import (
    ID_TABLES,
    SCHEMA,
    StatementBudget,
    build_database,
    db_spec,
    open_guarded,
    open_plain,
)
from mopd.envs.agent.expert import _Session
from mopd.envs.agent.families import FAMILIES
from mopd.envs.agent.harness import EXAMPLE_SQL, Scaffold, ToolCallError
from mopd.envs.agent.scaffolds import FIXED, MOPD, check_choice, draw, scaffold_of
from mopd.envs.agent.tools import parse_number
from mopd.envs.agent.verify import check_task, database_key, diff_databases, task_identity
from mopd.envs.base import EFFORTS, Task, Verdict, split_thinking
from mopd.envs.chat import strip_turn_end
from mopd.envs.splits import check_split, split_of

SNAPSHOT_MAGIC = b"MOPD-AGENT-1\n"

SYSTEM_PROMPT = MOPD.system["full"].replace("{example}", MOPD.call(EXAMPLE_SQL))
SHORT_SYSTEM_PROMPT = MOPD.system["short"]
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
                 max_statement_seconds: float = 2.0, system_prompt: str = "full",
                 scaffolds: str | list[str] = FIXED, max_answer_share: float | None = None):
        self.families = tuple(families or FAMILIES)
        unknown = [name for name in self.families if name not in FAMILIES]
        if unknown:
            raise ValueError(f"AgentEnv families: unknown {unknown}; known: {sorted(FAMILIES)}")
        if not 1 <= max_lookups <= 3:
            raise ValueError(f"AgentEnv max_lookups={max_lookups}: must be 1, 2 or 3")
        # a cap on the share of a draw's questions with one answer: where one number answers most of them (order_diff:
        # a difference of 1), a policy that always says it scores that share without reading the database
        if max_answer_share is not None and not 0 < max_answer_share <= 1:
            raise ValueError(f"AgentEnv max_answer_share={max_answer_share}: must be in (0, 1], or null for no cap")
        if system_prompt not in SYSTEM_PROMPTS:
            raise ValueError(f"AgentEnv system_prompt={system_prompt!r}: must be one of {sorted(SYSTEM_PROMPTS)}")
        check_choice(scaffolds, "AgentEnv scaffolds")
        db_spec(0, n_products, n_customers, n_orders)  # validates the sizes early
        self.system_prompt = system_prompt
        self.scaffolds = scaffolds
        self.max_lookups = max_lookups
        self.max_answer_share = max_answer_share
        self.sizes = {"n_products": n_products, "n_customers": n_customers, "n_orders": n_orders}
        self.max_turns = max_turns
        self.max_rows, self.max_chars = max_rows, max_chars
        self.max_statement_steps, self.max_statement_seconds = max_statement_steps, max_statement_seconds

    # ---- tasks ---------------------------------------------------------------------------------

    def sample(self, n: int, seed: int, split: str = "train", effort: str = "high") -> list[Task]:
        check_split(split)
        if effort not in EFFORTS:
            raise ValueError(f"effort={effort!r}: must be one of {EFFORTS}")
        tasks, seen, answers = [], set(), Counter()
        for index in range(n):
            # a cap on every prefix of the draw, so that a draw of n is the start of a longer one (the bench takes
            # the first n distinct tasks of a longer draw)
            cap = None if self.max_answer_share is None else math.ceil(self.max_answer_share * (index + 1))
            for attempt in range(1000):
                content = self._generate(random.Random(f"agent/{split}/{seed}/{index}/{attempt}"), split)
                identity = content and task_identity(content)
                answer = question_answer(content) if cap and content else None
                if identity and identity not in seen and not (answer is not None and answers[answer] >= cap):
                    break
            else:
                raise RuntimeError(f"could not generate agent task {index} for seed {seed}; loosen the knobs")
            seen.add(identity)
            answers[answer] += 1
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
        scaffold = draw(self.scaffolds, split, identity)
        system = scaffold.system_prompt(self.system_prompt, SCHEMA, self.max_rows, self.max_turns)
        meta = {**content, "content_hash": database_key(content["db"]), "max_turns": self.max_turns, "system": system,
                **self._drawn(scaffold)}
        return Task(id=f"agent-{split}-{identity[:16]}", domain=self.domain, effort=effort,
                    prompt=family.prompt(content["goal"]), meta=meta)

    def _drawn(self, scaffold: Scaffold) -> dict[str, str]:
        """The scaffold a task records; none under `fixed`, whose tasks stay as they always were."""
        return {} if self.scaffolds == FIXED else {"scaffold": scaffold.name, "observation_role": scaffold.role}

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
        scaffold = scaffold_of(episode.task.meta)
        call = scaffold.find_call(answer)
        if call is None:
            episode.final_answer = answer
            episode.done = True
            return None, True
        observation = self._run_tool(episode, scaffold, call)
        episode.turns.append({"role": scaffold.role, "content": observation})
        episode.done = episode.assistant_turns >= episode.task.meta.get("max_turns", self.max_turns)
        return observation, episode.done

    def _run_tool(self, episode: Episode, scaffold: Scaffold, call: str | ToolCallError) -> str:
        if isinstance(call, ToolCallError):
            return scaffold.error_text(call)
        if not call.strip():
            return scaffold.error_text(scaffold.empty)
        try:
            with episode.budget:
                cursor = episode.conn.execute(call)
                if cursor.description is None:
                    return scaffold.changed_text(cursor.rowcount)
                return self._format_rows(scaffold, cursor)
        except sqlite3.Error as error:
            return scaffold.error_text(explain(error))
        except (OverflowError, ValueError) as error:
            return scaffold.error_text(str(error))

    def _format_rows(self, scaffold: Scaffold, cursor: sqlite3.Cursor) -> str:
        columns = [column[0] for column in cursor.description]
        text = scaffold.rows_text(columns, cursor.fetchmany(self.max_rows + 1), self.max_rows)
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


def question_answer(content: dict[str, Any]) -> int | None:
    """A question task's true answer; None for a task that changes the database."""
    conn = open_plain(build_database(content["db"]))
    try:
        return FAMILIES[content["family"]].apply(conn, content["goal"])
    finally:
        conn.close()


def explain(error: sqlite3.Error) -> str:
    """SQLite's message, in words a model can act on where SQLite's own are cryptic."""
    if str(error) == "interrupted":
        return "the statement ran too long and was stopped"
    if str(error) in ("not authorized", "authorization denied"):
        return "not authorized (only SELECT, INSERT, UPDATE and DELETE on the task's tables are allowed)"
    return str(error)
