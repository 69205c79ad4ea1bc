"""Arguments shared by subcommands: describing a call and a platform."""
from __future__ import annotations

import argparse

from ..params import BIAS_SHAPES, BIAS_TYPES, CP_COMM_TYPES, MASK_TYPES, QKV_FORMATS, SOFTMAX_TYPES, AttentionParams
from ..platform import PROFILES, Platform


def add_platform_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--platform", default="live", metavar="SPEC",
                        help="the machine to decide for: 'live' (default, probed), a profile "
                             f"({', '.join(PROFILES)}), or tokens like 'sm80,cudnn=8.9.7,flash-attn=2.4.2'")


def platform_from(args: argparse.Namespace) -> Platform:
    return Platform.detect() if args.platform == "live" else Platform.parse(args.platform)


def _window(text: str) -> tuple[int, int]:
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window {text!r}: expected LEFT,RIGHT such as 128,0 (-1 = unbounded)")
    return left, right


def add_call_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("the attention call")
    g.add_argument("--dtype", default="bf16", help="bf16, fp16, fp32, fp64 (default bf16)")
    g.add_argument("--format", dest="qkv_format", default="bshd", choices=QKV_FORMATS)
    g.add_argument("--batch", type=int, default=None, help="sequences (default 2)")
    g.add_argument("--seqlen", type=int, default=None, help="max sequence length of q (default 4096)")
    g.add_argument("--seqlen-kv", type=int, default=None, help="max sequence length of k/v (default: --seqlen)")
    g.add_argument("--heads", type=int, default=16)
    g.add_argument("--kv-heads", type=int, default=None, help="GQA/MQA: number of k/v heads")
    g.add_argument("--head-dim", type=int, default=128)
    g.add_argument("--head-dim-v", type=int, default=None)
    g.add_argument("--mask", default="no_mask", choices=MASK_TYPES)
    g.add_argument("--window", type=_window, default=None, metavar="LEFT,RIGHT")
    g.add_argument("--bias", default="no_bias", choices=BIAS_TYPES)
    g.add_argument("--bias-shape", default=None, choices=BIAS_SHAPES)
    g.add_argument("--dropout", type=float, default=0.0)
    g.add_argument("--softmax-type", default="vanilla", choices=SOFTMAX_TYPES)
    g.add_argument("--inference", action="store_true", help="no backward pass")
    g.add_argument("--deterministic", action="store_true")
    g.add_argument("--fp8", action="store_true")
    g.add_argument("--cp-size", type=int, default=1)
    g.add_argument("--cp-comm", default="p2p", choices=CP_COMM_TYPES)
    g.add_argument("--cp-a2a-size", type=int, default=None, help="a2a+p2p: ranks in the a2a group (default 2)")
    g.add_argument("--device", default=None, choices=("cuda", "cpu"),
                   help="where the tensors live (default: the platform's device)")


def params_from(args: argparse.Namespace, platform: Platform) -> AttentionParams:
    bias_shape = args.bias_shape
    if args.bias in ("pre_scale_bias", "post_scale_bias") and bias_shape is None:
        bias_shape = "1hss"
    return AttentionParams(
        dtype=args.dtype, qkv_format=args.qkv_format, batch_size=2 if args.batch is None else args.batch,
        num_heads=args.heads, num_gqa_groups=args.kv_heads, head_dim_qk=args.head_dim, head_dim_v=args.head_dim_v,
        max_seqlen_q=4096 if args.seqlen is None else args.seqlen, max_seqlen_kv=args.seqlen_kv,
        attn_mask_type=args.mask,
        window_size=args.window, bias_type=args.bias, bias_shape=bias_shape, dropout=args.dropout,
        softmax_type=args.softmax_type, is_training=not args.inference, deterministic=args.deterministic,
        fp8=args.fp8, cp_size=args.cp_size, cp_comm_type=args.cp_comm,
        cp_a2a_size=args.cp_a2a_size,
        device_type=args.device or platform.device_type,
    )
