"""`python -m mopd.bench MODEL [MODEL ...] | --run DIR`: the same command as `mopd bench`."""

from __future__ import annotations

import argparse
import sys

from mopd.bench.run import add_bench_parser
from mopd.recipe import RecipeError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mopd.bench")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except RecipeError as err:  # BenchError and SuiteError are RecipeErrors: one line, status 2
        print(f"mopd bench: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
