"""Issue 13 on a GPU: attn_implementation="attn_dispatch" against "sdpa" in bf16.

1. Parity: small random-initialised models of each family (Gemma 2 against "eager"), causal and padded batches:
   logits on real tokens, max |diff| / max |ref|.
2. A 1B-class Llama config (hidden 2048, 16 heads, 8 KV heads, 4 layers, seq 4096, batch 1): the training step
   (forward, loss, backward into .grad) with each implementation, interleaved on the same model and inputs.
3. The attention alone at the shapes that model passes ([1, 16, 4096, 128] queries, 8 KV heads, causal):
   transformers' sdpa_attention_forward against ours, forward + backward, interleaved; TFLOP/s.
JSON to $OUT/issue13.json; a short table last.

    PYTHONPATH=$PWD python3 benchmarks/gpu/check_issue13.py
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from attn_dispatch import explain_sdpa  # noqa: E402
from attn_dispatch.integrations.transformers import attention_forward, register  # noqa: E402
from attn_dispatch.policy.timing import TimerSettings, time_interleaved  # noqa: E402

DEVICE = os.environ.get("CHECK_DEVICE", "cuda")  # cpu: a smoke run of the parity part
OUT = Path(os.environ.get("OUT", "/tmp")) / "issue13.json"
SETTINGS = TimerSettings(warmup=2, reps=10, max_reps=60, target_ms=300.0, warm_ms=200.0)
TINY = dict(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, head_dim=64)
result: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
                "transformers": transformers.__version__, "parity": [], "errors": {}}


def save() -> None:
    OUT.write_text(json.dumps(result, indent=1))


def families():
    t = transformers
    return {
        "llama": (t.LlamaConfig(**TINY), t.LlamaForCausalLM, "sdpa"),
        "mistral": (t.MistralConfig(**TINY, sliding_window=48), t.MistralForCausalLM, "sdpa"),
        "qwen2": (t.Qwen2Config(**TINY), t.Qwen2ForCausalLM, "sdpa"),
        "qwen3": (t.Qwen3Config(**TINY), t.Qwen3ForCausalLM, "sdpa"),
        "gemma2": (t.Gemma2Config(**TINY, attn_logit_softcapping=None, final_logit_softcapping=None,
                                  sliding_window=48), t.Gemma2ForCausalLM, "eager"),
        "gemma3": (t.Gemma3TextConfig(**TINY, sliding_window=48), t.Gemma3ForCausalLM, "sdpa"),
    }


def parity() -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (2, 128), generator=g).to(DEVICE)
    padded = torch.ones_like(ids)
    padded[1, :20] = 0
    for name, (config, cls, reference) in families().items():
        for batch, mask in (("causal", None), ("padded", padded)):
            try:
                torch.manual_seed(0)
                model = cls(config).to(DEVICE, torch.bfloat16).eval()
                outs = {}
                for impl in (reference, "attn_dispatch"):
                    model.set_attn_implementation(impl)
                    with torch.no_grad():
                        outs[impl] = model(input_ids=ids, attention_mask=mask).logits.float()
                valid = (mask if mask is not None else torch.ones_like(ids)).bool()
                ref, got = outs[reference][valid], outs["attn_dispatch"][valid]
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                result["parity"].append({"family": name, "batch": batch, "reference": reference, "rel_err": err,
                                         "ok": err <= 5e-2})
            except Exception:  # noqa: BLE001 - recorded, the rest goes on
                result["errors"][f"parity {name} {batch}"] = traceback.format_exc()[-1500:]
            save()


def llama_step() -> None:
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                                      max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(DEVICE, torch.bfloat16).train()
    ids = torch.randint(0, 32000, (1, 4096), device="cuda")

    def step(impl: str):
        def run() -> None:
            model.set_attn_implementation(impl)
            with torch.enable_grad():
                model.zero_grad(set_to_none=True)
                model(input_ids=ids, labels=ids).loss.backward()
        return run

    timings, errors = time_interleaved({"sdpa": step("sdpa"), "attn_dispatch": step("attn_dispatch")}, "cuda",
                                       SETTINGS)
    result["llama_1b_step_ms"] = {k: t.median_ms for k, t in timings.items()}
    result["errors"].update({f"step {k}": repr(e) for k, e in errors.items()})
    save()


def attention_alone() -> None:
    class Layer(torch.nn.Module):
        num_key_value_groups = 2
        is_causal = True

    layer = Layer().train()
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, 16, 4096, 128, device="cuda", generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(1, 8, 4096, 128, device="cuda", generator=g).bfloat16().requires_grad_() for _ in range(2))
    dout = torch.randn(1, 4096, 16, 128, device="cuda", generator=g).bfloat16()
    result["attention_engine"] = explain_sdpa(q, k, v, is_causal=True, enable_gqa=True).chosen

    def step(fn):
        def run() -> None:
            q.grad = k.grad = v.grad = None
            with torch.enable_grad():
                out, _ = fn(layer, q, k, v, None, dropout=0.0, scaling=None, is_causal=True)
                out.backward(dout)
        return run

    timings, errors = time_interleaved({"sdpa": step(sdpa_attention_forward), "attn_dispatch": step(attention_forward)},
                                       "cuda", SETTINGS)
    flops = 4 * 16 * 4096 * 4096 * 128 / 2 * 3.5  # causal, fwd + bwd (bwd counted as 2.5x fwd)
    result["attention_fwd_bwd_ms"] = {k: t.median_ms for k, t in timings.items()}
    result["attention_tflops"] = {k: flops / (t.median_ms * 1e9) for k, t in timings.items()}
    result["errors"].update({f"attention {k}": repr(e) for k, e in errors.items()})
    save()


def main() -> int:
    register()
    for part in (parity, attention_alone, llama_step):
        try:
            part()
        except Exception:  # noqa: BLE001
            result["errors"][part.__name__] = traceback.format_exc()[-2000:]
            save()
    print("\nparity (bf16, logits on real tokens, max|diff|/max|ref|):")
    for row in result["parity"]:
        print(f"  {row['family']:8s} {row['batch']:7s} vs {row['reference']:5s} {row['rel_err']:.4f} "
              f"{'ok' if row['ok'] else 'FAIL'}")
    for key in ("attention_engine", "attention_fwd_bwd_ms", "attention_tflops", "llama_1b_step_ms"):
        print(f"{key}: {result.get(key)}")
    for key, err in result["errors"].items():
        print(f"ERROR {key}: {err[-600:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
