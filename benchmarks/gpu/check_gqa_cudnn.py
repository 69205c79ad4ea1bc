"""Why torch's SDPA beats aten::_scaled_dot_product_cudnn_attention called with GQA k/v at batch 1 (fit-gqa grid):
the same op fed GQA k/v, k/v repeated to the query heads, and SDPA (enable_gqa), fwd and fwd+bwd, interleaved."""
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
from attn_dispatch.policy.timing import TimerSettings, time_interleaved  # noqa: E402

OP = torch.ops.aten._scaled_dot_product_cudnn_attention
rows = []
for b, h, hkv, s in ((1, 16, 8, 4096), (1, 16, 8, 2048), (2, 16, 8, 4096), (1, 32, 8, 4096), (1, 32, 4, 8192)):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, h, s, 128, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, hkv, s, 128, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    dout = torch.randn(b, h, s, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    rep = h // hkv

    def gqa():
        return OP(q, k, v, None, True, 0.0, True, False)[0]

    def repeated():
        return OP(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), None, True, 0.0, True, False)[0]

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    fns = {}
    for name, fn in (("gqa", gqa), ("repeated", repeated), ("sdpa", sdpa)):
        fns[name + "_fwd"] = (lambda fn=fn: torch.no_grad()(fn)())
        fns[name + "_step"] = (lambda fn=fn: fn().backward(dout))
    t, err = time_interleaved(fns, "cuda", TimerSettings(warmup=2, reps=15, max_reps=60, target_ms=200.0, warm_ms=100.0))
    row = {"b": b, "h": h, "hkv": hkv, "s": s, **{n: round(x.median_ms, 4) for n, x in t.items()},
           "errors": {n: repr(e)[:200] for n, e in err.items()}}
    rows.append(row)
    print(row, flush=True)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(dout)
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "gqa_cudnn_h100.json"), "w"), indent=1)
