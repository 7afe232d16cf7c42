"""The agent's checks and keys: a task's meta, its split key (`database_key`), its identity, the
texts' contents, and the row diff between an episode's database and the verifier's."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections import Counter
from typing import Any

from mopd.envs.agent.database import TABLES, database_rows, db_spec, open_plain
from mopd.envs.agent.families import FAMILIES
from mopd.envs.agent.scaffolds import SCAFFOLDS, scaffold_of
from mopd.envs.base import Task
from mopd.envs.splits import content_hash


def contents(text: str) -> set[str]:
    """The scaffolds a text states (`scaffold_key`), each by its tool's name, and no database of its
    own. A database content is a whole database (`database_key`), and an agent text shows rows of only
    the one its episode runs on (the observations; the expert's traces and corrupted answers copy from
    them), whose key is the task's own and is recorded with it. Rows out of context cannot name a
    database: they recur across many. A scaffold's key is of its split, so a text in a held-out
    scaffold is not trainable (`mopd.envs.splits.trainable`)."""
    return {scaffold.key for scaffold in SCAFFOLDS if scaffold.tool in text}


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
    check_scaffold(task)


def check_scaffold(task: Task) -> None:
    """A recorded scaffold is a known one, and the role its observations are rendered in is its own."""
    try:
        scaffold = scaffold_of(task.meta)
    except ValueError as error:
        raise ValueError(f"agent task {task.id!r}: {error}") from None
    role = task.meta.get("observation_role", "observation")
    if role != scaffold.role:
        raise ValueError(f"agent task {task.id!r}: meta.observation_role {role!r} is not scaffold "
                         f"{scaffold.name!r}'s {scaffold.role!r}")


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
