"""Issue 13 on a GPU: attn_implementation="attn_dispatch" against "sdpa" in bf16, padded batches included.

1. Parity: small random-initialised models of each family (Gemma 2 against "eager"), on a causal batch, a
   right-padded batch (training collators), a left-padded batch (generation), a packed row (cu_seq_lens, compared
   with its sequences run apart) and Gemma 2 with its logit softcapping (50.0): logits on real tokens,
   max |diff| / max |ref|, and the engines attn_dispatch's attention calls ran on (from their Decisions; the
   timed steps run the plain attention function, the engines are read in one extra untimed step).
2. The attention alone at a 1B Llama's shapes (16 heads, 8 KV heads, d 128, seq 4096): batch 1 causal, and a
   batch of 4 right-padded to 4096 with lengths drawn in [2048, 4096] (transformers' bool mask, which
   attn_dispatch recognises as 'padding_causal'): transformers' sdpa_attention_forward against ours, forward +
   backward, interleaved call by call; TFLOP/s on the causal case.
3. The 1B-class Llama config (hidden 2048, 16 heads, 8 KV heads, 4 layers, seq 4096): the training step (forward,
   loss, backward into .grad), batch 1 unpadded, batch 4 unpadded, batch 4 padded as in 2 (a new mask per step:
   recognition included), each implementation interleaved on the same model and inputs.
JSON to $OUT/issue13.json; a short table last. One process, ~4-6 minutes on an H100.

    PYTHONPATH=$PWD python3 benchmarks/gpu/check_issue13.py
    CHECK_PARTS=attention_alone,llama_step ...   # those parts alone (parity models and their JIT compiles left out)
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
from attn_dispatch import explain_sdpa, sdpa  # noqa: E402
from attn_dispatch.integrations.transformers import attention_forward, register  # noqa: E402
from attn_dispatch.policy.timing import TimerSettings, time_interleaved  # noqa: E402

DEVICE = os.environ.get("CHECK_DEVICE", "cuda")  # cpu: a smoke run of the parity part
OUT = Path(os.environ.get("OUT", "/tmp")) / "issue13.json"
SETTINGS = TimerSettings(warmup=2, reps=10, max_reps=60, target_ms=300.0, warm_ms=200.0)
TINY = dict(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, head_dim=64)
SEQ, PADDED_BATCH = 4096, 4
result: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
                "transformers": transformers.__version__, "cudnn": torch.backends.cudnn.version(),
                "parity": [], "attention": {}, "llama_1b_step": {}, "errors": {}}


def save() -> None:
    OUT.write_text(json.dumps(result, indent=1))


SEEN: dict[str, set] = {}  # engine -> mask type/format of every attention call since the last clear
RECORDING = [True]  # off while timing: the timed steps run attention_forward and nothing more


def recording_forward(module, *args, **kwargs):
    """attention_forward, noting the engine each call ran on (its module's last Decision)."""
    out = attention_forward(module, *args, **kwargs)
    for m in sdpa._MODULES.values() if RECORDING[0] else ():
        d = m.last_decision
        if d is not None:
            SEEN.setdefault(d.chosen, set()).add(f"{d.params['attn_mask_type']}/{d.params['qkv_format']}")
    return out


def engines_used() -> dict[str, list[str]]:
    used = {k: sorted(v) for k, v in SEEN.items()}
    SEEN.clear()
    return used


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
        "gemma2_softcap": (t.Gemma2Config(**TINY, attn_logit_softcapping=50.0, final_logit_softcapping=None,
                                          sliding_window=48), t.Gemma2ForCausalLM, "eager"),
    }


def batches(ids: torch.Tensor) -> dict:
    right, left = torch.ones_like(ids), torch.ones_like(ids)
    right[1, 90:] = 0
    left[1, :20] = 0
    lens = [40, 57, 31]
    cu = torch.tensor([0, 40, 97, 128], dtype=torch.int32, device=ids.device)
    packed = dict(input_ids=ids[:1], position_ids=torch.cat([torch.arange(n) for n in lens])[None].to(ids.device),
                  cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens))
    return {"causal": dict(input_ids=ids), "right_padded": dict(input_ids=ids, attention_mask=right),
            "left_padded": dict(input_ids=ids, attention_mask=left), "packed": packed}


def logits_of(model, impl: str, batch: dict, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits on real tokens, their reference positions): a packed row's reference runs each sequence apart."""
    model.set_attn_implementation(impl)
    with torch.no_grad():
        if "cu_seq_lens_q" in batch and impl != "attn_dispatch":
            cu = batch["cu_seq_lens_q"].tolist()
            ids = batch["input_ids"]
            return torch.cat([model(input_ids=ids[:, a:b]).logits for a, b in zip(cu, cu[1:])], dim=1)[0].float()
        logits = model(**batch).logits.float()
    mask = batch.get("attention_mask")
    return logits[mask.bool()] if mask is not None else logits.flatten(0, 1)


def parity() -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (2, 128), generator=g).to(DEVICE)
    for name, (config, cls, reference) in families().items():
        for batch_name, batch in batches(ids).items():
            if name == "gemma2_softcap" and batch_name == "packed":
                continue
            try:
                torch.manual_seed(0)
                model = cls(config).to(DEVICE, torch.bfloat16).eval()
                ref = logits_of(model, reference, batch, name)
                sdpa._MODULES.clear()
                SEEN.clear()
                got = logits_of(model, "attn_dispatch", batch, name)
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                result["parity"].append({"family": name, "batch": batch_name, "reference": reference, "rel_err": err,
                                         "ok": err <= 5e-2, "engines": engines_used()})
            except Exception:  # noqa: BLE001 - recorded, the rest goes on
                result["errors"][f"parity {name} {batch_name}"] = traceback.format_exc()[-1500:]
            save()


def padded_lengths(g: torch.Generator) -> torch.Tensor:
    lens = torch.randint(SEQ // 2, SEQ + 1, (PADDED_BATCH,), generator=g)
    lens[0] = SEQ  # padded to the longest, as a collator does
    return lens


def attention_alone() -> None:
    class Layer(torch.nn.Module):
        num_key_value_groups = 2
        is_causal = True

    layer = Layer().train()
    g = torch.Generator(device="cuda").manual_seed(1)
    lens = padded_lengths(torch.Generator().manual_seed(2))
    keep = torch.arange(SEQ).view(1, SEQ) < lens.view(-1, 1)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    padded_mask = (causal[None, None] & keep[:, None, None, :]).cuda()  # what transformers' sdpa_mask builds
    for case, b, mask in (("causal_b1", 1, None), (f"right_padded_b{PADDED_BATCH}", PADDED_BATCH, padded_mask)):
        q = torch.randn(b, 16, SEQ, 128, device="cuda", generator=g).bfloat16().requires_grad_()
        k, v = (torch.randn(b, 8, SEQ, 128, device="cuda", generator=g).bfloat16().requires_grad_() for _ in range(2))
        dout = torch.randn(b, SEQ, 16, 128, device="cuda", generator=g).bfloat16()
        decision = explain_sdpa(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        row = {"engine": decision.chosen, "mask_type": decision.params["attn_mask_type"], "notes": list(decision.notes)}
        if mask is not None:
            row["lengths"] = lens.tolist()

        def step(fn):
            def run() -> None:
                q.grad = k.grad = v.grad = None
                with torch.enable_grad():
                    out, _ = fn(layer, q, k, v, mask, dropout=0.0, scaling=None, is_causal=mask is None)
                    out.backward(dout)
            return run

        timings, errors = time_interleaved({"sdpa": step(sdpa_attention_forward),
                                            "attn_dispatch": step(attention_forward)}, "cuda", SETTINGS)
        row["fwd_bwd_ms"] = {k_: t.median_ms for k_, t in timings.items()}
        if mask is None:
            flops = 4 * 16 * SEQ * SEQ * 128 / 2 * 3.5  # causal, fwd + bwd (bwd counted as 2.5x fwd)
            row["tflops"] = {k_: flops / (t.median_ms * 1e9) for k_, t in timings.items()}
        result["attention"][case] = row
        result["errors"].update({f"attention {case} {k_}": repr(e) for k_, e in errors.items()})
        save()


def llama_step() -> None:
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                                      max_position_embeddings=SEQ)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(DEVICE, torch.bfloat16).train()
    lens = padded_lengths(torch.Generator().manual_seed(3))
    for case, b, padded in (("unpadded_b1", 1, False), (f"unpadded_b{PADDED_BATCH}", PADDED_BATCH, False),
                            (f"right_padded_b{PADDED_BATCH}", PADDED_BATCH, True)):
        ids = torch.randint(0, 32000, (b, SEQ), device="cuda")
        batch = dict(input_ids=ids, labels=ids)
        if padded:
            mask = (torch.arange(SEQ).view(1, SEQ) < lens.view(-1, 1)).long().cuda()
            batch.update(attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))

        def step(impl: str):
            def run() -> None:
                model.set_attn_implementation(impl)
                with torch.enable_grad():
                    model.zero_grad(set_to_none=True)
                    model(**batch).loss.backward()
            return run

        try:
            RECORDING[0] = False
            timings, errors = time_interleaved({"sdpa": step("sdpa"), "attn_dispatch": step("attn_dispatch")}, "cuda",
                                               SETTINGS)
            RECORDING[0] = True
            SEEN.clear()
            step("attn_dispatch")()  # once more, untimed: which engines its layers ran on
            result["llama_1b_step"][case] = {"ms": {k: t.median_ms for k, t in timings.items()},
                                             "engines": engines_used(),
                                             **({"lengths": lens.tolist()} if padded else {})}
            result["errors"].update({f"step {case} {k}": repr(e) for k, e in errors.items()})
        except torch.OutOfMemoryError:
            result["errors"][f"step {case}"] = traceback.format_exc()[-800:]
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        save()


def main() -> int:
    register()
    from transformers import AttentionInterface

    AttentionInterface.register("attn_dispatch", recording_forward)  # notes each call's engine (a dict update)
    only = os.environ.get("CHECK_PARTS")  # e.g. "attention_alone,llama_step": rerun those parts alone
    for part in (parity, attention_alone, llama_step):
        if only and part.__name__ not in only.split(","):
            continue
        try:
            part()
        except Exception:  # noqa: BLE001
            result["errors"][part.__name__] = traceback.format_exc()[-2000:]
            save()
    print("\nparity (bf16, logits on real tokens, max|diff|/max|ref|; engines attn_dispatch ran):")
    for row in result["parity"]:
        engines = "; ".join(f"{e}: {','.join(m)}" for e, m in row["engines"].items())
        print(f"  {row['family']:14s} {row['batch']:12s} vs {row['reference']:5s} {row['rel_err']:.4f} "
              f"{'ok' if row['ok'] else 'FAIL'}  [{engines}]")
    print("\nattention alone (fwd+bwd ms, median, interleaved):")
    for case, row in result["attention"].items():
        ms = row.get("fwd_bwd_ms", {})
        ratio = ms["sdpa"] / ms["attn_dispatch"] if {"sdpa", "attn_dispatch"} <= ms.keys() else float("nan")
        print(f"  {case:18s} sdpa {ms.get('sdpa', float('nan')):8.3f}  attn_dispatch "
              f"{ms.get('attn_dispatch', float('nan')):8.3f}  speedup {ratio:.2f}x  [{row['engine']}, "
              f"{row['mask_type']}]")
    print("\n1B Llama training step (ms, median, interleaved):")
    for case, row in result["llama_1b_step"].items():
        ms = row["ms"]
        ratio = ms["sdpa"] / ms["attn_dispatch"] if {"sdpa", "attn_dispatch"} <= ms.keys() else float("nan")
        print(f"  {case:18s} sdpa {ms.get('sdpa', float('nan')):8.2f}  attn_dispatch "
              f"{ms.get('attn_dispatch', float('nan')):8.2f}  speedup {ratio:.2f}x  {row['engines']}")
    for key, err in result["errors"].items():
        print(f"ERROR {key}: {err[-600:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
