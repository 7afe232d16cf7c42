"""move_stock: move units of the cheapest product of categories between warehouses (a write)."""

from __future__ import annotations

import random
import sqlite3
from typing import Any

from mopd.envs.agent.database import ITEMS_BY_CATEGORY, WAREHOUSES
from mopd.envs.agent.expert import _Session
from mopd.envs.agent.families.base import Family, spoken_list


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


FAMILY = Family(_make_move_stock, _prompt_move_stock, _apply_move_stock, _solve_move_stock)
