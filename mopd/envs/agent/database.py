"""The agent domain's database: schema, deterministic generator, guarded connections.

A database is fully described by a small JSON-serialisable spec (seed and row counts), so a task
carries its database in `task.meta["db"]` and anyone can rebuild the identical bytes.

The connection the model talks to is guarded (`open_guarded`):
- an authorizer allows only reads, row writes to the episode's own tables, deterministic
  functions and a few read-only pragmas; ATTACH (and so VACUUM INTO), schema changes,
  transactions, pragma writes, extensions and time/random functions are refused;
- a progress handler (`StatementBudget`) stops a statement after a budget of VM steps (the same
  on every machine, so episodes stay deterministic), with a wall-clock backstop;
- string/blob size and database page count are capped, so a statement cannot eat the memory.
"""

from __future__ import annotations

import random
import sqlite3
import time
from functools import lru_cache

SCHEMA = """\
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, category TEXT NOT NULL, price INTEGER NOT NULL);
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, city TEXT NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id), product_id INTEGER NOT NULL REFERENCES products(id), quantity INTEGER NOT NULL, unit_price INTEGER NOT NULL);
CREATE TABLE inventory (product_id INTEGER NOT NULL REFERENCES products(id), warehouse TEXT NOT NULL, quantity INTEGER NOT NULL, PRIMARY KEY (product_id, warehouse));"""
TABLES = ("products", "customers", "orders", "inventory")
ID_TABLES = ("products", "customers", "orders")  # keyed by `id INTEGER PRIMARY KEY`

ITEMS_BY_CATEGORY = {
    "fasteners": ("bolt", "nut", "screw", "washer", "rivet", "anchor"),
    "tools": ("hammer", "wrench", "pliers", "saw", "drill", "chisel"),
    "electrical": ("cable", "switch", "fuse", "plug", "socket", "relay"),
    "plumbing": ("pipe", "valve", "tap", "hose", "seal", "elbow"),
    "paint": ("primer", "varnish", "enamel", "stain", "lacquer", "sealant"),
}
QUALIFIERS = ("steel", "brass", "copper", "zinc", "nylon", "oak", "chrome", "titan", "basic", "pro", "heavy", "mini")
FIRST_NAMES = ("Ann", "Bob", "Cora", "Dan", "Eve", "Finn", "Gia", "Hugo", "Ida", "Jon", "Kai", "Lena", "Max",
               "Nia", "Otto", "Pia", "Quinn", "Rosa", "Sam", "Tess", "Uma", "Vic", "Wes", "Yara", "Zoe")
LAST_NAMES = ("Lee", "Park", "Diaz", "Kim", "Moss", "Novak", "Ortiz", "Reed", "Sato", "Berg", "Cruz", "Hale",
              "Ivers", "Jung", "Kahn", "Lund", "Meyer", "Nash", "Olsen", "Price", "Quist", "Roth", "Stone")
CITIES = ("Lisbon", "Oslo", "Turin", "Ghent", "Porto", "Graz", "Bergen", "Leeds")
WAREHOUSES = ("north", "south", "east", "west")

MAX_PRODUCTS = len(QUALIFIERS) * sum(len(items) for items in ITEMS_BY_CATEGORY.values())
MAX_CUSTOMERS = len(FIRST_NAMES) * len(LAST_NAMES)

READ_ONLY_PRAGMAS = frozenset({"table_info", "table_xinfo", "table_list", "index_list", "index_info",
                               "foreign_key_list"})
NONDETERMINISTIC_FUNCTIONS = frozenset({"random", "randomblob", "load_extension", "date", "time", "datetime",
                                        "julianday", "unixepoch", "strftime", "timediff", "current_date",
                                        "current_time", "current_timestamp"})
ROW_WRITES = frozenset({sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE, sqlite3.SQLITE_DELETE})
ALWAYS_ALLOWED = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE})


def db_spec(seed: int, n_products: int = 30, n_customers: int = 15, n_orders: int = 60) -> dict[str, int]:
    if not 5 <= n_products <= MAX_PRODUCTS:
        raise ValueError(f"n_products={n_products}: must be between 5 and {MAX_PRODUCTS}")
    if not 3 <= n_customers <= MAX_CUSTOMERS:
        raise ValueError(f"n_customers={n_customers}: must be between 3 and {MAX_CUSTOMERS}")
    if n_orders < n_customers:
        raise ValueError(f"n_orders={n_orders}: must be at least n_customers={n_customers} (one order each)")
    return {"seed": seed, "n_products": n_products, "n_customers": n_customers, "n_orders": n_orders}


def build_database(spec: dict[str, int]) -> bytes:
    """The serialized database for a spec: the same spec always gives the same bytes."""
    return _build(spec["seed"], spec["n_products"], spec["n_customers"], spec["n_orders"])


def database_rows(spec: dict[str, int]) -> dict[str, list[tuple]]:
    """Every table's rows, in insertion order: exactly what `build_database` stores."""
    rows = _rows(spec["seed"], spec["n_products"], spec["n_customers"], spec["n_orders"])
    return {table: list(table_rows) for table, table_rows in rows.items()}


@lru_cache(maxsize=64)
def _build(seed: int, n_products: int, n_customers: int, n_orders: int) -> bytes:
    conn = sqlite3.connect(":memory:")
    conn.executescript(SCHEMA)
    for table, rows in _rows(seed, n_products, n_customers, n_orders).items():
        if rows:
            conn.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * len(rows[0]))})", rows)
    conn.commit()
    data = conn.serialize()
    conn.close()
    return data


@lru_cache(maxsize=256)  # a task's split key and its database are built from the same rows
def _rows(seed: int, n_products: int, n_customers: int, n_orders: int) -> dict[str, tuple[tuple, ...]]:
    rng = random.Random(seed)
    products = _products(rng, n_products)
    customers = _customers(rng, n_customers)
    prices = {row[0]: row[3] for row in products}
    orders = _orders(rng, n_orders, n_customers, prices)
    tables = {"products": products, "customers": customers, "orders": orders, "inventory": _inventory(rng, n_products)}
    return {table: tuple(rows) for table, rows in tables.items()}


CATALOGUE = tuple((f"{q} {item}", category) for category, items in ITEMS_BY_CATEGORY.items()
                  for item in items for q in QUALIFIERS)
CUSTOMER_NAMES = tuple(f"{first} {last}" for first in FIRST_NAMES for last in LAST_NAMES)


def _products(rng: random.Random, n: int) -> list[tuple]:
    chosen = rng.sample(CATALOGUE, n)
    return [(i + 1, name, category, rng.randint(2, 500)) for i, (name, category) in enumerate(chosen)]


def _customers(rng: random.Random, n: int) -> list[tuple]:
    names = rng.sample(CUSTOMER_NAMES, n)
    return [(i + 1, name, rng.choice(CITIES)) for i, name in enumerate(names)]


def _orders(rng: random.Random, n: int, n_customers: int, prices: dict[int, int]) -> list[tuple]:
    customer_ids = list(range(1, n_customers + 1)) + [rng.randint(1, n_customers) for _ in range(n - n_customers)]
    rng.shuffle(customer_ids)
    rows = []
    for order_id, customer_id in enumerate(customer_ids, start=1):
        product_id = rng.randint(1, len(prices))
        unit_price = max(1, prices[product_id] + rng.randint(-5, 5))  # prices drift over time
        rows.append((order_id, customer_id, product_id, rng.randint(1, 9), unit_price))
    return rows


def _inventory(rng: random.Random, n_products: int) -> list[tuple]:
    return [(product_id, warehouse, rng.randint(0, 200))
            for product_id in range(1, n_products + 1)
            for warehouse in rng.sample(WAREHOUSES, rng.randint(1, 3))]


def open_plain(data: bytes | memoryview) -> sqlite3.Connection:
    """An unguarded writable connection on a copy of `data` (for the verifier's own reference writes)."""
    conn = sqlite3.connect(":memory:", isolation_level=None)
    conn.deserialize(data)
    return conn


def open_guarded(data: bytes | memoryview, max_value_bytes: int = 100_000, max_extra_pages: int = 2048) -> sqlite3.Connection:
    """A connection on a copy of `data` that only the tool guard's rules can touch (see module doc).

    Pair it with a `StatementBudget` to bound each statement's running time.
    """
    conn = open_plain(data)
    page_count = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count = {page_count + max_extra_pages}")
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, max_value_bytes)
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
    conn.set_authorizer(_authorize)
    return conn


class StatementBudget:
    """Stops a statement run inside `with budget:` after `max_steps` SQLite VM steps, or after
    `max_seconds` as a backstop; statements outside the block run free.

    The step budget is what normally fires: unlike a wall clock it stops a statement at the same
    point on every machine, so episodes stay deterministic.
    """

    CHECK_EVERY = 1000  # VM steps between progress-handler calls

    def __init__(self, conn: sqlite3.Connection, max_steps: int, max_seconds: float):
        self.max_checks = max_steps // self.CHECK_EVERY
        self.max_seconds = max_seconds
        self.armed = False
        conn.set_progress_handler(self.exceeded, self.CHECK_EVERY)

    def __enter__(self) -> StatementBudget:
        self.checks, self.deadline, self.armed = 0, time.perf_counter() + self.max_seconds, True
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.armed = False

    def exceeded(self) -> bool:
        if not self.armed:
            return False
        self.checks += 1
        return self.checks > self.max_checks or time.perf_counter() > self.deadline


def _authorize(action: int, arg1: str | None, arg2: str | None, db: str | None, _trigger: str | None) -> int:
    if action in ALWAYS_ALLOWED:
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_FUNCTION:
        return sqlite3.SQLITE_DENY if (arg2 or "").lower() in NONDETERMINISTIC_FUNCTIONS else sqlite3.SQLITE_OK
    if action in ROW_WRITES:
        return sqlite3.SQLITE_OK if db == "main" and arg1 in TABLES else sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_PRAGMA:
        return sqlite3.SQLITE_OK if (arg1 or "").lower() in READ_ONLY_PRAGMAS else sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_DENY
