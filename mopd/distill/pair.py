"""Pair mode: one teacher distilled into one student with the MOPD machinery.

    mopd distill --teacher PATH --student PATH --domain general --effort low --out DIR
    mopd distill --teacher PATH --student PATH --data tasks.jsonl --verifier general/exact --out DIR

Teacher and student may be any HF causal LMs that share a tokenizer (a K3 hybrid or a stock
architecture: `mopd init-student` makes a student from a teacher); the student samples through the
rollout engine, vLLM wherever it is installed, and so does the teacher in the held-out eval. Prompts
come from a domain's environment at one effort (its train split), or from a task file (see
`mopd.envs.data.load_task_file`), whose rows outside the train split (by content key,
`mopd.envs.splits`) are never trained on. The loss options and their defaults are the schema's
`DistillSpec` (a recipe's `distill:` block may set others); `--eval-tasks` is pair mode's own.

Held out: up to `eval_tasks` tasks of the `eval_split` split, dev by default (for choosing
settings; test only for the number a report quotes): with a domain, drawn from the cell's split of
its environment; with a task file, its rows whose content key falls in that split. After training,
`eval.json` names the split and the scored tasks' content keys, and holds the mean held-out reward
of the student before, the student after and the teacher (one sample per task, at the sampling
temperature, the same seed for all three), and a paired 95% interval of after − before. With no
task of the split held out, no eval.json is written.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from statistics import fmean
from typing import Any

from mopd.envs.base import Task
from mopd.envs.effort import EffortSpec, default_effort_specs
from mopd.recipe import CELLS, DistillSpec, ImportanceSpec, Precision, Recipe, validate
from mopd.stats import mean_interval

EVAL_TASKS = 32  # held-out tasks scored after a pair run (the recipe's stage scores none by default)
EVAL_SPLITS = ("dev", "test")  # dev to choose settings on, test only to report


class PairError(ValueError):
    """A pair-mode request that names no cell or an unknown one, or a task file with nothing to train on."""


def default_backend() -> str:
    """vLLM wherever it is installed; the HF backend only without it (and we say so)."""
    if importlib.util.find_spec("vllm") is not None:
        return "vllm"
    print("mopd distill: vLLM is not installed; sampling with the (slower) HF backend", file=sys.stderr)
    return "hf"


def distill_pair(
    teacher: str | Path,
    student: str | Path,
    out_dir: str | Path,
    *,
    domain: str | None = None,
    effort: str | None = None,
    data_file: str | Path | None = None,
    verifier: str | None = None,
    efforts: dict[str, EffortSpec] | None = None,
    env_options: dict[str, dict] | None = None,
    backend: str | None = None,
    seed: int = 0,
    eval_split: str = "dev",
    progress: bool = True,
    **spec_fields: Any,
) -> Path:
    """Distil `teacher` into `student` on one cell or a task file, then score the held-out tasks of
    `eval_split` (`out_dir/eval.json`, unless `eval_tasks=0` or none is held out); returns the student checkpoint."""
    from mopd.artifacts import write_json_atomic
    from mopd.distill.trainer import train_mopd
    from mopd.envs.sandbox import resolve_backend
    from mopd.envs.splits import task_keys

    if eval_split not in EVAL_SPLITS:
        raise PairError(f"eval split {eval_split!r}: choose {' or '.join(EVAL_SPLITS)} (dev to choose settings, test to report)")
    backend = backend or default_backend()
    efforts = efforts or default_effort_specs()
    spec = validate(DistillSpec, {"teacher_actors": False, "eval_tasks": EVAL_TASKS, **spec_fields}, source="mopd distill")
    train, held_out, cells = pair_tasks(domain, effort, data_file, verifier, env_options or {}, spec.eval_tasks, seed, eval_split)
    if any(cell.startswith("code-") for cell in cells):  # refuse before any model loads, not at the first verdict
        code = (env_options or {}).get("code", {})
        resolve_backend(code.get("backend", "auto"), code.get("allow_degraded", False))
    spec = spec.model_copy(update={"mix": dict.fromkeys(cells, 1.0)})
    out_dir = Path(out_dir)
    (out_dir / "eval.json").unlink(missing_ok=True)  # never left from an earlier run beside this one's student
    final = train_mopd(
        student, dict.fromkeys(cells, teacher), spec, out_dir,
        efforts=efforts, env_options=env_options, tasks=train, backend=backend, seed=seed, progress=progress,
    )  # fmt: skip
    if held_out:
        models = {"student_before": Path(student), "student_after": final, "teacher": Path(teacher)}
        report = held_out_eval(models, held_out, cells, env_options or {}, efforts, backend, spec.temperature, seed)
        source = {"held_out": held_out_source(domain, effort, data_file, eval_split), "split": eval_split}
        write_json_atomic(out_dir / "eval.json", {**source, "task_keys": task_keys(held_out), **report})
    return final


def pair_tasks(domain, effort, data_file, verifier, env_options, eval_tasks: int, seed: int, eval_split: str = "dev"):
    """(train tasks or None to draw from the env, held-out tasks of `eval_split`, cells) of a pair run."""
    if data_file is not None:
        from mopd.envs.data import load_task_file
        from mopd.envs.splits import split_of

        tasks = load_task_file(data_file, verifier or domain or "general", effort or "high")
        train = [t for t in tasks if split_of(t.meta["content_hash"]) == "train"]
        if not train:
            raise PairError(f"{data_file}: none of its {len(tasks)} rows falls in the train split (by content hash)")
        held_out = [t for t in tasks if split_of(t.meta["content_hash"]) == eval_split][:eval_tasks]
        return train, held_out, sorted({f"{t.domain}-{t.effort}" for t in tasks})
    if domain is None or effort is None:
        raise PairError("give --domain and --effort, or --data FILE")
    cell = f"{domain}-{effort}"
    if cell not in CELLS:
        raise PairError(f"unknown cell {cell!r}; cells are {', '.join(CELLS)}")
    held_out = []
    if eval_tasks:
        from mopd.envs import get_env

        held_out = get_env(domain, **env_options.get(domain, {})).sample(eval_tasks, seed, eval_split, effort)
    return None, held_out, [cell]


def held_out_source(domain, effort, data_file, eval_split: str) -> str:
    if data_file is not None:
        return f"{eval_split}-split rows of {data_file}, by content key"
    return f"{eval_split} split of {domain}-{effort}"


# ----------------------------------------------------------------------------- held-out eval
def held_out_eval(models: dict[str, Path], tasks: list[Task], cells, env_options, efforts, backend, temperature, seed) -> dict:
    """Each model's mean reward on the same tasks and draws, and the paired interval of after − before."""
    from mopd.distill.routing import build_route_table
    from mopd.distill.trainer import envs_for
    from mopd.rollout.held_out import TaskScorer, task_rewards
    from mopd.rollout.interface import CheckpointError

    envs = envs_for(build_route_table(dict.fromkeys(cells, 1.0), dict.fromkeys(cells, "")), env_options, tasks)
    rewards, out = {}, {"tasks": len(tasks), "samples_per_task": 1, "temperature": temperature}
    with TaskScorer(backend) as scorer:
        for name, path in models.items():
            try:
                groups = scorer.rollouts(path, envs, tasks, efforts, n=1, temperature=temperature, seed=seed)
            except CheckpointError as err:  # a teacher that our engines cannot load (transformers does not know it)
                out[name] = {"skipped": str(err)}
                continue
            rewards[name] = task_rewards(groups)
            out[name] = {"reward": fmean(rewards[name])}
    out["after_minus_before"] = paired_interval(rewards["student_after"], rewards["student_before"])
    return out


def paired_interval(after: list[float], before: list[float]) -> dict[str, float | None]:
    """Mean of the per-task differences and its 95% t interval over tasks (`mopd.stats`; none for one task)."""
    return mean_interval([a - b for a, b in zip(after, before, strict=True)])


# ----------------------------------------------------------------------------- command line
# `--overlap`: the DistillSpec fields each choice sets
OVERLAP = {
    "none": {"max_staleness": 0},
    "thread": {"max_staleness": 1},
    "process": {"max_staleness": 1, "sampler_actor": True},
}


def schema_default(tiny: str | None = None) -> str:
    """Help text saying a training default is DistillSpec's, not a recipe's, and what recipes/tiny.yaml sets
    (`tiny`; None: the same value)."""
    if tiny is None:
        return "default %(default)s: the schema's DistillSpec default; a recipe may set another (recipes/tiny.yaml sets the same)"
    return f"default %(default)s: the schema's DistillSpec default, not a recipe's (recipes/tiny.yaml sets {tiny})"


def add_distill_parser(subparsers) -> None:
    """`mopd distill`: the block the CLI adds with one call. Training defaults are the schema's (`DistillSpec`)."""
    import argparse
    from typing import get_args

    schema = DistillSpec()
    parser = subparsers.add_parser("distill", help="distil one teacher into one student (pair mode)")
    parser.add_argument("--teacher", required=True, help="teacher HF checkpoint (any causal LM with the student's tokenizer)")
    parser.add_argument("--student", required=True, help="student HF checkpoint (a K3 hybrid or any causal LM with the teacher's tokenizer)")
    parser.add_argument("--out", required=True, help="output directory (model/, metrics.jsonl, checkpoints/, eval.json)")
    parser.add_argument("--domain", help="sample prompts from this domain's environment...")
    parser.add_argument("--effort", help="...at this effort (low, high, max)")
    parser.add_argument("--data", help="or a JSONL/parquet task file (its train-split rows are trained on, by content key)")
    parser.add_argument("--verifier", help="the task file's verifier (default: the domain, or general)")
    parser.add_argument("--steps", type=int, default=schema.steps, help=f"training steps; {schema_default('36')}")
    parser.add_argument("--prompts-per-step", type=int, default=schema.prompts_per_step, help=f"prompts sampled a step; {schema_default('23')}")
    parser.add_argument("--learning-rate", type=float, default=schema.learning_rate, help=f"AdamW learning rate, constant; {schema_default('3e-4')}")
    parser.add_argument(
        "--full-vocab-kl", action=argparse.BooleanOptionalAction, default=schema.full_vocab_kl,
        help=f"exact reverse KL over the whole vocabulary instead of the sampled-token estimate; {schema_default()}",
    )  # fmt: skip
    parser.add_argument(
        "--importance", choices=get_args(ImportanceSpec.model_fields["mode"].annotation), default=schema.importance.mode,
        help=f"sampler/trainer mismatch correction: icepop masks tokens whose ratio leaves [low, high], tis clips it; {schema_default()}",
    )  # fmt: skip
    parser.add_argument("--importance-low", type=float, default=schema.importance.low, help=f"low end of the ratio; {schema_default()}")
    parser.add_argument("--importance-high", type=float, default=schema.importance.high, help=f"high end of the ratio; {schema_default()}")
    parser.add_argument(
        "--precision", choices=get_args(Precision), default=schema.precision or Recipe.model_fields["precision"].default,
        help="the student's forward/backward, the teacher's scoring and the sampler: bf16 (autocast over fp32 weights, "
             "optimizer state and log-probs; needs a GPU or a CPU with AVX-512 BF16 or AMX) or fp32; default %(default)s: "
             "the schema's (a recipe's `precision`), and recipes/tiny.yaml's, as bf16 is refused where the machine lacks "
             "it. Where it has it, use bf16 for a real model: SmolLM2-135M into its 15-layer cut ran 90 tokens/s, 1.96x "
             "TRL's best row in bf16, at 2 CPUs (docs/results/pair-trl/smollm2-bf16.md)",
    )  # fmt: skip
    parser.add_argument(
        "--scoring", choices=get_args(DistillSpec.model_fields["scoring"].annotation), default=schema.scoring,
        help="how the teacher scores the student's samples: hf (a chunked HF forward; the exact --full-vocab-kl needs it) "
             f"or vllm (a prefill in a vLLM engine, the sampled token's log-prob; needs --no-full-vocab-kl); {schema_default()}",
    )  # fmt: skip
    parser.add_argument(
        "--packing", action=argparse.BooleanOptionalAction, default=schema.packing,
        help="train the student and score with HF on packed rows (short sequences share a row instead of padding); needs models that honour packed position "
             f"ids (llama-style transformers models, not the K3 hybrid; checked at load); {schema_default()}",
    )  # fmt: skip
    parser.add_argument(
        "--overlap", choices=list(OVERLAP), default="none",
        help="sample the next step while this one scores and trains (one step off, lag ≤ 1, corrected by --importance): "
             "none (synchronous), thread (the engine in this process), process (the engine in a Ray actor of its own); "
             "default %(default)s (no Ray to start), measured at 2 CPUs over 3 seeds: on the trained tiny pair process "
             "sampled 159 tokens/s and none 120, with wide intervals; on SmolLM2-135M and its 15-layer student a step "
             "took 21.1 s with process and 20.4 s with none, the trainer on one core losing what sampling beside it "
             "saves (docs/results/pair-trl/{tiny,smollm2}.md); in bf16 on a CPU with AVX-512 BF16, 6.986 s with process "
             "and 7.227 with none (smollm2-bf16.md), within noise",
    )  # fmt: skip
    parser.add_argument("--eval-tasks", type=int, default=EVAL_TASKS,
                        help="held-out tasks scored into eval.json; 0 skips (default %(default)s, pair mode's own: "
                             "the schema's eval_tasks is 0, as a recipe's bench stage scores instead)")  # fmt: skip
    parser.add_argument("--eval-split", choices=EVAL_SPLITS, default="dev",
                        help="the split the held-out tasks come from (default %(default)s, for choosing settings; "
                             "test only for the number you report)")  # fmt: skip
    parser.add_argument("--on-budget", choices=["force", "fail"], default="fail",
                        help="a turn whose thinking reaches its budget unclosed: force = the engine closes it (budget "
                             "forcing, for a model never taught to think), fail = over budget (default %(default)s)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt draws, the sampling and the held-out draw (default %(default)s)")
    parser.add_argument("--backend", choices=["vllm", "hf"], help="rollout engine (default: vllm when installed)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, pinned before any engine starts (default %(default)s, as a stage's worker on one CPU)")
    parser.add_argument(
        "--allow-degraded-sandbox", action="store_true",
        help="without a working bubblewrap, judge code in the weaker rlimit sandbox instead of refusing",
    )  # fmt: skip
    parser.set_defaults(func=cmd_distill)


def cmd_distill(args) -> int:
    import torch

    from mopd.distill.routing import RoutingError
    from mopd.envs.data import TaskFileError
    from mopd.envs.sandbox import SandboxUnavailable
    from mopd.recipe import RecipeError

    torch.set_num_threads(args.threads)  # before any engine starts: vLLM's CPU worker pins its own afterwards
    importance = {"mode": args.importance, "low": args.importance_low, "high": args.importance_high}
    try:
        final = distill_pair(
            args.teacher, args.student, args.out, domain=args.domain, effort=args.effort,
            data_file=args.data, verifier=args.verifier, backend=args.backend, seed=args.seed, eval_split=args.eval_split,
            env_options={"code": {"allow_degraded": True}} if args.allow_degraded_sandbox else None,
            steps=args.steps, prompts_per_step=args.prompts_per_step, learning_rate=args.learning_rate,
            full_vocab_kl=args.full_vocab_kl, importance=importance, eval_tasks=args.eval_tasks, precision=args.precision,
            scoring=args.scoring, packing=args.packing, **OVERLAP[args.overlap],
            efforts={e: spec.model_copy(update={"on_budget": args.on_budget}) for e, spec in default_effort_specs().items()},
        )  # fmt: skip
    except (PairError, RoutingError, TaskFileError, RecipeError, SandboxUnavailable) as err:
        print(f"mopd distill: error: {err}", file=sys.stderr)
        return 2
    print(f"distilled student written to {final}")
    print(eval_line(Path(args.out) / "eval.json", args.eval_tasks, args.eval_split))
    return 0


def eval_line(path: Path, eval_tasks: int, eval_split: str = "dev") -> str:
    """The three held-out numbers of eval.json and the split they were scored on, in one line."""
    from mopd.artifacts import read_json

    if not eval_tasks:
        return "held-out eval skipped (--eval-tasks 0)"
    report = read_json(path, default=None)
    if report is None:
        return f"held-out eval skipped: no task is held out (no row of the task file is in the {eval_split} split, by content key)"

    def reward(name: str) -> str:
        return f"{report[name]['reward']:.3f}" if "reward" in report[name] else "not scored"

    diff = report["after_minus_before"]
    interval = f", 95% CI {diff['low']:+.3f} to {diff['high']:+.3f}" if diff["low"] is not None else ""
    return (
        f"held-out reward on {report['tasks']} {report['split']}-split tasks ({report['held_out']}): "
        f"student before {reward('student_before')}, after {reward('student_after')} "
        f"(after − before {diff['mean']:+.3f}{interval}), teacher {reward('teacher')}; {path}"
    )


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mopd.distill.pair", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_distill_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
