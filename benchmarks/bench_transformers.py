"""transformers models through attn_implementation="attn_dispatch" against "eager" and "sdpa", random-initialised
from configs (no downloads), bf16 on the GPU:

- training: a padded Gemma 2-shaped batch (attention logit softcapping 50, final logit softcapping 30; transformers
  gives Gemma 2 no SDPA path) and a Llama-shaped model given a custom 4-D mask (a prefix-LM: 256 bidirectional tokens,
  causal after them, with left and right padding; bool for sdpa and attn_dispatch, the same mask as an additive float
  mask for eager, which adds whatever it is given). Parity with eager: the largest |difference| of the logits over
  real tokens, and of every parameter's gradient of the loss (also relative to the largest eager value); then one
  training step (forward, loss, backward) timed per implementation, interleaved over rounds, medians.
- generation: a Llama-shaped model (hidden 2048, 8 layers, 16 query / 8 key-value heads, d 128) greedily generates
  128 new tokens for a batch of 8 left-padded prompts of up to 512 tokens (KV cache, transformers' own generate()):
  new tokens/s per implementation, interleaved over 3 rounds, medians; the tokens against eager's (a random model's
  logits are nearly flat, so a bf16 rounding difference can flip an argmax and the rest of that row follows it: the
  count of differing tokens and each row's first differing step are reported, with the prefill's last-token logits
  difference that says how large the numerical difference is). The engine attn_dispatch ran for the prefill and for a
  decode step (and how it read the decode step's mask) is recorded.

    python benchmarks/bench_transformers.py --out $OUT/bench_transformers.json     # ~3 minutes on an H100
    python benchmarks/bench_transformers.py --device cpu --out /tmp/hf_cpu.json    # the script's plumbing, tiny
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform as py_platform
import statistics
import sys
import time
import traceback
from importlib import metadata

import torch

from attn_dispatch import Platform, selection
from attn_dispatch.integrations import transformers as glue
from attn_dispatch.sdpa import explain_sdpa

IMPLS = ("eager", "sdpa", "attn_dispatch")


def environment(device: torch.device, dtype: torch.dtype) -> dict:
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": py_platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "machine": py_platform.node(), "platform": Platform.detect().describe(), "dtype": str(dtype)}
    for name, dist in (("transformers", "transformers"), ("triton", "triton"),
                       ("cudnn_frontend", "nvidia-cudnn-frontend"), ("flash_attn_4", "flash-attn-4")):
        try:
            info[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[name] = "absent"
    return info


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------
# Training: parity with eager, step time
# ------------------------------------------------------------------------------------------------
def padded_batch(b: int, s: int, vocab: int, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (b, s), generator=g)
    keep = torch.ones(b, s, dtype=torch.long)
    for row in range(1, b):  # odd rows left-padded (generation-style), even rows right-padded (collator-style)
        pad = row * s // (2 * b)
        if row % 2:
            keep[row, :pad] = 0
        else:
            keep[row, s - pad:] = 0
    labels = ids.masked_fill(keep == 0, -100)
    first_real = keep.argmax(1)
    labels[torch.arange(b), first_real] = -100  # predicted from a padded position: eager and SDPA define it apart
    return ids.to(device), keep.to(device), labels.to(device)


def prefix_lm_masks(keep: torch.Tensor, prefix: int, dtype: torch.dtype):
    """[b, 1, s, s]: keys that are real and either in the prefix or not after the query; bool (True = take part)
    and the additive float form eager adds to its scores. Rows that see no key get their diagonal (a padded row
    attends to itself), so every implementation defines them the same way."""
    b, s = keep.shape
    i = torch.arange(s, device=keep.device)
    allowed = (i[None, :] <= i[:, None]) | (i[None, :] < prefix)
    mask = allowed[None, None] & keep.bool()[:, None, None, :]
    mask |= torch.eye(s, dtype=torch.bool, device=keep.device)[None, None] & ~mask.any(-1, keepdim=True)
    additive = torch.zeros(mask.shape, dtype=dtype, device=keep.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return mask, additive


def training_cases(transformers, device, dtype, small: bool) -> dict:
    hidden, layers, heads, kv, d, inter, vocab = (64, 2, 4, 2, 16, 96, 97) if small else \
        (1024, 4, 8, 4, 128, 2816, 32000)
    b, s = (3, 24) if small else (4, 2048)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv, head_dim=d, max_position_embeddings=4 * s)
    gemma = transformers.Gemma2Config(**common, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                      sliding_window=s // 2)
    llama = transformers.LlamaConfig(**common)
    return {
        "gemma2_padded_softcap": (gemma, transformers.Gemma2ForCausalLM, b, s, None),
        "llama_custom_4d_mask": (llama, transformers.LlamaForCausalLM, b, s, s // 8),
    }


def train_step(model, impl: str, ids, keep, labels, masks):
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    mask = keep if masks is None else (masks[1] if impl == "eager" else masks[0])
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out


def run_training(name: str, case, device, dtype, rounds: int, steps: int, seed: int) -> dict:
    config, cls, b, s, prefix = case
    torch.manual_seed(seed)
    model = cls(config).to(device=device, dtype=dtype)
    model.train()
    ids, keep, labels = padded_batch(b, s, config.vocab_size, device, seed)
    masks = prefix_lm_masks(keep, prefix, dtype) if prefix else None
    impls = [i for i in IMPLS if i != "sdpa" or getattr(cls, "_supports_sdpa", True)]
    row = {"case": name, "batch": b, "seq": s, "layers": config.num_hidden_layers, "impls": impls,
           "config": {k: getattr(config, k, None) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                              "head_dim", "attn_logit_softcapping", "sliding_window")}}
    if "sdpa" not in impls:
        row["sdpa"] = f"transformers gives {cls.__name__} no SDPA path (_supports_sdpa = False: no softcapping)"
    results = {}
    for impl in impls:
        out = train_step(model, impl, ids, keep, labels, masks)
        grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
        results[impl] = (out.logits.detach().float(), out.loss.detach().float(), grads)
    ref_logits, ref_loss, ref_grads = results["eager"]
    real = keep.bool()
    parity = {}
    for impl in impls[1:]:
        logits, loss, grads = results[impl]
        grad_diff = {n: (grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads}
        worst = max(grad_diff, key=grad_diff.get)
        parity[impl] = {
            "logits_max_abs_diff": (logits[real] - ref_logits[real]).abs().max().item(),
            "logits_max_abs_eager": ref_logits[real].abs().max().item(),
            "loss": loss.item(), "loss_eager": ref_loss.item(),
            "grad_max_abs_diff": grad_diff[worst], "grad_worst_param": worst,
            "grad_max_abs_eager_of_worst": ref_grads[worst].abs().max().item(),
            "grads_compared": len(grad_diff) if grads.keys() == ref_grads.keys() else "parameter sets differ"}
    row["parity_vs_eager"] = parity
    row["engines"] = engines_used()
    del results
    times = {impl: [] for impl in impls}
    for r in range(rounds):
        for impl in impls[r % len(impls):] + impls[:r % len(impls)]:  # rotate who goes first
            train_step(model, impl, ids, keep, labels, masks)  # warm (a compile, a new plan) outside the clock
            sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                train_step(model, impl, ids, keep, labels, masks)
            sync(device)
            times[impl].append((time.perf_counter() - start) * 1e3 / steps)
    row["step_ms"] = {impl: statistics.median(t) for impl, t in times.items()}
    row["step_ms_rounds"] = times
    row["speedup_vs"] = {impl: row["step_ms"][impl] / row["step_ms"]["attn_dispatch"] for impl in impls[:-1]}
    return row


def engines_used() -> dict:
    """The engines attn_dispatch's SDPA function ran last, per module (mask type, format): 'engine (mask/format)'."""
    from attn_dispatch import sdpa
    used = {}
    for module in sdpa._MODULES.values():
        d = module.last_decision
        if d is not None:
            used[f"{d.params['attn_mask_type']}/{d.params['qkv_format']}"] = d.chosen
    return used


# ------------------------------------------------------------------------------------------------
# Generation: new tokens/s, tokens against eager, the engines of the prefill and a decode step
# ------------------------------------------------------------------------------------------------
def generation_model(transformers, device, dtype, small: bool):
    if small:
        config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          max_position_embeddings=256)
    else:
        config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                          num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                                          head_dim=128, max_position_embeddings=1024)
    config.eos_token_id = None  # generate exactly max_new_tokens per row
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def left_padded_prompts(b: int, s: int, vocab: int, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (b, s), generator=g)
    keep = torch.ones(b, s, dtype=torch.long)
    for row in range(b):  # prompt lengths s, 7s/8, ..., s/8 + ...: left-padded, as generate() wants
        keep[row, :row * s // b] = 0
    ids = ids.masked_fill(keep == 0, 0)
    return ids.to(device), keep.to(device)


def generate(model, impl: str, ids, keep, new_tokens: int):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=keep, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


def generation_engines(transformers, model, ids, keep) -> dict:
    """What attn_dispatch decides for the prefill and for a decode step (the mask's reading included), asked by a
    spy registered beside the integration (one untimed generate of 2 tokens)."""
    seen = {}

    def spy(module, query, key, value, attention_mask, **kwargs):
        step = "prefill" if query.shape[2] > 1 else "decode"
        if step not in seen:  # the first layer of the prefill and of the first decode step
            gqa = key.shape[1] != query.shape[1]
            recognize, reading = True, "padding pattern"
            if step == "decode" and attention_mask is not None:
                recognize = glue._recognise_decode_masks(query, key, value, attention_mask, 0.0,
                                                         kwargs.get("scaling"), gqa, 0.0)
                reading = "padding pattern" if recognize else "as given ('arbitrary')"
            causal = attention_mask is None and query.shape[2] > 1
            d = explain_sdpa(query, key[:, :, :query.shape[2]] if causal else key,
                             value[:, :, :query.shape[2]] if causal else value, attention_mask, is_causal=causal,
                             scale=kwargs.get("scaling"), enable_gqa=gqa, recognize_masks=recognize)
            seen[step] = {"engine": d.chosen, "mask_type": d.params["attn_mask_type"],
                          "format": d.params["qkv_format"], "mask_reading": reading, "why": d.policy_reason,
                          "notes": list(d.notes)}
        return glue.attention_forward(module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register("attn_dispatch_spy", spy)
    transformers.AttentionMaskInterface.register("attn_dispatch_spy", transformers.masking_utils.sdpa_mask)
    generate(model, "attn_dispatch_spy", ids, keep, 2)
    return seen


def run_generation(transformers, device, dtype, small: bool, rounds: int, seed: int) -> dict:
    model = generation_model(transformers, device, dtype, small)
    b, s, new = (3, 12, 6) if small else (8, 512, 128)
    ids, keep = left_padded_prompts(b, s, model.config.vocab_size, device, seed)
    row = {"batch": b, "prompt_max": s, "prompt_lengths": keep.sum(1).tolist(), "new_tokens": new,
           "layers": model.config.num_hidden_layers, "hidden": model.config.hidden_size,
           "heads": [model.config.num_attention_heads, model.config.num_key_value_heads]}
    with torch.no_grad():  # the prefill's last-token logits: how far apart the implementations are numerically
        last = {}
        for impl in IMPLS:
            model.set_attn_implementation(impl)
            last[impl] = model(input_ids=ids, attention_mask=keep).logits[:, -1].float()
    row["prefill_last_logits_max_abs_diff_vs_eager"] = {impl: (last[impl] - last["eager"]).abs().max().item()
                                                        for impl in IMPLS[1:]}
    row["prefill_last_logits_top2_gap_min"] = last["eager"].topk(2).values.diff(dim=-1).abs().min().item()
    row["attn_dispatch_engines"] = generation_engines(transformers, model, ids, keep)
    outputs = {impl: generate(model, impl, ids, keep, new) for impl in IMPLS}  # warm: compiles, plans, cuBLAS
    tokens_s = {impl: [] for impl in IMPLS}
    for r in range(rounds):
        for impl in IMPLS[r % len(IMPLS):] + IMPLS[:r % len(IMPLS)]:
            sync(device)
            start = time.perf_counter()
            out = generate(model, impl, ids, keep, new)
            sync(device)
            tokens_s[impl].append(b * new / (time.perf_counter() - start))
            outputs[impl] = out
    row["new_tokens_per_s"] = {impl: statistics.median(t) for impl, t in tokens_s.items()}
    row["new_tokens_per_s_rounds"] = tokens_s
    ref = outputs["eager"][:, s:]
    tokens = {}
    for impl in IMPLS[1:]:
        differ = outputs[impl][:, s:] != ref
        first = [int(r.nonzero()[0]) if r.any() else None for r in differ]
        tokens[impl] = {"identical": not bool(differ.any()), "differing_tokens": int(differ.sum()),
                        "of": differ.numel(), "first_differing_step_per_row": first}
    row["tokens_vs_eager"] = tokens
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a smoke run of the script (tiny models, float32)")
    parser.add_argument("--parts", default="training,generation", help="comma-separated: training, generation")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians are reported)")
    parser.add_argument("--seed", type=int, default=39)
    args = parser.parse_args()
    import transformers

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here (use --device cpu for a smoke run)")
    small = device.type == "cpu"
    dtype = torch.float32 if small else torch.bfloat16
    glue.register()
    selection.clear_cache()
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    result = {"environment": environment(device, dtype), "training": [], "generation": None, "errors": {}}
    t_start = time.perf_counter()
    if "training" in parts:
        for n, (name, case) in enumerate(training_cases(transformers, device, dtype, small).items()):
            try:
                row = run_training(name, case, device, dtype, args.rounds, 2 if small else 5, args.seed + n)
                result["training"].append(row)
                print(f"{name}: step ms {json.dumps({k: round(v, 2) for k, v in row['step_ms'].items()})}; parity "
                      f"{json.dumps(row['parity_vs_eager'])}; engines {row['engines']}", flush=True)
            except Exception:  # noqa: BLE001 - one failing case must not lose the others
                result["errors"][name] = traceback.format_exc()[-3000:]
                print(f"{name}: failed\n{result['errors'][name]}", file=sys.stderr, flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if "generation" in parts:
        try:
            row = result["generation"] = run_generation(transformers, device, dtype, small, args.rounds, args.seed)
            rates = {k: round(v) for k, v in row["new_tokens_per_s"].items()}
            engines = {k: f"{v['engine']} (mask read {v['mask_reading']})"
                       for k, v in row["attn_dispatch_engines"].items()}
            print(f"generation: new tokens/s {json.dumps(rates)}; tokens vs eager {json.dumps(row['tokens_vs_eager'])}"
                  f"; engines {json.dumps(engines)}", flush=True)
        except Exception:  # noqa: BLE001
            result["errors"]["generation"] = traceback.format_exc()[-3000:]
            print(f"generation: failed\n{result['errors']['generation']}", file=sys.stderr, flush=True)
    result["wall_s"] = time.perf_counter() - t_start
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
