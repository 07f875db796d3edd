"""The `twinkle` command line, and upstream's script arguments (`CLI`, `Args`)."""

from __future__ import annotations

import argparse
import sys

from twinkle.cli import rl, train
from twinkle.cli.args import CLI, Args

__all__ = ["CLI", "Args", "main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `twinkle` console script; returns the exit code."""
    parser = argparse.ArgumentParser(prog="twinkle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train.add_parser(sub)
    rl.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ValueError as e:
        print(f"twinkle {args.command}: error: {e}", file=sys.stderr)
        return 2
