"""The `mopd` command line: run | validate | export.

User mistakes (a bad recipe, a missing checkpoint) print one clear line and exit with status 2;
tracebacks are kept for real bugs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mopd.recipe import RecipeError, load_recipe, load_teacher_specs

USAGE_ERROR = 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except (RecipeError, FileNotFoundError) as err:
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
    run.set_defaults(func=cmd_run)

    check = sub.add_parser("validate", help="check a recipe and its teacher specs without running anything")
    check.add_argument("recipe")
    check.add_argument("overrides", nargs="*", help="KEY=VALUE overrides")
    check.set_defaults(func=cmd_validate)

    export = sub.add_parser("export", help="write a checkpoint in an upstream layout")
    export.add_argument("checkpoint", help="a K3 hybrid HF checkpoint directory")
    export.add_argument("out", help="output directory")
    export.add_argument("--format", choices=["kimi-linear"], default="kimi-linear")
    export.set_defaults(func=cmd_export)
    return parser


def cmd_validate(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    specs = load_teacher_specs(recipe, Path(args.recipe).parent)
    print(f"{args.recipe}: ok — recipe {recipe.name!r}, {len(specs)} teacher specs ({', '.join(specs)})")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from mopd.model.export import export_kimi_linear

    export_kimi_linear(args.checkpoint, args.out)
    print(f"wrote {args.format} checkpoint to {args.out}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from mopd.pipeline import run_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    load_teacher_specs(recipe, Path(args.recipe).parent)
    run_recipe(recipe, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
