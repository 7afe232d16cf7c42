"""Benchmark suites: which tasks a benchmark runs, as a YAML file in `eval/`.

    name: tiny
    split: test            # train | dev | test: the content split the tasks are drawn from
    seeds: [1001]          # draws within the split
    n: 6                   # tasks per (domain, effort) cell and seed
    samples: 1             # samples per task: accuracy is mean@k, pass@k over these k
    temperature: 0.0
    batch_tasks: null      # tasks per engine call (null: a cell at once); a request's latency is its call's
    on_budget: null        # force | fail for every effort (budget forcing); null = the efforts' own
    efforts: [low, high, max]
    domains:
      general: {families: [add, mul], options: {add_digits: [1, 3]}}
      code: {}             # every family, default difficulty
      agent: {scaffolds: heldout}   # the harnesses its tasks are asked in (mopd.envs.agent.scaffolds)

Every suite declares its split. A task's split is a function of its canonical content
(`mopd.envs.splits`), and the training stages draw from `train` only, so `dev` (for choosing
knobs) and `test` (what reports quote) hold content no stage was built to train on. That is
checked, not assumed: before sampling, `mopd bench` looks each task's content key up in the
training records of the model's lineage (`mopd.bench.audit`), and an overlap in a dev or test
suite is an error. A `split: train` suite is an in-distribution evaluation; its report says
"training tasks". The seeds only choose draws within the split. The same suite and seed always
give the same tasks, and a task's content does not depend on the effort, so every effort answers
the same questions. A cell holds each content once while the split has enough (`distinct_draw`);
a small split's contents repeat in turn, and the report counts the distinct ones. Every mistake in a suite (an unknown domain, family or split) is one
`SuiteError` naming the file and the field, raised before anything is sampled.

A `split: external` suite asks a public benchmark's problems (`mopd.bench.external`: humaneval, bfcl,
gsm) instead of generated ones: every problem once, in its source's order, the first `limit` of
each source where one is set. No training stage can draw them, and the audit checks every record of
a model's run for their contents all the same.

    name: humaneval
    split: external
    limit: null            # the first N problems (BFCL: of each category); null = all
    answer_tokens: 512     # tokens allowed after the thinking (a whole function)
    domains:
      humaneval: {}
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from mopd.bench.external import EXTERNAL, external_env
from mopd.envs import get_env
from mopd.envs.agent.scaffolds import check_choice
from mopd.envs.base import DOMAINS, EFFORTS, Task
from mopd.envs.effort import EffortSpec
from mopd.envs.splits import task_keys
from mopd.recipe import Recipe, RecipeError, load_recipe, read_yaml_mapping, resolve_path, validate

DRAW_FACTOR = 8  # draws per task looked through for distinct contents before a cell repeats some


class BenchError(RecipeError):
    """A user mistake in a benchmark's input (suite, checkpoint, flags); the message names it."""


class SuiteError(BenchError):
    """A mistake in a suite file; the message names the file and the field."""


class DomainSuite(BaseModel):
    model_config = ConfigDict(extra="forbid")

    families: list[str] = Field(
        default_factory=list, description="task families; empty = the domain's default"
    )
    options: dict[str, Any] = Field(default_factory=dict, description="the env's difficulty knobs")
    scaffolds: str | list[str] | None = Field(
        None, description="agent only: the harnesses its tasks are asked in (mopd.envs.agent.scaffolds): heldout "
        "(the held-out scaffolds of the suite's split), rotate (the training ones), fixed, or a list of names; "
        "null = the recipe's",
    )

    @field_validator("scaffolds")
    @classmethod
    def _known_scaffolds(cls, scaffolds: str | list[str] | None) -> str | list[str] | None:
        if scaffolds is not None:
            check_choice(scaffolds)
        return scaffolds


class Suite(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    split: Literal["train", "dev", "test", "external"] = Field(
        description="the content split the tasks come from: test for reports, dev for tuning, train in-distribution; "
        "external: a public benchmark's problems (domains humaneval, bfcl, gsm)"
    )
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1, description="draws within the split (external: the sampling seed)")
    n: int | None = Field(
        None, gt=0, validate_default=True, description="tasks per (domain, effort) cell and seed; not for an external suite"
    )
    limit: int | None = Field(
        None, gt=0, description="external suites: the first N problems of each source (BFCL: of each category); null = all"
    )
    answer_tokens: int | None = Field(
        None, gt=0, description="tokens allowed after the thinking, for every effort; null = the efforts' own"
    )
    on_budget: Literal["force", "fail"] | None = Field(
        None, description="a turn whose thinking reaches its budget unclosed, for every effort: force = the engine "
        "closes it (budget forcing), fail = over budget; null = the efforts' own"
    )
    samples: int = Field(1, gt=0, description="samples per task (k of mean@k and pass@k)")
    temperature: float = Field(0.0, ge=0)
    batch_tasks: int | None = Field(
        None, gt=0, description="tasks per engine call; null = a whole cell at once"
    )
    efforts: list[str] = Field(default_factory=lambda: list(EFFORTS))
    domains: dict[str, DomainSuite]
    recipe: str | None = Field(
        None, description="a recipe file (relative to this suite's folder) whose efforts, env options and seed a model "
        "from outside a run is benchmarked under, so it meets the recipe's tasks and budgets; a run's own recipe wins"
    )

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds repeat: {seeds}")
        return seeds

    @field_validator("efforts")
    @classmethod
    def _known_efforts(cls, efforts: list[str]) -> list[str]:
        unknown = [e for e in efforts if e not in EFFORTS]
        if unknown or not efforts:
            raise ValueError(f"unknown efforts {unknown}; choose some of {list(EFFORTS)}")
        return efforts

    @field_validator("n")
    @classmethod
    def _n_fits_the_split(cls, n: int | None, info: ValidationInfo) -> int | None:
        external = info.data.get("split") == "external"
        if external and n is not None:
            raise ValueError("an external suite asks every problem once; use limit for a quick run")
        if not external and n is None:
            raise ValueError("tasks per cell and seed: required for a generated (train/dev/test) suite")
        return n

    @field_validator("limit")
    @classmethod
    def _limit_is_external(cls, limit: int | None, info: ValidationInfo) -> int | None:
        if limit is not None and info.data.get("split") != "external":
            raise ValueError("only for an external suite; a generated suite takes n")
        return limit

    @field_validator("domains")
    @classmethod
    def _known_domains(cls, domains: dict[str, DomainSuite], info: ValidationInfo) -> dict[str, DomainSuite]:
        known = known_domains(info.data.get("split", "test"))
        unknown = [d for d in domains if d not in known]
        if unknown or not domains:
            raise ValueError(f"unknown domains {unknown}; choose some of {list(known)}")
        scaffolded = [d for d, spec in domains.items() if spec.scaffolds is not None and d != "agent"]
        if scaffolded:
            raise ValueError(f"{scaffolded}: only the agent domain takes scaffolds")
        return domains

    @property
    def external(self) -> bool:
        return self.split == "external"

    def env_options(self, domain: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
        """Keyword options of the domain's env: the recipe's (`base`), then the suite's on top."""
        spec = self.domains[domain]
        options = {**(base or {}), **spec.options}
        if spec.families:
            options["families"] = spec.families
        if spec.scaffolds is not None:
            options["scaffolds"] = spec.scaffolds
        return options

    def tasks(self, env: Any, effort: str) -> list[Task]:
        """The cell's tasks: n per seed from the suite's split, each content at most once in the cell
        while the split holds enough (`distinct_draw`)."""
        if self.external:
            return env.tasks(effort, self.limit)
        return distinct_draw(lambda count, seed: env.sample(count, seed, self.split, effort), self.seeds, self.n)

    def budgets(self, efforts: dict[str, EffortSpec]) -> dict[str, EffortSpec]:
        """The efforts' specs, with the suite's `answer_tokens` and `on_budget` where it sets them."""
        update = {"answer_tokens": self.answer_tokens, "on_budget": self.on_budget}
        update = {field: value for field, value in update.items() if value is not None}
        return {name: spec.model_copy(update=update) for name, spec in efforts.items()}


def known_domains(split: str) -> tuple[str, ...]:
    return tuple(EXTERNAL) if split == "external" else DOMAINS


def distinct_draw(draw, seeds: list[int], n: int, factor: int = DRAW_FACTOR) -> list[Task]:
    """n tasks per seed, none repeating a content key (`task.meta["content_hash"]`) already in the
    cell, taken in draw order from the first `factor · n` draws of each seed. Where a split holds
    fewer distinct contents than that, the cell's distinct tasks come again in turn, each repeat
    with its own id (so repeats are balanced); the audit reports the distinct count and the sweep
    clusters by content. A task's content does not depend on the effort, so every effort of a
    cell gets the same contents."""
    chosen: list[Task] = []
    seen: set[str] = set()
    for seed in seeds:
        fresh = []
        for task in draw(factor * n, seed):
            key = task_keys([task])[0]
            if key not in seen:
                seen.add(key)
                fresh.append(task)
                if len(fresh) == n:
                    break
        pool = fresh or chosen
        repeats = [
            replace(task, id=f"{task.id}-again{i}")
            for i, task in zip(range(n - len(fresh)), itertools.cycle(pool), strict=False)  # the range ends it: the cycle never does
        ]
        chosen += fresh + repeats
    return chosen


def load_suite(path: str | Path) -> Suite:
    """Read and validate a suite file, building each env once so a bad family fails here; its `recipe`,
    if it names one, becomes a checked absolute path."""
    path = resolve_path(str(path), None)
    try:
        suite = validate(Suite, read_yaml_mapping(path), source=str(path))
    except RecipeError as err:
        raise SuiteError(str(err)) from None
    if suite.recipe is not None:
        suite = suite.model_copy(update={"recipe": str(suite_recipe_path(suite.recipe, Path(path)))})
    for domain in suite.domains:
        close(make_env(suite, domain, source=str(path)))
    return suite


def suite_recipe_path(recipe: str, suite_path: Path) -> Path:
    path = (suite_path.parent / recipe).resolve()
    if not path.is_file():
        raise SuiteError(f"{suite_path}: field `recipe`: {recipe!r} is not a file (relative to {suite_path.parent})")
    return path


def suite_recipe(suite: Suite) -> Recipe | None:
    """The recipe a suite names for models from outside a run (`load_suite` made its path absolute)."""
    return load_recipe(suite.recipe) if suite.recipe is not None else None


def make_env(
    suite: Suite, domain: str, env_options: dict[str, Any] | None = None, source: str = "suite"
) -> Any:
    try:
        if suite.external:
            return external_env(domain, **suite.env_options(domain, env_options))
        return get_env(domain, **suite.env_options(domain, env_options))
    except (ValueError, TypeError) as err:
        raise SuiteError(f"{source}: domains.{domain}: {err}") from None


def close(env: Any) -> None:
    if callable(getattr(env, "close", None)):
        env.close()


def select(
    suite: Suite,
    domains: list[str] | None = None,
    efforts: list[str] | None = None,
    n: int | None = None,
    samples: int | None = None,
    source: str = "suite",
    limit: int | None = None,
) -> Suite:
    """The suite narrowed to some domains/efforts, with n, samples or limit overridden (the CLI's flags)."""
    known = known_domains(suite.split)
    for domain in domains or []:
        if domain not in known:
            raise SuiteError(f"--domains: unknown domain {domain!r}; choose some of {list(known)}")
        if domain not in suite.domains:
            raise SuiteError(f"--domains: {source} has no domain {domain!r}; it has {list(suite.domains)}")
    for effort in efforts or []:
        if effort not in EFFORTS:
            raise SuiteError(f"--efforts: unknown effort {effort!r}; choose some of {list(EFFORTS)}")
        if effort not in suite.efforts:
            raise SuiteError(f"--efforts: {source} has no effort {effort!r}; it has {suite.efforts}")
    update: dict[str, Any] = {}
    if domains:
        update["domains"] = {d: suite.domains[d] for d in domains}
    if efforts:
        update["efforts"] = list(efforts)
    if n is not None and suite.external:
        raise SuiteError(f"--n: {source} is an external suite (every problem once); use --limit for a quick run")
    if limit is not None and not suite.external:
        raise SuiteError(f"--limit: {source} is a {suite.split} suite; --limit is for external suites, use --n")
    for name, value in (("n", n), ("samples", samples), ("limit", limit)):
        if value is not None:
            if value <= 0:
                raise SuiteError(f"--{name}: must be positive, got {value}")
            update[name] = value
    return suite.model_copy(update=update)

