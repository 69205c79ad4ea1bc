"""Issue 12: what flash-attn-4's replay (backends/_fa4_replay.py) saves per step, forward and training.

For each call, the module forced to flash-attn-4 with the replay and without it (the same engine: the replay is
switched off for that column's calls), cuDNN (frontend) forced and F.scaled_dot_product_attention for scale; per
column the step split into host and GPU time (bench_user_step.split_times: the GPU held busy by a spin kernel while
the calls are enqueued), samples taken in rotating order. Forward under no_grad, and forward then backward into the
leaves' .grad. The outputs of the two flash-attn-4 columns are compared bit for bit first. JSON under --out; a
table last.

    python3 benchmarks/gpu/check_fa4_replay_host.py --out $OUT/fa4_replay_host.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attn_dispatch import DotProductAttention  # noqa: E402
from attn_dispatch.backends import get_engine  # noqa: E402
from attn_dispatch.backends._fa4_replay import ENV_SWITCH  # noqa: E402
from bench_user_step import environment, split_times, step_fn  # noqa: E402

CALLS = [  # (label, b, s, h, hkv, d, causal, window, fmt): blind8-9 shapes where flash-attn-4's host time decided
    ("llm2 d128 s4096 b2 h16/8 causal sbhd", 2, 4096, 16, 8, 128, True, None, "sbhd"),
    ("win1 d64 s4096 b2 h8/4 w2048,2048", 2, 4096, 8, 4, 64, False, (2048, 2048), "bshd"),
    ("mla-like d128 s1500 b4 h32 causal", 4, 1500, 32, 32, 128, True, None, "bshd"),
    ("enc0 d64 s256 b64 h8", 64, 256, 8, 8, 64, False, None, "bshd"),
    ("small d128 s128 b4 h16 causal", 4, 128, 16, 16, 128, True, None, "bshd"),
]


def columns(label, b, s, h, hkv, d, causal, window, fmt, train):
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (b, s) if fmt == "bshd" else (s, b)
    q = torch.randn(*shape, h, d, generator=gen, device="cuda").bfloat16().requires_grad_(train)
    k, v = (torch.randn(*shape, hkv, d, generator=gen, device="cuda").bfloat16().requires_grad_(train)
            for _ in range(2))
    dout = torch.randn(*shape, h * d, generator=gen, device="cuda").bfloat16()
    mask = "causal" if causal else "no_mask"
    kw = dict(qkv_format=fmt, attn_mask_type=mask, num_gqa_groups=hkv)
    if window is not None:
        kw["window_size"] = window
    fa4 = DotProductAttention(h, d, backend="flash_attn_4:cute", **kw).cuda().train(train)
    cudnn = DotProductAttention(h, d, backend="cudnn_fused:frontend", **kw).cuda().train(train)
    engine = get_engine("flash_attn_4:cute")
    engine.__dict__.pop("_replays_by_kind", None)  # made again: main() turned the switch on
    replays = [engine._replays(kind) for kind in ("fwd", "bwd")]

    def switched(on: bool):
        def call(q, k, v):
            for r in replays:
                r.enabled = on
            return fa4(q, k, v)
        return call

    def sdpa(q, k, v):
        to_bhsd = (lambda t: t.permute(0, 2, 1, 3)) if fmt == "bshd" else (lambda t: t.permute(1, 2, 0, 3))
        o = F.scaled_dot_product_attention(to_bhsd(q), to_bhsd(k), to_bhsd(v), is_causal=causal,
                                           enable_gqa=hkv != h)
        o = o.permute(0, 2, 1, 3) if fmt == "bshd" else o.permute(2, 0, 1, 3)
        return o.reshape(*o.shape[:2], -1)

    calls = {"fa4 replay": switched(True), "fa4 interface": switched(False), "cudnn frontend": cudnn}
    if window is None:
        calls["sdpa"] = sdpa
    with torch.no_grad():
        same = torch.equal(switched(True)(q, k, v), switched(False)(q, k, v))
        for _ in range(2):
            switched(True)(q, k, v)  # recorded, checked: later forwards replay (backwards: in the first samples)
    return {name: step_fn(call, q, k, v, dout, {}, train) for name, call in calls.items()}, same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=15)
    args = ap.parse_args()
    os.environ[ENV_SWITCH] = "1"  # the replay is off by default until it has run on a GPU
    result = {"environment": environment(), "rows": []}
    for label, *shape in CALLS:
        for train in (False, True):
            fns, same = columns(label, *shape, train=train)
            found = {name: [] for name in fns}
            for r in range(args.samples):  # one sample per column per round, the order rotated
                names = list(fns)[r % len(fns):] + list(fns)[:r % len(fns)]
                for name in names:
                    found[name].append(split_times(fns[name], samples=1))
            row = {"label": f"{label} {'fwd+bwd' if train else 'fwd'}", "bitwise_equal": same,
                   "columns": {name: {key: statistics.median(s[key] for s in samples)
                                      for key in ("step_ms", "gpu_ms", "host_ms")}
                               for name, samples in found.items()}}
            result["rows"].append(row)
            Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'call':46s} {'same':>5s} " + " ".join(f"{n:>22s}" for n in ("fa4 replay", "fa4 interface",
                                                                            "cudnn frontend", "sdpa")))
    print(f"{'':46s} {'':>5s} " + " ".join(f"{'host / step ms':>22s}" for _ in range(4)))
    for row in result["rows"]:
        cells = []
        for name in ("fa4 replay", "fa4 interface", "cudnn frontend", "sdpa"):
            c = row["columns"].get(name)
            cells.append(f"{c['host_ms']:.3f} / {c['step_ms']:.3f}" if c else "-")
        print(f"{row['label'][:46]:46s} {str(row['bitwise_equal']):>5s} " + " ".join(f"{x:>22s}" for x in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
