"""Which backend would run this call, and why each other backend would not.

Exit status: 0 when a backend qualifies, 1 when none does (or not the forced one), 2 on bad arguments."""
from __future__ import annotations

import argparse

from ..context_parallel.efficiency import explain_lines as cp_efficiency_lines, rates_for as cp_rates_for
from ..env import EnvFlags
from ..inputs import plain_params
from ..question import fp8_notes
from ..selection import explain
from .common import add_call_arguments, add_platform_argument, params_from, platform_from


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_call_arguments(parser)
    add_platform_argument(parser)
    parser.add_argument("--force", default=None, metavar="BACKEND",
                        help="force a backend ('cudnn_fused' or 'flash_attn_2:torch'), as ATTN_DISPATCH_BACKEND does")
    parser.add_argument("--json", action="store_true", help="print the Decision as JSON")


def run(args: argparse.Namespace) -> int:
    platform = platform_from(args)
    params, notes = plain_params(params_from(args, platform))  # as the module reads the call
    env = EnvFlags.from_environ()
    # --fp8: which backward runs and the predicted FP8 and bf16 times, as the module's explain() says them
    decision = explain(params, platform, env, force=args.force).with_notes(*notes, *fp8_notes(params, platform, env))
    print(decision.model_dump_json(indent=2) if args.json else decision.summary())
    if params.cp_size > 1 and not args.json:
        # the rates recorded on the platform's GPU (the H100's where none were)
        print("\n".join(["", *cp_efficiency_lines(params, rates=cp_rates_for(platform.device_name))]))
    return 0 if decision.ok else 1
