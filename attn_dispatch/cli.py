"""`attn-dispatch` / `python -m attn_dispatch`: one subcommand per module in attn_dispatch.commands."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module in attn_dispatch.commands (each has add_arguments(parser) and run(args) -> int)
COMMANDS = {
    "platform": ("platform_cmd", "show the detected machine and every engine's status"),
    "explain": ("explain_cmd", "say which backend a call would use, and why each other one would not"),
    "matrix": ("matrix_cmd", "render the support matrix from the constraint tables"),
    "probe": ("probe_cmd", "run boundary configurations on the real engines and check the tables"),
    "bench": ("bench_cmd", "time every eligible engine over a grid of shapes"),
    "tune": ("tune_cmd", "pre-tune the measured policy for a list of shapes"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attn-dispatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(f"attn_dispatch.commands.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"attn_dispatch.commands.{module_name}":
                raise
            continue  # command not built yet
        command = sub.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except ValueError as exc:  # bad input: a clear message, not a traceback
        print(f"attn-dispatch {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
