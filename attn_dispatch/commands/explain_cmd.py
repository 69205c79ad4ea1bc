"""Which backend would run this call, and why each other backend would not.

Exit status: 0 when a backend qualifies, 1 when none does (or not the forced one), 2 on bad arguments."""
from __future__ import annotations

import argparse

from ..context_parallel.efficiency import explain_lines as cp_efficiency_lines, rates_for as cp_rates_for
from ..env import EnvFlags
from ..inputs import plain_params
from ..params import AttentionParams, packed_fields
from ..platform import Platform
from ..question import fp8_notes
from ..selection import explain
from .common import add_call_arguments, add_platform_argument, params_from, platform_from


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_call_arguments(parser)
    add_platform_argument(parser)
    parser.add_argument("--force", default=None, metavar="BACKEND",
                        help="force a backend ('cudnn_fused' or 'flash_attn_2:torch'), as ATTN_DISPATCH_BACKEND does")
    parser.add_argument("--json", action="store_true", help="print the Decision as JSON")
    parser.add_argument("--seqlens", type=_lengths, default=None, metavar="N,N,...",
                        help="a packed (thd) batch's own sequence lengths (keys as many as queries): the batch is "
                             "their count, the longest the default --seqlen, and the profile reads the pack's work "
                             "from them as the module reads it from cu_seqlens")


def _lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seqlens {text!r}: expected tokens per sequence, such as 3968,23,500")
    if min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"--seqlens {text!r}: every sequence needs at least one token")
    return lengths


def packed_call(args: argparse.Namespace, platform: Platform) -> AttentionParams:
    """The call of --seqlens: a packed batch of those sequences, with the fills the module reads from cu_seqlens."""
    lengths = args.seqlens
    if args.qkv_format != "thd":
        raise ValueError(f"--seqlens gives a packed batch's lengths: pass --format thd (not {args.qkv_format})")
    if args.batch is not None and args.batch != len(lengths):
        raise ValueError(f"--batch {args.batch}, but --seqlens gives {len(lengths)} sequences: leave --batch out")
    for flag, value in (("--seqlen", args.seqlen), ("--seqlen-kv", args.seqlen_kv)):
        if value is not None and value < max(lengths):
            raise ValueError(f"{flag} {value} is shorter than the longest of --seqlens ({max(lengths)})")
    seqlen = max(lengths) if args.seqlen is None else args.seqlen
    params = params_from(args, platform).replace(batch_size=len(lengths), max_seqlen_q=seqlen,
                                                 max_seqlen_kv=args.seqlen_kv or seqlen)
    return params.replace(**packed_fields(lengths, lengths, params.max_seqlen_q, params.max_seqlen_kv,
                                          params.attn_mask_type, params.window_size))


def run(args: argparse.Namespace) -> int:
    platform = platform_from(args)
    call = packed_call(args, platform) if args.seqlens else params_from(args, platform)
    params, notes = plain_params(call)  # as the module reads the call
    env = EnvFlags.from_environ()
    # --fp8: which backward runs and the predicted FP8 and bf16 times, as the module's explain() says them
    decision = explain(params, platform, env, force=args.force).with_notes(*notes, *fp8_notes(params, platform, env))
    print(decision.model_dump_json(indent=2) if args.json else decision.summary())
    if params.cp_size > 1 and not args.json:
        # the rates recorded on the platform's GPU (the H100's where none were)
        print("\n".join(["", *cp_efficiency_lines(params, rates=cp_rates_for(platform.device_name))]))
    return 0 if decision.ok else 1
