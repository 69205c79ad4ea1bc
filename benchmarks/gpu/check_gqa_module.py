"""The module's cudnn_fused:torch path against the same aten op called on the same bshd views, and SDPA, at batch 1
GQA (fit-gqa: module 0.332 ms vs SDPA 0.248 forward): times, and the kernels each path launches."""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
from attn_dispatch import DotProductAttention  # noqa: E402
from attn_dispatch.policy.timing import TimerSettings, time_interleaved  # noqa: E402

OP = torch.ops.aten._scaled_dot_product_cudnn_attention
b, h, hkv, s, d = 1, 16, 8, 4096, 128
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(b, s, h, d, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(b, s, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2))
mods = {p: DotProductAttention(h, d, num_gqa_groups=hkv, qkv_format="bshd", attn_mask_type="causal", backend=p)
        for p in ("cudnn_fused:torch", "cudnn_fused:frontend", "flash_attn_2:torch")}
fns = {p.split(":")[0][:5] + ":" + p.split(":")[1]: (lambda m=m: m(q, k, v)) for p, m in mods.items()}
fns["raw_op_bshd_views"] = lambda: OP(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, False, 0.0,
                                      True, False)
fns["sdpa_views"] = lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=True, enable_gqa=True)
t, err = time_interleaved(fns, "cuda", TimerSettings(warmup=3, reps=20, max_reps=80, target_ms=300.0, warm_ms=100.0))
for n, x in t.items():
    print(f"{n:<24} {x.median_ms:.4f} ms")
print({n: repr(e)[:200] for n, e in err.items()})
# fwd+bwd as transformers calls each (the issue-13 check: ours 0.85x sdpa at this shape): [b, h, s, d] inputs
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from attn_dispatch.integrations.transformers import attention_forward  # noqa: E402


class Layer(torch.nn.Module):
    num_key_value_groups = h // hkv
    is_causal = True


layer = Layer().train()
qh = torch.randn(b, h, s, d, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
kh, vh = (torch.randn(b, hkv, s, d, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
          for _ in range(2))
dout = torch.randn(b, s, h, d, device="cuda", generator=g, dtype=torch.bfloat16)


def step(fn):
    def run():
        with torch.enable_grad():
            out, _ = fn(layer, qh, kh, vh, None, dropout=0.0, scaling=None, is_causal=True)
            out.backward(dout)
    return run


def step_raw():
    with torch.enable_grad():
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        o.transpose(1, 2).contiguous().backward(dout)


t, err = time_interleaved({"hf_sdpa": step(sdpa_attention_forward), "hf_ours": step(attention_forward),
                           "F.sdpa": step_raw}, "cuda",
                          TimerSettings(warmup=3, reps=20, max_reps=80, target_ms=300.0, warm_ms=100.0))
print({n: round(x.median_ms, 4) for n, x in t.items()}, {n: repr(e)[:200] for n, e in err.items()})
for name, fn in (("hf_ours", step(attention_forward)), ("hf_sdpa", step(sdpa_attention_forward))):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    print("==", name)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=70))
for name in ("cudnn:torch", "raw_op_bshd_views", "sdpa_views"):
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                             torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            fns[name]()
        torch.cuda.synchronize()
    print("==", name)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6, max_name_column_width=60))
