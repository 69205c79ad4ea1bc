"""Issue 13: why the 1B Llama training step at batch 1 (unpadded, seq 4096) ran 0.92x "sdpa" while the attention
alone is at parity (0.635 vs 0.633 ms). Times the step for "sdpa", "attn_dispatch", and "attn_dispatch" with its
position_ids packing check off (attn_dispatch.integrations.transformers._packed_offsets reads position_ids on the
host: a device sync per forward); then profiles one step of each: device syncs / device-to-host copies, the GPU
time of the step's kernels (attention kernels apart), and the host time of the step.
JSON to $OUT/issue13_b1.json; a table last. ~1-2 minutes.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from attn_dispatch.integrations import transformers as hf_glue  # noqa: E402
from attn_dispatch.policy.timing import TimerSettings, time_interleaved  # noqa: E402

SEQ = 4096


def main() -> int:
    hf_glue.register()
    from transformers import AttentionInterface

    original = hf_glue._packed_offsets

    def no_position_check(query, key, attention_mask, kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k != "position_ids"}
        return original(query, key, attention_mask, kwargs)

    def forward_without_check(*args, **kwargs):
        hf_glue._packed_offsets = no_position_check
        try:
            return hf_glue.attention_forward(*args, **kwargs)
        finally:
            hf_glue._packed_offsets = original

    AttentionInterface.register("attn_dispatch_nocheck", forward_without_check)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).train()
    ids = torch.randint(0, 32000, (1, SEQ), device="cuda")

    def step(impl: str):
        def run() -> None:
            model.set_attn_implementation(impl)
            with torch.enable_grad():
                model.zero_grad(set_to_none=True)
                model(input_ids=ids, labels=ids).loss.backward()
        return run

    impls = ["sdpa", "attn_dispatch", "attn_dispatch_nocheck"]
    settings = TimerSettings(warmup=2, reps=10, max_reps=40, target_ms=300.0, warm_ms=200.0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "transformers": transformers.__version__, "timings": [], "profile": {}}
    for rnd in range(2):
        timings, errors = time_interleaved({i: step(i) for i in impls}, "cuda", settings)
        result["timings"].append({k: t.median_ms for k, t in timings.items()})
        result.setdefault("errors", {}).update({k: repr(e) for k, e in errors.items()})
    from torch.profiler import ProfilerActivity, profile
    for impl in impls:
        fn = step(impl)
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = prof.key_averages()
        syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                         "cudaEventSynchronize"))
        d2h = sum(e.count for e in events if "Memcpy DtoH" in e.key or e.key == "aten::_local_scalar_dense")
        gpu = sum(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) for e in events
                  if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
        attn = sum(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA and
                   any(s in e.key.lower() for s in ("fmha", "flash", "attention", "sdpa", "cudnn"))) / 1e3
        top = sorted(((e.key, e.count) for e in events if e.key.startswith(("aten::nonzero", "aten::item",
                                                                            "aten::_local_scalar", "cudaStream"))),
                     key=lambda x: -x[1])[:8]
        result["profile"][impl] = {"syncs": syncs, "scalar_reads": d2h, "gpu_kernel_ms": gpu, "attention_kernel_ms": attn,
                                   "sync_ops": top}
    out = Path(os.environ.get("OUT", "/tmp")) / "issue13_b1.json"
    out.write_text(json.dumps(result, indent=1))
    for r in result["timings"]:
        print("step ms:", {k: round(v, 2) for k, v in r.items()},
              "attn_dispatch/sdpa %.3f nocheck/sdpa %.3f" % (r["attn_dispatch"] / r["sdpa"],
                                                           r["attn_dispatch_nocheck"] / r["sdpa"]))
    for impl, p in result["profile"].items():
        print(f"{impl:22s} syncs {p['syncs']:3d} scalar reads {p['scalar_reads']:3d} GPU kernels {p['gpu_kernel_ms']:.2f} ms "
              f"(attention {p['attention_kernel_ms']:.2f}) {p['sync_ops']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
