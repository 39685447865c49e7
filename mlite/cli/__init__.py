"""`mlite` command line. Subcommands live one per module in this package and import heavy things lazily,
so `mlite --help` and `mlite plan` never import torch.

A subcommand module defines `add_parser(subparsers)` (registering its arguments and `set_defaults(run=...)`)
and a `run(args) -> int` function. User errors raise `MliteError`: printed as one line, exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from mlite import __version__
from mlite.errors import EXIT_USAGE, MliteError

# Order is the order shown by `mlite --help`.
COMMANDS = ["plan", "demo", "sft", "grpo", "export", "doctor", "bench", "sbatch"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's usage errors: one line, exit 2, like ours
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mlite", description="Megatron Lite: LLM post-training (SFT, GRPO) at scale.")
    parser.add_argument("--version", action="version", version=f"mlite {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(f"mlite.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.run(args) or 0)
    except MliteError as err:
        print(f"mlite {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"mlite {args.command}: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    sys.exit(main())
