"""Scaffolds: the harness an agent works in, as data.

A scaffold names the tool and its SQL argument, the call syntax (`tags` around the SQL, a `json`
call object `{"name": …, "arguments": {…}}`, bare or inside wrapper tags, or a `function`-call
line `tool(argument="…")`), the system prompt's wording (full and short), the observation format
(`pipe`, `csv` or `json` rows), the wording of errors and of a write's result, and the role its
observations take in the chat template (`observation`, or `user` as a harness that feeds tool
results back as the user's turn).

`mopd` is today's harness, byte for byte; the others are styles named after harnesses of their
kind, none a copy of its namesake. The verifier is the database's end state whatever the scaffold.

Scaffolds split like tasks (`mopd.envs.splits`): a scaffold's key is the hash of its name
(`scaffold_key`), and `split_of(key)` puts it in train, dev or test, whatever the seeds. Train tasks
(what training draws) take train scaffolds only; `heldout` asks dev tasks in the dev scaffolds and
test tasks in the test ones (`pool`). The
tool name is distinctive (`Scaffold.tool`): a text that names it states that scaffold, which the
trained-text audit checks (`mopd.envs.agent.verify.contents`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from mopd.envs.agent.harness import Scaffold

FIXED, ROTATE, HELDOUT = "fixed", "rotate", "heldout"
MODES = (FIXED, ROTATE, HELDOUT)

MOPD = Scaffold(
    name="mopd", tool="tool_call", argument="sql", syntax="tags", rows="pipe",
    system={
        "full": """\
You are a database agent working on a SQLite database with these tables (prices in whole dollars):
{schema}
Work in turns. In each turn think inside <think>...</think>, then either call the tool or give your final answer.
To call the tool, write exactly one SQL statement inside <tool_call>...</tool_call>, for example:
{example}
The result comes back as an observation: column names and rows with cells separated by " | " (at most {max_rows} rows), "OK, N rows changed" after a write, or "error: ...".
Only SELECT, INSERT, UPDATE and DELETE on these tables are allowed; every write is saved at once. Leave the ids of new rows to the database.
A turn without a tool call is your final answer and ends the episode. When asked a question, answer with the number alone. You have at most {max_turns} turns.""",
        # The same protocol without the schema or the examples, for models that learn the tables from
        # their training transcripts: about a sixth of the tokens, which a tiny model pays on every turn.
        "short": """\
SQLite shop database (customers, products, orders, inventory). Each turn: <think>...</think>, then one SQL statement in <tool_call>...</tool_call>, or the final answer (a question's answer is the number alone). At most {max_turns} turns.""",
    },
    changed="OK, {n} row{s} changed", error="error: {message}",
    malformed="write exactly one <tool_call>...</tool_call> per turn", empty="the tool call is empty",
)

SCAFFOLDS: tuple[Scaffold, ...] = (
    MOPD,
    Scaffold(
        name="hermes", tool="run_sql", argument="query", syntax="json", wrap="function_call", rows="json",
        system={
            "full": """\
You are a function-calling assistant with one function, run_sql, over this SQLite schema (prices are whole dollars):
{schema}
Reason inside <think>...</think> first. To use the function, reply with a JSON object inside <function_call></function_call> tags:
{example}
The function answers with a JSON object {"columns": [...], "rows": [[...]], "more": false} (at most {max_rows} rows), {"rows_changed": N} for a write, or {"error": "..."}.
Use one SQL statement per call: SELECT, INSERT, UPDATE or DELETE. Writes are committed immediately; never set ids of new rows yourself.
Reply without a function call to give the final answer; for a question, the number only. {max_turns} replies at most.""",
            "short": """\
Function run_sql(query) runs one SQL statement on a SQLite shop database (customers, products, orders, inventory). Reply with <think>...</think> then either <function_call>{"name": "run_sql", "arguments": {"query": "..."}}</function_call> or the final answer (a number alone for a question). {max_turns} replies at most.""",
        },
        changed='{"rows_changed": {n}}', error='{"error": "{message}"}',
        malformed='expected one <function_call>{"name": "run_sql", "arguments": {"query": "..."}}</function_call>',
        empty="run_sql got an empty query",
    ),
    Scaffold(
        name="codex", tool="sqlite3_exec", argument="statement", syntax="json", rows="csv", role="user",
        system={
            "full": """\
You operate a SQLite database through the tool sqlite3_exec. Schema (all prices in dollars, integers):
{schema}
Every reply starts with <think>...</think>. To run a statement, the rest of the reply is a single JSON object and nothing else:
{example}
Results come back as CSV: a header line, up to {max_rows} rows, and a "# N rows" line; writes report "Done: N rows affected."; failures start with "Error:".
Statements allowed: SELECT, INSERT, UPDATE, DELETE on the tables above, each saved as soon as it runs. New rows get their ids from the database.
When you are done, reply with the final answer instead of a JSON object (the number alone for a question). Limit: {max_turns} replies.""",
            "short": """\
Tool sqlite3_exec over a SQLite shop (customers, products, orders, inventory), results as CSV. Reply <think>...</think> then either {"name": "sqlite3_exec", "arguments": {"statement": "<one SQL statement>"}} or the final answer (a question: the number only). Limit: {max_turns} replies.""",
        },
        changed="Done: {n} row{s} affected.", error="Error: {message}",
        malformed='could not parse the function call: reply with one JSON object {"name": "sqlite3_exec", "arguments": {"statement": "..."}}',
        empty="sqlite3_exec needs a statement",
    ),
    Scaffold(
        name="claude-code", tool="execute_sql", argument="sql", syntax="tags", rows="csv",
        system={
            "full": """\
You have access to a SQLite database (whole-dollar prices) with the following schema:
{schema}
Think step by step inside <think>...</think> before acting. To run SQL, use the execute_sql tool by writing one statement between its tags:
{example}
You will receive the result as CSV (header, then at most {max_rows} rows, then "# N rows"), "Query OK, N rows affected" for writes, or "Tool error: ..." on failure.
Only SELECT, INSERT, UPDATE and DELETE are permitted. Changes persist immediately. Let the database assign ids to inserted rows.
Respond without the tool to finish; answer questions with just the number. You may respond at most {max_turns} times.""",
            "short": """\
SQLite shop DB (customers, products, orders, inventory). Think in <think>...</think>, then run one statement as <execute_sql>...</execute_sql> or give the final answer (just the number for a question). At most {max_turns} responses.""",
        },
        changed="Query OK, {n} row{s} affected", error="Tool error: {message}",
        malformed="use exactly one <execute_sql>...</execute_sql> block per response", empty="execute_sql received no SQL",
    ),
    Scaffold(
        name="openclaw", tool="sql_query", argument="query", syntax="function", rows="pipe", role="user",
        system={
            "full": """\
Agent mode. Database: SQLite, these tables, money in whole dollars:
{schema}
Each step: reasoning in <think>...</think>, then one action line calling sql_query, e.g.
{example}
Action results: a table with " | " between cells (max {max_rows} rows), "N rows updated" for writes, "[tool error] ..." when something fails.
sql_query accepts a single SELECT, INSERT, UPDATE or DELETE; writes apply at once; new ids come from the database.
A step without an action line ends the task with your final answer (for questions, only the number). Max {max_turns} steps.""",
            "short": """\
SQLite shop (customers, products, orders, inventory). Each step: <think>...</think>, then either the action sql_query(query="<one SQL statement>") or the final answer (number alone for a question). Max {max_turns} steps.""",
        },
        changed="{n} row{s} updated", error="[tool error] {message}",
        malformed='call the tool as sql_query(query="<one SQL statement>")', empty="sql_query: the query is empty",
    ),
    Scaffold(
        name="smolagents", tool="query_db", argument="sql_code", syntax="function", rows="csv",
        system={
            "full": """\
You are an expert assistant who solves tasks with one tool, query_db, on a SQLite database. Tables (prices: integer dollars):
{schema}
Cycle: Thought inside <think>...</think>, then Action as a Python call on its own, like
{example}
Observation: CSV with a header row, at most {max_rows} data rows and a "# N rows" footer; "Statement OK (N rows modified)" after changes; "Error executing tool: ..." on failure.
query_db runs one SELECT, INSERT, UPDATE or DELETE. Modifications are permanent at once. Never choose the id of a new row.
To end, write the final answer with no Action (only the number if it is a question). You get {max_turns} cycles.""",
            "short": """\
Tool query_db over a SQLite shop (customers, products, orders, inventory). Cycle: <think>...</think>, then Action query_db(sql_code="<one SQL statement>") or the final answer (only the number for a question). {max_turns} cycles.""",
        },
        changed="Statement OK ({n} row{s} modified)", error="Error executing tool: {message}",
        malformed='Action must be exactly query_db(sql_code="...")', empty="query_db: sql_code is empty",
    ),
    Scaffold(
        name="glaive", tool="database_query", argument="sql", syntax="json", wrap="functioncall", rows="pipe", role="user",
        system={
            "full": """\
SYSTEM: You are a helpful assistant with access to the function database_query (SQLite). The database has (dollar prices as integers):
{schema}
First think in <think>...</think>. Call the function by writing
{example}
The function response lists column names then rows joined by " | " (no more than {max_rows}), or "SUCCESS: N rows changed" for writes, or "ERROR: ..." for failures.
Permitted statements: SELECT, INSERT, UPDATE, DELETE, one per call, saved instantly. Ids of inserted rows are chosen by the database.
Without a function call your message is the final answer; for questions reply with the number only. Up to {max_turns} messages.""",
            "short": """\
Function database_query(sql) on a SQLite shop (customers, products, orders, inventory). Message: <think>...</think>, then <functioncall>{"name": "database_query", "arguments": {"sql": "..."}}</functioncall> or the final answer (number only for questions). Up to {max_turns} messages.""",
        },
        changed="SUCCESS: {n} row{s} changed", error="ERROR: {message}",
        malformed="invalid <functioncall>: expected one JSON object naming database_query with its sql argument",
        empty="database_query: sql is empty",
    ),
    Scaffold(
        name="qwen-agent", tool="run_query", argument="sql", syntax="tags", rows="json", role="user",
        system={
            "full": """\
# Tools
run_query: executes SQL against a SQLite database whose tables are (prices in whole dollars):
{schema}
# Protocol
Put your reasoning in <think>...</think>. To use run_query, put exactly one statement between its tags:
{example}
The tool returns JSON: {"columns": [...], "rows": [[...]], "more": ...} with up to {max_rows} rows, {"status": "ok", "changed": N} after a write, {"status": "error", "detail": "..."} on failure.
Allowed: SELECT, INSERT, UPDATE, DELETE; each write is final immediately; ids of new rows are assigned automatically.
Reply without run_query to give the final answer (questions: the number by itself). At most {max_turns} replies.""",
            "short": """\
# run_query: SQL on a SQLite shop (customers, products, orders, inventory), JSON results. Reply: <think>...</think>, then <run_query>one SQL statement</run_query> or the final answer (questions: the number by itself). At most {max_turns} replies.""",
        },
        changed='{"status": "ok", "changed": {n}}', error='{"status": "error", "detail": "{message}"}',
        malformed="exactly one <run_query>...</run_query> per reply", empty="run_query: no statement given",
    ),
    Scaffold(
        name="functionary", tool="sql_runner", argument="sql_statement", syntax="json", rows="csv",
        system={
            "full": """\
// Available function: sql_runner. It runs a SQLite statement on this schema; prices are whole dollars.
{schema}
// Think first inside <think>...</think>. To call sql_runner, output only the call object:
{example}
// Output of sql_runner: CSV (header, up to {max_rows} rows, "# N rows"); "N rows written" after a write; "Tool failed: ..." otherwise.
// One statement per call: SELECT, INSERT, UPDATE or DELETE, committed at once; new rows' ids are left to the database.
// Output the final answer with no call object to finish (a question's answer is just the number). {max_turns} outputs at most.""",
            "short": """\
// sql_runner: one SQLite statement on a shop database (customers, products, orders, inventory). Output <think>...</think>, then {"name": "sql_runner", "arguments": {"sql_statement": "..."}} or the final answer (just the number for a question). {max_turns} outputs at most.""",
        },
        changed="{n} row{s} written", error="Tool failed: {message}",
        malformed='not a valid sql_runner call: expected {"name": "sql_runner", "arguments": {"sql_statement": "..."}}',
        empty="sql_runner: empty sql_statement",
    ),
)  # fmt: skip
BY_NAME = {scaffold.name: scaffold for scaffold in SCAFFOLDS}


def scaffold_named(name: str, where: str = "scaffold") -> Scaffold:
    if name not in BY_NAME:
        raise ValueError(f"{where}: unknown scaffold {name!r}; known: {sorted(BY_NAME)}")
    return BY_NAME[name]


def of_split(split: str) -> tuple[Scaffold, ...]:
    return tuple(scaffold for scaffold in SCAFFOLDS if scaffold.split == split)


def held_out() -> tuple[Scaffold, ...]:
    return tuple(scaffold for scaffold in SCAFFOLDS if scaffold.split != "train")


def check_choice(choice: str | Sequence[str], where: str = "scaffolds") -> None:
    """`fixed`, `rotate`, `heldout`, or a list of scaffold names; a ValueError naming `where` otherwise."""
    if isinstance(choice, str):
        if choice not in MODES:
            raise ValueError(f"{where}={choice!r}: must be one of {list(MODES)} or a list of scaffold names")
        return
    if not choice:
        raise ValueError(f"{where}: an empty list; name some of {sorted(BY_NAME)}")
    for name in choice:
        scaffold_named(name, where)


def pool(choice: str | Sequence[str], split: str) -> tuple[Scaffold, ...]:
    """The scaffolds a task of `split` draws from: `fixed`, today's alone; `rotate`, the train ones;
    `heldout`, those of the split (dev or test: tuning on dev never sees a test scaffold); or the
    named ones. Train tasks, what every training stage draws, take train scaffolds only."""
    if choice == FIXED:
        return (MOPD,)
    if choice == ROTATE:
        return of_split("train")
    chosen = of_split(split) if choice == HELDOUT else tuple(BY_NAME[name] for name in choice)
    unseen = [scaffold.name for scaffold in chosen if scaffold.split != "train"]
    if split == "train" and (choice == HELDOUT or unseen):
        raise ValueError(f"scaffolds={choice!r}: train tasks (what training draws) take train scaffolds only; "
                         f"held out: {unseen or [s.name for s in held_out()]}")
    return chosen


def draw(choice: str | Sequence[str], split: str, identity: str) -> Scaffold:
    """A task's scaffold, drawn from its pool by the task's identity: the same task gets the same
    scaffold at every effort and in every stage."""
    return random.Random(f"scaffold/{identity}").choice(pool(choice, split))


def scaffold_of(meta: dict[str, Any]) -> Scaffold:
    """The scaffold a task records (`meta["scaffold"]`); today's for a task that records none."""
    return scaffold_named(meta["scaffold"], "meta.scaffold") if "scaffold" in meta else MOPD
