"""place_order: record a customer's orders and take the units out of stock (a write)."""

from __future__ import annotations

import random
import sqlite3
from typing import Any

from mopd.envs.agent.database import WAREHOUSES
from mopd.envs.agent.expert import _Session
from mopd.envs.agent.families.base import Family, sql_list


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


FAMILY = Family(_make_place_order, _prompt_place_order, _apply_place_order, _solve_place_order)
