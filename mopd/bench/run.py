"""The effort benchmark: checkpoints × cells (domain, effort) of a suite's split → one report.

    run_bench(models, efforts, domains, suite, n, samples, out, backend)   any checkpoints
    bench_run_dir(run_dir)                                                 a run's base, teachers, student
    run_bench_stage(ctx)                                                   the pipeline's `bench` stage

Everything a user can get wrong (a suite, a checkpoint, a flag) is checked before the first
engine starts, and so is the audit (`mopd.bench.audit`): each (model, cell)'s tasks against the
training records of the model's lineage; a dev or test suite with any overlap stops there unless
`allow_overlap`. Then each model answers its cells' tasks through the shared episode loop
(`run_rollouts`), which verifies and shapes each answer. A sample counts as correct when the
verifier accepts it and its thinking fits the effort's budget (`accuracy`, `pass_at_k`);
`raw_accuracy` (the verdict alone) and the over-budget rate stand beside it. Each row keeps its per-task scores
(`task_rewards`), content keys (`task_keys`) and families (`task_families`), in the cell's task order, and its
`accuracy_interval` (`mopd.stats.accuracy_interval`). Models that differ only in weights
share one engine: the next one's weights are swapped in (`update_weights`), no restart.
A cell's tasks go to the engine together (or in batches of the suite's `batch_tasks`): a
request's latency is the wall time of the call that served it, throughput the generated
tokens over that time.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from mopd.artifacts import checkpoint_in, read_json
from mopd.bench.audit import audit_jobs, base_dir, check_overlap, training_compute
from mopd.bench.external import without_thinking
from mopd.bench.scaffolds import scaffolds_seen, task_scaffolds
from mopd.bench.suite import BenchError, Suite, close, load_suite, make_env, select, suite_recipe
from mopd.envs.base import Task
from mopd.envs.effort import EffortSpec
from mopd.envs.sandbox import describe_backend
from mopd.envs.splits import task_keys
from mopd.machine import describe_machine
from mopd.model.config import CheckpointError, read_model_config
from mopd.recipe import CELLS, Recipe, Resources, validate
from mopd.rollout.episodes import Rollout, run_rollouts
from mopd.rollout.held_out import TaskScorer

console = Console(stderr=True)
DEFAULT_SUITE = "eval/tiny.yaml"
SANDBOXED = ("code", "humaneval")  # domains whose verifier runs the model's code in the sandbox


@dataclass
class ModelRef:
    """A checkpoint to benchmark; a teacher also names its cell ("domain-effort")."""

    name: str
    path: Path
    role: str = "model"  # base | teacher | student | baseline | model
    cell: str | None = None


@dataclass
class Cell:
    domain: str
    effort: str
    tasks: list[Task] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.domain}-{self.effort}"


# ----------------------------------------------------------------------------- entry points
def run_bench(
    models: Sequence[str | ModelRef],
    efforts: Sequence[str] | None = None,
    domains: Sequence[str] | None = None,
    suite: str | Path = DEFAULT_SUITE,
    n: int | None = None,
    samples: int | None = None,
    out: str | Path | None = None,
    backend: str = "vllm",
    *,
    recipe: Recipe | None = None,
    temperature: float | None = None,
    progress: bool = True,
    workers: int | None = None,
    resources: Resources | None = None,
    allow_degraded: bool = False,
    allow_overlap: bool = False,
    limit: int | None = None,
) -> dict[str, Any]:
    """Benchmark `models` on the suite's cells; writes report.json/.md and plots to `out`.
    `limit`: an external suite's first N problems of each source (a quick run).
    `workers` > 1 runs that many engines at once on Ray actors, each holding `resources`.
    `allow_degraded` judges code in the rlimit sandbox where bubblewrap does not work (the report says so).
    `allow_overlap` benchmarks a dev or test suite whose tasks a model trained on (the report says so)."""
    workers = 1 if workers is None else workers
    if workers < 1:
        raise BenchError(f"--workers: needs at least 1 engine, got {workers}")
    refs = [as_model_ref(m) for m in models]
    check_models(refs)
    chosen = select(
        load_suite(suite), list(domains or []), list(efforts or []), n, samples, source=str(suite), limit=limit
    )
    if temperature is not None:
        chosen = chosen.model_copy(update={"temperature": temperature})
    recipe, settings = settings_recipe(recipe, refs, chosen)
    if allow_degraded:
        recipe = recipe.model_copy(update={"sandbox": recipe.sandbox.model_copy(update={"allow_degraded": True})})
    envs = {
        domain: make_env(chosen, domain, env_options(chosen, domain, recipe), source=str(suite))
        for domain in chosen.domains
    }
    budgets = chosen.budgets(recipe.efforts)
    try:
        judging = [envs[d] for d in SANDBOXED if d in envs]
        code_sandbox = judging[0].sandbox.backend if judging else None  # refuses before any engine starts
        cells = [Cell(d, e, chosen.tasks(envs[d], e)) for d in chosen.domains for e in chosen.efforts]
        jobs = [(ref.name, ref.path, cell.name, cell.tasks) for ref in refs for cell in cells_of(ref, cells)]
        audits = audit_jobs(jobs, whole_run=chosen.external)
        overlapping = check_overlap(audits, chosen.split, allow_overlap, source=str(suite))
        seen = scaffolds_seen(jobs)
        results = evaluate(
            refs, cells, envs, chosen, budgets, backend, progress, recipe, workers, resources
        )  # fmt: skip
    finally:
        for env in envs.values():
            close(env)
    from mopd.bench.report import write_report  # matplotlib: not in the engine workers
    from mopd.stats import accuracy_interval

    keys = {cell.name: task_keys(cell.tasks) for cell in cells}
    scaffolds = {cell.name: task_scaffolds(cell.tasks) for cell in cells}
    for row in results:
        cell = f"{row['domain']}-{row['effort']}"
        row["audit"], row["task_keys"] = audits[(row["model"], cell)], keys[cell]  # keys: the sweep clusters by them
        if (row["model"], cell) in seen:  # agent tasks asked in chosen scaffolds: accuracy by scaffold
            row["task_scaffolds"], row["scaffolds_seen"] = scaffolds[cell], seen[(row["model"], cell)]
        interval = accuracy_interval(row["task_rewards"], row["task_keys"], row["samples"], chosen.external)
        row["accuracy_interval"] = {"mean": interval.mean, "low": interval.low, "high": interval.high}
    report = build_report(refs, chosen, str(suite), backend, budgets, results, workers, overlapping)
    report["settings"] = settings
    if code_sandbox:
        report["code_sandbox"] = describe_backend(code_sandbox)
    if out is not None:
        write_report(report, Path(out))
    return report


def env_options(suite: Suite, domain: str, recipe: Recipe) -> dict[str, Any]:
    """A domain's env options: the recipe's `envs.<domain>`; an external benchmark that runs code
    takes only the sandbox opt-in."""
    if not suite.external:
        return recipe.env_options(domain)
    return {"allow_degraded": True} if domain in SANDBOXED and recipe.sandbox.allow_degraded else {}


def bench_run_dir(
    run_dir: str | Path, out: str | Path | None = None, backend: str | None = None, **options
) -> dict:
    """Benchmark a recipe run's base, nine teachers and student together, and its mixed-RL baseline where
    one was trained (`mopd bench --run`)."""
    run_dir = Path(run_dir)
    recipe_file = run_dir / "recipe.json"
    if not recipe_file.is_file():
        raise BenchError(f"--run {run_dir}: no recipe.json; is it a run directory (runs/<recipe>)?")
    recipe = validate(Recipe, read_json(recipe_file), source=str(recipe_file))
    spec = recipe.bench
    suite = options.get("suite") or spec.suite
    own = {"n": spec.n} if suite == spec.suite else {}  # the recipe's n is for its own suite
    options = {"suite": suite, **own, "samples": spec.samples, "temperature": spec.temperature} | {
        key: value for key, value in options.items() if value is not None
    }
    options = {"workers": spec.workers, "resources": spec.resources} | options  # --workers wins
    default_out = run_dir / "bench" / Path(suite).stem if load_suite(suite).external else run_dir / "bench"
    return run_bench(
        run_models(run_dir), out=out if out is not None else default_out,
        backend=backend or spec.backend or recipe.rollout, recipe=recipe, **options,
    )  # fmt: skip


def run_bench_stage(ctx) -> dict[str, Any]:
    """Pipeline stage `bench`: the run's models on the recipe's suite, report in the stage dir; returns
    its compute (`mopd.compute`: the tokens its models generated)."""
    spec = ctx.recipe.bench
    models = run_models(ctx.run_dir, ctx.inputs)
    options = {
        "samples": spec.samples, "backend": spec.backend or ctx.recipe.rollout, "recipe": ctx.recipe,
        "temperature": spec.temperature, "workers": spec.workers, "resources": spec.resources,
    }  # fmt: skip
    reports = [run_bench(models, suite=spec.suite, n=spec.n, out=ctx.dir, **options)]
    reports += [run_bench(models, suite=suite, out=ctx.dir / Path(suite).stem, **options) for suite in spec.external]
    return sum_compute([bench_compute(report) for report in reports])


def sum_compute(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The compute of several reports of the same models: tokens and FLOPs added up."""
    return {
        "tokens_sampled": sum(part["tokens_sampled"] for part in parts),
        "active_params": parts[0]["active_params"],
        "flops": sum(part["flops"] for part in parts),
    }


def bench_compute(report: dict[str, Any]) -> dict[str, Any]:
    """The tokens the report's models generated, and 2·N·tokens summed over the models."""
    from mopd.compute import checkpoint_active_parameters

    params = {model["name"]: checkpoint_active_parameters(model["path"]) for model in report["models"]}
    sampled = {name: 0 for name in params}
    for row in report["results"]:
        sampled[row["model"]] += round(row["generated_tokens_mean"] * row["tasks"] * row["samples"])
    distinct = set(params.values())
    return {
        "tokens_sampled": sum(sampled.values()),
        "active_params": distinct.pop() if len(distinct) == 1 else params,
        "flops": sum(2 * params[name] * tokens for name, tokens in sampled.items()),
    }


def bench_command(args) -> int:
    """`mopd bench MODEL [MODEL ...] | --run DIR` (the CLI's handler)."""
    options = {
        "efforts": split_list(args.efforts), "domains": split_list(args.domains),
        "n": args.n, "samples": args.samples, "workers": args.workers, "limit": args.limit,
        "allow_degraded": args.allow_degraded_sandbox, "allow_overlap": args.allow_overlap,
    }  # fmt: skip
    if args.suite:
        options["suite"] = args.suite
    if args.run:
        if args.models:
            raise BenchError("give either MODEL paths or --run DIR, not both")
        report = bench_run_dir(args.run, out=args.out, backend=args.backend, **options)
    else:
        if not args.models:
            raise BenchError("name at least one MODEL checkpoint, or --run runs/<recipe>")
        report = run_bench(
            args.models, out=args.out or "runs/bench", backend=args.backend or "vllm", **options
        )
    console.print(f"wrote {report['out']}/report.md, report.json and plots")
    return 0


def add_bench_parser(subparsers) -> None:
    """The `mopd bench` subcommand (the CLI calls this with its subparsers)."""
    bench = subparsers.add_parser("bench", help="benchmark checkpoints per domain × effort (report + plots)")
    bench.add_argument("models", nargs="*", metavar="MODEL", help="checkpoint directories, or NAME=PATH")
    bench.add_argument("--run", help="a run directory (runs/<recipe>): its base, teachers, student and mixed-RL baseline if any")
    bench.add_argument("--suite", help=f"suite YAML (default: {DEFAULT_SUITE}, or the run's recipe's)")
    bench.add_argument("--efforts", help="comma-separated subset of the suite's efforts, e.g. low,max")
    bench.add_argument("--domains", help="comma-separated subset of the suite's domains")
    bench.add_argument("--n", type=int, help="tasks per cell and seed (overrides the suite)")
    bench.add_argument("--samples", type=int, help="samples per task, k of mean@k / pass@k")
    bench.add_argument(
        "--limit", type=int, help="an external suite's first N problems of each source (a quick run; overrides the suite)"
    )
    bench.add_argument(
        "--out", help="report directory (default: runs/bench, or <run>/bench; an external suite's: <run>/bench/<suite>)"
    )
    bench.add_argument(
        "--workers", type=int,
        help="engines answering cells at once, one Ray actor each (default 1, or the run's bench.workers)",
    )  # fmt: skip
    bench.add_argument(
        "--backend", choices=["vllm", "hf"], help="rollout engine (default: vllm, or the run's)"
    )
    bench.add_argument(
        "--allow-degraded-sandbox", action="store_true",
        help="without a working bubblewrap, judge code in the weaker rlimit sandbox (the report says so)",
    )  # fmt: skip
    bench.add_argument(
        "--allow-overlap", action="store_true",
        help="benchmark a dev/test suite even where a model trained on some of its tasks (the report says so)",
    )  # fmt: skip
    bench.set_defaults(func=bench_command)


def split_list(value: str | Sequence[str] | None) -> list[str]:
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else [v for part in value for v in part.split(",")]
    return [item.strip() for item in items if item.strip()]


# ----------------------------------------------------------------------------- models
def as_model_ref(model: str | Path | ModelRef) -> ModelRef:
    """A ModelRef from `PATH` or `NAME=PATH` (the name is the table's column)."""
    if isinstance(model, ModelRef):
        return model
    name, sep, path = str(model).partition("=")
    if not sep:
        name, path = Path(model).name or str(model), str(model)
    return ModelRef(name, Path(path))


def check_models(refs: list[ModelRef]) -> None:
    """Every checkpoint loads: config, weights file header, tokenizer; names are distinct."""
    if not refs:
        raise BenchError("no models to benchmark")
    names = [ref.name for ref in refs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise BenchError(f"two models are named {repeated}; name them NAME=PATH")
    for ref in refs:
        check_checkpoint(ref)


def model_entry(ref: ModelRef) -> dict:
    return {**asdict(ref), "path": str(ref.path), "architecture": architecture(ref.path), "compute": training_compute(ref.path)}


def architecture(path: Path) -> str:
    """What a checkpoint is, for the report: its config's model type and the first architecture class."""
    config = read_model_config(path)
    return f"{config.model_type} ({(config.architectures or ['?'])[0]})"


def check_checkpoint(ref: ModelRef) -> None:
    from safetensors import safe_open
    from transformers import AutoTokenizer

    where = f"model {ref.name!r} ({ref.path})"
    if not ref.path.is_dir():
        raise BenchError(f"{where}: no such checkpoint directory")
    try:
        read_model_config(ref.path)
        for weights in sorted(ref.path.glob("*.safetensors")):
            with safe_open(weights, "pt") as f:
                f.keys()
        AutoTokenizer.from_pretrained(ref.path)
    except CheckpointError as err:
        raise BenchError(f"{where}: {err}") from None
    except Exception as err:  # a corrupt file raises whatever its parser raises
        raise BenchError(f"{where}: corrupt checkpoint: {type(err).__name__}: {err}") from None
    if not (ref.path / "tokenizer_config.json").is_file():
        raise BenchError(f"{where}: no tokenizer (tokenizer_config.json) beside the model")


def settings_recipe(given: Recipe | None, refs: list[ModelRef], suite: Suite) -> tuple[Recipe, str]:
    """The recipe whose budgets, env options and seed the bench uses, and where it came from: the caller's,
    the models' run's, the suite's `recipe`, or the defaults."""
    if given is not None:
        return given, f"recipe `{given.name}`"
    if (recipe := recipe_of(refs)) is not None:
        return recipe, f"recipe `{recipe.name}` (the models' run)"
    if (recipe := suite_recipe(suite)) is not None:
        return recipe, f"`{suite.recipe}` (the suite's recipe)"
    return Recipe(name="bench"), "the default recipe"


def recipe_of(refs: list[ModelRef]) -> Recipe | None:
    """The recipe of the run the checkpoints come from (its seed, budgets, env options); None outside a run."""
    for ref in refs:
        for parent in [ref.path, *ref.path.resolve().parents]:
            if (parent / "recipe.json").is_file():
                return validate(Recipe, read_json(parent / "recipe.json"), source=str(parent / "recipe.json"))
    return None


def run_models(run_dir: Path, inputs: Mapping[str, Path] | None = None) -> list[ModelRef]:
    """A run's finished checkpoints: base (after the pretrained checkpoint it was warmed up from, if it was),
    teachers/<cell> (each benchmarked on its own cell), distill/model, and baselines/mixed_rl where the run trained it."""
    dirs = {"base": run_dir / "base", "teachers": run_dir / "teachers", "distill": run_dir / "distill"}
    dirs |= {name: Path(path) for name, path in (inputs or {}).items()}
    warmed_up = read_json(dirs["base"] / "warmup.json")  # the pretrained checkpoint, beside the base warmed up from it
    candidates = [
        *([ModelRef("pretrained", Path(warmed_up["checkpoint"]))] if warmed_up else []),
        ModelRef("base", base_dir(dirs["base"]), "base"),
        *(ModelRef(cell, dirs["teachers"] / cell, "teacher", cell) for cell in CELLS),
        ModelRef("student", checkpoint_in(dirs["distill"]), "student"),
        ModelRef("mixed_rl", dirs.get("baselines/mixed_rl", run_dir / "baselines" / "mixed_rl"), "baseline"),
    ]
    refs = [ref for ref in candidates if (ref.path / "config.json").is_file()]
    if not refs:
        raise BenchError(
            f"{run_dir}: no base, teacher or student checkpoint (base/, teachers/<cell>/, distill/model/)"
        )
    return refs


def cells_of(ref: ModelRef, cells: list[Cell]) -> list[Cell]:
    """A teacher answers its own cell only (it was trained for it); other models answer every cell."""
    if ref.role != "teacher":
        return cells
    return [cell for cell in cells if cell.name == ref.cell]


# ----------------------------------------------------------------------------- evaluation
def evaluate(
    refs,
    cells,
    envs,
    suite: Suite,
    budgets: Mapping[str, EffortSpec],
    backend: str,
    progress: bool,
    recipe: Recipe | None = None,
    workers: int = 1,
    resources: Resources | None = None,
):
    """Each (model, cell) job's metrics, in model order: here, or on `workers` Ray actors at once."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # engine logs would break up the progress bar
    recipe = recipe or Recipe(name="bench")
    jobs = [(ref, cell) for ref in refs for cell in cells_of(ref, cells)]
    total = sum(len(cell.tasks) * suite.samples for _, cell in jobs)
    with progress_bar(progress) as bar:
        task = bar.add_task("bench", total=total)

        def finished(ref: ModelRef, cell: Cell, metrics: dict) -> None:
            bar.console.print(cell_line(ref.name, cell.name, metrics))

        if workers == 1 or len(jobs) < 2:
            metrics = []
            worker = CellWorker(suite, budgets, backend, envs=envs, max_model_len=recipe.max_model_len)
            try:
                for ref, cell in jobs:
                    bar.update(task, description=f"{ref.name}: {cell.name}")
                    metrics.append(worker.run(ref, cell, lambda k: bar.advance(task, k)))
                    finished(ref, cell, metrics[-1])
            finally:
                worker.close()  # its engine: the next stage (curves) starts its own
        else:
            worker_args = (suite, budgets, backend, None, {d: env_options(suite, d, recipe) for d in suite.domains})
            metrics = run_on_workers(jobs, recipe, workers, resources or Resources(), worker_args, bar, task, finished)
    return [
        {"model": ref.name, "domain": cell.domain, "effort": cell.effort, **m} for (ref, cell), m in zip(jobs, metrics, strict=True)
    ]


class CellWorker:
    """Answers (model, cell) jobs with one engine, swapping weights between models (`TaskScorer`)."""

    def __init__(
        self, suite: Suite, budgets, backend: str, envs=None, env_options=None, threads: int | None = None,
        max_model_len: int = 2048,
    ):  # fmt: skip
        if threads is not None:
            torch.set_num_threads(threads)
        self.suite, self.budgets, self.owns_envs = suite, budgets, envs is None
        self.envs = envs if envs is not None else {
            domain: make_env(suite, domain, (env_options or {}).get(domain)) for domain in suite.domains
        }  # fmt: skip
        self.scorer = TaskScorer(backend, max_model_len=max_model_len)

    def run(self, ref: ModelRef, cell: Cell, advance=None) -> dict:
        groups, latencies, wall = sample_cell(
            self.scorer.engine(ref.path), self.scorer.tokenizer(ref.path), self.envs, cell, self.budgets, self.suite,
            advance or (lambda k: None),
        )  # fmt: skip
        metrics = cell_metrics(groups, latencies, wall, self.budgets[cell.effort])
        if self.suite.external:  # what the model answered, for the reader of a public benchmark's score
            metrics["answers"] = answers(groups)
        return metrics

    def close(self) -> None:
        self.scorer.close()
        if self.owns_envs:
            for env in self.envs.values():
                close(env)


def run_on_workers(
    jobs, recipe: Recipe, workers: int, resources: Resources, worker_args: tuple, bar: Progress, task, finished
) -> list[dict]:
    """The jobs on Ray actors (`CellWorker`s), the largest token budgets first so that short cells
    fill in at the end. On a 2-core box two one-thread engines answer ~1.4x the requests of one
    two-thread engine (a tiny model's decode steps are too small for two threads), and the very same
    tokens: sampling is seeded per request, and one thread computes what two do."""
    import ray

    from mopd.cluster import run_in_slots, slots, start_ray

    budgets = worker_args[1]
    order = sorted(range(len(jobs)), key=lambda i: -budgets[jobs[i][1].effort].max_new_tokens)
    started = start_ray(recipe)
    actors = []
    try:
        count = min(workers, slots([resources]), len(jobs))
        actor = ray.remote(CellWorker).options(num_cpus=resources.num_cpus, num_gpus=resources.num_gpus)
        threads = max(1, int(resources.num_cpus))
        actors = [actor.remote(*worker_args, threads=threads, max_model_len=recipe.max_model_len) for _ in range(count)]
        idle, running, metrics = list(actors), {}, {}
        bar.update(task, description=f"{count} workers")

        def start(i: int) -> None:
            worker = idle.pop()
            running[worker.run.remote(*jobs[i])] = (i, worker)

        def wait_one() -> int:
            done, _ = ray.wait(list(running), num_returns=1)
            i, worker = running.pop(done[0])
            metrics[i] = ray.get(done[0])
            idle.append(worker)
            bar.advance(task, len(jobs[i][1].tasks) * metrics[i]["samples"])
            finished(*jobs[i], metrics[i])
            return i

        run_in_slots(order, count, start, wait_one)
        ray.get([worker.close.remote() for worker in actors])
    finally:
        for worker in actors:
            ray.kill(worker)
        if started:
            ray.shutdown()
    return [metrics[i] for i in range(len(jobs))]


def cell_line(model: str, cell: str, metrics: dict) -> str:
    return (
        f"{model} {cell}: accuracy {metrics['accuracy']:.2f} (raw {metrics['raw_accuracy']:.2f}), thinking {metrics['thinking_tokens_mean']:.0f} tokens, "
        + (f"{metrics['forced_rate']:.2f} of turns forced, " if metrics.get("forced_rate", 0) > 0 else "")
        + f"{metrics['seconds']:.1f} s"
    )


def progress_bar(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
        TimeElapsedColumn(), TimeRemainingColumn(), console=console, disable=not enabled,
    )  # fmt: skip


def sample_cell(engine, tokenizer, envs, cell: Cell, budgets, suite: Suite, advance):
    """The cell's rollouts (k per task), each request's latency (its call's seconds) and the wall time."""
    batch = suite.batch_tasks or len(cell.tasks)
    groups, latencies, wall = [], [], 0.0
    for start in range(0, len(cell.tasks), batch):
        tasks = cell.tasks[start : start + batch]
        began = time.perf_counter()
        answered = run_rollouts(
            engine, tokenizer, {cell.domain: envs[cell.domain]}, tasks, budgets,
            n=suite.samples, temperature=suite.temperature, seed=suite.seeds[0],
        )  # fmt: skip
        if suite.external:  # a stock model may answer without thinking: no budget to exceed
            for rollout in (r for group in answered for r in group):
                without_thinking(rollout)
        groups += answered
        seconds = time.perf_counter() - began
        latencies += [seconds] * (len(tasks) * suite.samples)
        wall += seconds
        advance(len(tasks) * suite.samples)
    return groups, latencies, wall


def cell_metrics(
    groups: list[list[Rollout]], latencies: list[float], wall: float, budget: EffortSpec
) -> dict:
    rollouts = [r for group in groups for r in group]
    generated = sum(sum(r.loss_mask) for r in rollouts)
    scores = [[within_budget(r) for r in group] for group in groups]
    return {
        "tasks": len(groups),
        "samples": len(rollouts) // len(groups),
        "budget_tokens": budget.budget_tokens,
        "accuracy": mean(s for group in scores for s in group),
        "task_rewards": [mean(group) for group in scores],  # paired comparisons
        "task_families": [task_family(group[0].task) for group in groups],  # accuracy by family
        "pass_at_k": mean(any(r.verdict.passed and not r.over_budget for r in group) for group in groups),
        "raw_accuracy": mean(r.verdict.reward for r in rollouts),
        "raw_pass_at_k": mean(any(r.verdict.passed for r in group) for group in groups),
        "shaped_reward": mean(r.reward for r in rollouts),
        "closed_think_rate": mean(r.closed_think for r in rollouts),
        "thinking_tokens_mean": mean(r.thinking_tokens for r in rollouts),
        "thinking_tokens_p90": p90(r.thinking_tokens for r in rollouts),
        "answer_tokens_mean": mean(r.answer_tokens for r in rollouts),
        "answer_tokens_p90": p90(r.answer_tokens for r in rollouts),
        "generated_tokens_mean": generated / len(rollouts),
        "over_budget_rate": mean(r.over_budget for r in rollouts),
        "forced_rate": forced_rate(rollouts),
        "latency_s_mean": mean(latencies),
        "latency_s_p90": p90(latencies),
        "seconds": wall,
        "tokens_per_s": generated / wall,
        "requests_per_s": len(rollouts) / wall,
    }


def answers(groups: list[list[Rollout]]) -> list[dict]:
    """Each sample's task, completion (the last turn) and verdict (`answers.jsonl` of the report)."""
    return [
        {"task": r.task.id, "completion": r.completion, "reward": r.verdict.reward, "correct": within_budget(r),
         "thinking_tokens": r.thinking_tokens, "details": r.verdict.details}
        for group in groups for r in group
    ]  # fmt: skip


def task_family(task: Task) -> str:
    """A task's family: the generators' `meta["family"]`, BFCL's category, else its domain (HumanEval, GSM)."""
    return task.meta.get("family") or task.meta.get("category") or task.domain


def forced_rate(rollouts: list[Rollout]) -> float:
    """The share of assistant turns that budget forcing closed."""
    return mean(forced for r in rollouts for forced in r.turn_forced)


def within_budget(rollout: Rollout) -> float:
    """The verdict's reward where the thinking fits the effort's budget, else 0: the budget is the protocol."""
    return 0.0 if rollout.over_budget else rollout.verdict.reward


def mean(values: Iterable[float]) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else math.nan


def p90(values: Iterable[float]) -> float:
    values = [float(v) for v in values]
    return float(np.percentile(values, 90)) if values else math.nan


# ----------------------------------------------------------------------------- the report
def build_report(
    refs, suite: Suite, suite_path: str, backend: str, budgets, results, workers: int = 1, overlapping: bool = False
) -> dict[str, Any]:
    report = {
        "suite": {"path": suite_path, **suite.model_dump()},
        "label": report_label(suite.split, overlapping),
        "backend": backend,
        "workers": workers,
        "efforts": {effort: spec.model_dump() for effort, spec in budgets.items() if effort in suite.efforts},
        "models": [model_entry(ref) for ref in refs],
        "results": results,
        "machine": describe_machine(),
    }
    if suite.external:
        report["audit_line"] = external_audit_line(results)
    return report


def external_audit_line(results: list[dict]) -> str:
    """What the audit says of an external suite, in one line for the report."""
    models = list(dict.fromkeys(r["model"] for r in results))
    audits = {m: [r["audit"] for r in results if r["model"] == m] for m in models}
    leaked = [m for m in models if any(a.get("overlap") for a in audits[m])]
    clean = [m for m in models if all(a.get("overlap") == 0 for a in audits[m])]
    unrecorded = [m for m in models if any(a.get("missing_record") for a in audits[m])]
    outside = [m for m in models if m not in unrecorded and any("unavailable" in a for a in audits[m])]
    if leaked:
        return f"External suite, OVERLAPPING: the training records of the run of {', '.join(leaked)} hold some of its problems."
    parts = ["External suite: no training stage drew these problems (mopd's stages sample only generated train tasks)"]
    if clean:
        parts.append(f"the audit found none of their contents in any training record of the run of {', '.join(clean)}")
    pretrained = [m for m in clean if any("pretraining_not_audited" in a for a in audits[m])]
    if pretrained:
        parts.append(f"the pretraining of the base of {', '.join(pretrained)} is not audited")
    if unrecorded:
        parts.append(f"the run of {', '.join(unrecorded)} lacks a stage's training record: not audited")
    if outside:
        parts.append(f"{', '.join(outside)} is not from a mopd run: no mopd stage trained it, and its pretraining is not audited")
    return "; ".join(parts) + "."


def report_label(split: str, overlapping: bool) -> str | None:
    """What the title and tables must say about the tasks: none for a clean dev or test suite."""
    if split == "train":
        return "training tasks"
    return "overlapping or unaudited: some tasks were trained on, or what a model trained on is unknown" if overlapping else None

