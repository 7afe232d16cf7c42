"""The agent domain's task families and its one builder table, `FAMILIES`.

Each family: make(rng, conn, lookups) -> goal or None (this database does not fit);
prompt(goal) -> str; apply(conn, goal) -> the answer for questions, else None after
writing the intended change; solve(session, goal) plays the expert's episode.

Adding a family is adding one module (its make, prompt, apply and solve, and its `FAMILY`) and one
line here. The table's order is the order `AgentEnv` draws families from: keep it.
"""

from __future__ import annotations

from mopd.envs.agent.families import move_stock, order_count, order_diff, order_total, place_order, set_price
from mopd.envs.agent.families.base import Family

FAMILIES: dict[str, Family] = {
    "order_total": order_total.FAMILY,
    "order_count": order_count.FAMILY,
    "order_diff": order_diff.FAMILY,
    "set_price": set_price.FAMILY,
    "move_stock": move_stock.FAMILY,
    "place_order": place_order.FAMILY,
}
