"""The general domain's own families and its one builder table, `BUILDERS`.

Our own families come with step-by-step traces, where thinking truly helps a tiny model:
  add    a + b, column by column with carries
  mul    a × b, digit by digit with carries for each digit of b, then the rows summed
  chain  a + b − c + …, with a running total

Each family module holds its generator, (rng, knobs) -> (terms, ops), and its trace,
(terms, ops) -> the worked steps. Adding a family is adding one module and one line to `BUILDERS`
(whose order is `OWN_FAMILIES`). reasoning-gym families (`rg/<name>`) are in `mopd.envs.general.rg`.
"""

from __future__ import annotations

from mopd.envs.general.families.add import _gen_add, add_trace
from mopd.envs.general.families.chain import _gen_chain, chain_trace
from mopd.envs.general.families.mul import _gen_mul, mul_trace

BUILDERS = {
    "add": (_gen_add, add_trace),
    "mul": (_gen_mul, mul_trace),
    "chain": (_gen_chain, chain_trace),
}
OWN_FAMILIES = tuple(BUILDERS)
DEFAULT_FAMILIES = (*OWN_FAMILIES, "rg/basic_arithmetic", "rg/gcd")
OWN_GENERATORS = {family: generate for family, (generate, _) in BUILDERS.items()}
TRACES = {family: trace for family, (_, trace) in BUILDERS.items()}
