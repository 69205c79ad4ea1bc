"""Where a greedy decode step's attention call spends host time, through transformers: attn_implementation
"attn_dispatch" against "eager" and "sdpa" on a left-padded batch generating with a KV cache (transformers' own
generate()), a Llama-shaped model with random weights (16 query / 8 key-value heads, 8 layers).

Per implementation, timed over interleaved rounds: the decode step (ms between successive forwards of generate(),
the prefill left out); the host time of an attention call of a decode step (perf_counter around transformers'
attention function, nothing synchronised: what the caller's thread spends, launches included), over all calls,
over each step's first layer (what is done once per step: a new mask's bias, a plan for a new key length) and over
the others. Per call, from untimed generations: the Python functions called (a profile hook: a count the machine's
load leaves alone) and the tensor ops dispatched (a TorchDispatchMode): copies, allocations, and host reads of
device values (aten::_local_scalar_dense, nonzero, equal, a device-to-host copy), each a sync on a GPU.

attn_dispatch runs once per reading of a decode step's mask, the integration's choice fixed per run: as given (an
'arbitrary' mask: mem_efficient:torch on a GPU) and as a padding pattern (thd views with offsets: cuDNN's thd call
with cudnn-frontend, FlexAttention on stock torch). On CUDA everything runs as it is. On the CPU, where neither GPU
engine runs, what the integration hands them is kept and the engine stood in for the decode steps:
- as given: mem_efficient:torch's own code, its CUDA-only op registered for the CPU by this script (the op's
  contract, computed by torch's CPU SDPA on the same bias);
- as a padding pattern: the CPU's own engine on the thd call.
The tokens are compared with eager's on an untimed generation that computes them. While timing and counting on the
CPU, the attention kernels of sdpa (torch's SDPA) and of attn_dispatch's stood-in engines return an uninitialised
output at once, so that a call's figures are its host path around the kernel (sdpa's is then a lower bound: torch
SDPA's own C++ work around its kernel is left out; the stood-in op's Python registration adds to attn_dispatch's).
On the CPU, `--platforms` also times selection's answer for a decode step with a key length it has not seen, on
described GPU platforms (each step's first layer asks it).

    PYTHONPATH=. python benchmarks/bench_decode_host.py --device cpu --out /tmp/decode_host_cpu.json
    PYTHONPATH=. python benchmarks/bench_decode_host.py --device cuda --out $OUT/decode_host_h200.json
    PYTHONPATH=. python benchmarks/bench_decode_host.py --device cpu --profile   # plus cProfile of attn_dispatch

On 2 shared cores (torch 2.13 CPU, transformers 5.24; the tiny model: hidden 128, head_dim 8, 8 prompts of up to 64
tokens, 32 new), a decode step's attention call with the mask as given (the step's later layers, host us, medians of
interleaved runs; sdpa's call in the same run beside it), before -> after the decode-path changes: 598-698 (sdpa
94-116) -> 340-403 (sdpa 85-87); per call 26.9 -> 14.8 tensor ops, 2 -> 0 copies (the keys' and values' repeat per
query head), 2.1 -> 1.25 allocations, 142 -> 125 Python calls (sdpa: 7 ops, 32 calls), no host read before or
after. A new decision for a decode step on a described H200: 0.8-2.1 ms here, once per step.

Each timed or counted generation starts with the modules' plans forgotten (selection's answers kept), as a user's
generation of new lengths does; the tiny model's prompts are 160 tokens, so that its steps, like the GPU model's,
cross more than 128 keys and are decided per 128. Same machine, same script, before -> after a step reuses its
key-length bucket's plan and the SDPA function keeps a bool mask's translation for the step's later layers (mask as
given; sdpa beside it 107 -> 100): host us per call (mean) 452 -> 350, each step's first layer 864 -> 614, the
others 367 -> 305; Python calls per call 169 -> 100; ops 14.8 -> 15.1 (a step's first layer cuts three views to
find its bucket); no copies, no host reads. Then, a step's later layers run mem_efficient's call bound to the step's
mask (the first layer binds and runs it): six paired runs each, medians (range), before -> after: host us per call
(mean) 394 (320-439) -> 296 (244-335), the others 326 (251-377) -> 216 (167-275), each step's first layer 635 ->
627 (unchanged within the noise); sdpa beside them 119 -> 115; Python calls per call 100 -> 68, ops 15.1 -> 9.0.
On CUDA a reading whose engine is compiled (FlexAttention on stock torch) refuses the op counter's dispatch mode:
its ops are reported uncounted, with the reason.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import datetime
import io
import json
import platform as py_platform
import pstats
import statistics
import sys
import time
from contextlib import contextmanager
from importlib import metadata

import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode

from attn_dispatch import Platform, backends, sdpa, selection, tensor_cache
from attn_dispatch.backends.base import Engine, FwdResult
from attn_dispatch.integrations import transformers as glue

READINGS = ("as_given", "as_padding")
STAND_IN_PROVIDER = "unfused:pytorch"  # what the CPU picks for both readings; its instance is stood in
HOST_READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.equal", "device_to_host")
HOST_READ_METHODS = ("item", "tolist", "equal", "nonzero", "cpu", "numpy")


# ------------------------------------------------------------------------------------------------
# Counting what one attention call dispatches
# ------------------------------------------------------------------------------------------------
class OpCounter(TorchDispatchMode):
    """Counts aten ops by overload packet name; a copy whose result is on the CPU from a CUDA input counts as
    device_to_host too. A higher-order op (FlexAttention's flex_attention, which the padding reading's engine runs on
    stock torch) counts once under its own name and runs as it would without the counter: torch hands it here with
    this mode already popped (supports_higher_order_operators), so the ops inside it are not counted."""

    supports_higher_order_operators = True  # else torch refuses a higher-order op under this mode

    def __init__(self, python: bool = False):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.active, self.python = False, python

    def python_call(self, frame, event, arg):
        """sys.setprofile's hook: Python functions and builtins called (a count the machine's load leaves alone), and
        the calls of tensor methods that read values back (on the CPU no copy shows them to the dispatch mode)."""
        if event in ("call", "c_call"):
            self.counts["python_calls"] += 1
            if event == "c_call" and getattr(arg, "__name__", None) in HOST_READ_METHODS:
                self.counts["host_read_calls"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(func, HigherOrderOperator):
            if self.active:
                self.counts[f"hop.{func.name()}"] += 1
            return out
        if self.active:
            name = str(func.overloadpacket)
            self.counts[name] += 1
            if name in ("aten._to_copy", "aten.copy_") and isinstance(out, torch.Tensor) and out.device.type == "cpu":
                if any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
                    self.counts["device_to_host"] += 1
        return out


def summarise(counts: collections.Counter, calls: int, not_counted: str | None = None) -> dict:
    """Per call: ops, Python calls, host reads, copies, allocations; not_counted (why the ops went uncounted): the
    op figures None, the host reads those the profile hook saw."""
    per = {name: n / calls for name, n in counts.items()}
    allocating = ("aten.empty", "aten.empty_strided", "aten.empty_like", "aten.new_empty", "aten.zeros",
                  "aten.new_zeros", "aten.full", "aten.clone", "aten._to_copy", "aten.contiguous")
    python_calls, read_calls = per.pop("python_calls", 0.0), per.pop("host_read_calls", 0.0)
    if not_counted is not None:
        return {"ops": None, "python_calls": python_calls, "host_reads": read_calls, "copies": None,
                "allocations": None, "by_op": {}, "ops_not_counted": not_counted}
    return {"ops": sum(per.values()), "python_calls": python_calls,
            "host_reads": max(sum(per.get(n, 0.0) for n in HOST_READS), read_calls),
            "copies": per.get("aten.copy_", 0.0) + per.get("aten.clone", 0.0) + per.get("aten._to_copy", 0.0),
            "allocations": sum(per.get(n, 0.0) for n in allocating),
            "by_op": dict(sorted(((n, round(c, 3)) for n, c in per.items()), key=lambda x: -x[1]))}


# ------------------------------------------------------------------------------------------------
# CPU stand-ins for the GPU engines
# ------------------------------------------------------------------------------------------------
_SDPA = torch.nn.functional.scaled_dot_product_attention
_STUB_KERNELS = [False]  # while timing on the CPU: the attention kernels of sdpa and attn_dispatch return at once


def _efficient_op_on_cpu(q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False, *, scale=None):
    """aten::_scaled_dot_product_efficient_attention's contract, forward only: [b, h, sq, d] in, (out in the op's
    [b, sq, h, d_v] memory order, lse with rows padded to 32, seed, offset); computed by torch's CPU SDPA (the lse
    left uncomputed: a decode step without gradients reads none), or nothing computed while kernels are stubbed."""
    b, h, sq, _ = q.shape
    out = q.new_empty(b, sq, h, v.shape[-1]).transpose(1, 2)
    if not _STUB_KERNELS[0]:
        out.copy_(_SDPA(q, k, v, attn_mask=bias, is_causal=is_causal, scale=scale))
    lse = q.new_empty(b, h, -(-sq // 32) * 32 if compute_lse else 0, dtype=torch.float32)
    return out, lse, q.new_empty((), dtype=torch.int64), q.new_empty((), dtype=torch.int64)


def _sdpa_stub(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query.new_empty(query.shape[:-1] + value.shape[-1:])


@contextmanager
def kernels_stubbed(device: torch.device):
    """On the CPU, the attention kernels of sdpa (torch's SDPA) and attn_dispatch (the stood-in engines) return an
    uninitialised output at once, so that what a call's time measures is its host path, which a GPU's host pays
    whatever the kernel (eager's matmuls stay). On CUDA: nothing changes."""
    if device.type != "cpu":
        yield
        return
    _STUB_KERNELS[0] = True
    torch.nn.functional.scaled_dot_product_attention = _sdpa_stub
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = _SDPA
        _STUB_KERNELS[0] = False


class EmptyOutEngine(Engine):
    """An uninitialised output of the call's shape: what is timed is the host path around the engine."""

    family, provider = "unfused", "pytorch"

    def forward(self, q, k, v, aux, cfg) -> FwdResult:
        return FwdResult(q.new_empty(q.shape[:-1] + v.shape[-1:]), None)

    def forward_flat(self, q, k, v, aux, cfg) -> FwdResult:
        return FwdResult(q.new_empty(q.shape[:-2] + (q.shape[-2] * v.shape[-1],)), None)


class DecodeStandIn(Engine):
    """One-query calls (decode steps) go to `decode` (to an empty output while kernels are stubbed, where `decode`
    is None: the CPU's own engine otherwise), the rest (the prefill) to the CPU's own engine."""

    family, provider = "unfused", "pytorch"

    def __init__(self, decode: Engine | None, own: Engine):
        self.decode, self.own, self.empty = decode, own, EmptyOutEngine()

    def __call__(self, q, k, v, aux, cfg, *, flatten_heads: bool = False):
        engine = self.own
        if aux.max_seqlen_q == 1:
            engine = self.decode or (self.empty if _STUB_KERNELS[0] else self.own)
        return engine(q, k, v, aux, cfg, flatten_heads=flatten_heads)

    def bind_fast(self, q, k, v, aux, cfg, layout: str = "merged"):
        """The stood-in GPU engine's bound call for the decode steps' repeats (the CPU's own engine binds none)."""
        if aux.max_seqlen_q != 1 or self.decode is None:
            return None
        return self.decode.bind_fast(q, k, v, aux, cfg, layout)

    def bind_masked(self, q, k, v, aux, cfg):
        """The stood-in GPU engine's bound call with the mask an argument (the layers and steps after the first)."""
        if aux.max_seqlen_q != 1 or self.decode is None:
            return None
        return self.decode.bind_masked(q, k, v, aux, cfg)


@contextmanager
def reading_fixed(reading: str, device: torch.device):
    """The integration reads decode masks as `reading`; on the CPU, the GPU engine of that reading stood in."""
    saved_prefer = glue.prefer_padding_reading
    glue.prefer_padding_reading = lambda as_padding, as_given: reading == "as_padding"
    library = None
    if device.type == "cpu":
        own = backends.get_engine(STAND_IN_PROVIDER)
        if reading == "as_given":
            from attn_dispatch.backends.mem_efficient import MemEfficientEngine
            library = torch.library.Library("aten", "IMPL")
            library.impl("_scaled_dot_product_efficient_attention", _efficient_op_on_cpu, "CPU")
            stand_in = DecodeStandIn(MemEfficientEngine(), own)
        else:
            stand_in = DecodeStandIn(None, own)
        backends._INSTANCES[STAND_IN_PROVIDER] = stand_in
    fresh()
    try:
        yield
    finally:
        glue.prefer_padding_reading = saved_prefer
        if library is not None:
            backends._INSTANCES[STAND_IN_PROVIDER] = own
            library._destroy()
        elif device.type == "cpu":
            backends._INSTANCES[STAND_IN_PROVIDER] = own
        fresh()


def forget_plans() -> None:
    """Before a timed or counted generation: the modules' plans go (selection's answers and the read masks stay),
    so that a generation makes the plans a generation of new lengths makes, as a user's does; the warm-up
    generation before it ran the same lengths and would otherwise leave every step's plan made."""
    for module in sdpa._MODULES.values():
        module._forget_plans()


def fresh() -> None:
    """No plan, module or memo made under another setup."""
    glue._DECODE_READING.clear()
    sdpa._MODULES.clear()
    tensor_cache.clear()
    selection.clear_cache()


# ------------------------------------------------------------------------------------------------
# The model, the prompts, the timed generation
# ------------------------------------------------------------------------------------------------
def build(transformers, device: torch.device, small: bool):
    if small:
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=8,
                                          num_attention_heads=16, num_key_value_heads=8, head_dim=8,
                                          max_position_embeddings=512)
        b, s, new = 8, 160, 32  # more than 128 keys, as the GPU model's 512: steps decided per 128 keys
    else:
        config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                          num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                                          head_dim=128, max_position_embeddings=1024)
        b, s, new = 8, 512, 128
    config.eos_token_id = None  # exactly max_new_tokens per row
    torch.manual_seed(0)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    g = torch.Generator().manual_seed(39)
    ids = torch.randint(1, config.vocab_size, (b, s), generator=g)
    keep = torch.ones(b, s, dtype=torch.long)
    for row in range(b):  # prompt lengths s, 7s/8, ..., s/8: left-padded, as generate() wants
        keep[row, :row * s // b] = 0
    return model, ids.masked_fill(keep == 0, 0).to(device), keep.to(device), new


class Probe:
    """Wraps an attention function: host time of each decode call (one query), wall and this thread's CPU time (on a
    shared machine the latter is what the call itself spent), and op counts when counting."""

    def __init__(self, fn):
        self.fn, self.times, self.cpu_times, self.counter, self.calls = fn, [], [], None, 0

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        decode = query.shape[2] == 1
        counter = self.counter if decode else None
        if counter is not None:
            counter.active = True
            if counter.python:
                sys.setprofile(counter.python_call)
        start, cpu_start = time.perf_counter(), time.thread_time()
        try:
            return self.fn(module, query, key, value, attention_mask, **kwargs)
        finally:
            if decode:
                self.times.append(time.perf_counter() - start)
                self.cpu_times.append(time.thread_time() - cpu_start)
                self.calls += 1
            if counter is not None:
                if counter.python:
                    sys.setprofile(None)
                counter.active = False


def generate(model, impl: str, ids, keep, new: int, step_starts: list | None = None):
    model.set_attn_implementation(impl)
    hook = None
    if step_starts is not None:
        hook = model.model.register_forward_pre_hook(lambda *_: step_starts.append(time.perf_counter()))
    try:
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=keep, max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, pad_token_id=0)
    finally:
        if hook is not None:
            hook.remove()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(transformers, model, ids, keep, new, device, rounds: int, profile: bool) -> dict:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import eager_mask, sdpa_mask
    from transformers.models.llama.modeling_llama import eager_attention_forward

    fns = {"eager": (eager_attention_forward, eager_mask), "sdpa": (sdpa_attention_forward, sdpa_mask)}
    fns.update({f"attn_dispatch_{r}": (glue.attention_forward, sdpa_mask) for r in READINGS})
    probes = {}
    for name, (fn, mask_fn) in fns.items():
        probes[name] = Probe(fn)
        transformers.AttentionInterface.register(f"probe_{name}", probes[name])
        transformers.AttentionMaskInterface.register(f"probe_{name}", mask_fn)
    timings = {name: {"steps": [], "calls": [], "cpu": []} for name in probes}
    names = list(probes)
    outputs, extra = {}, {name: {} for name in probes}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotated: drift hits every implementation
            probe, impl = probes[name], f"probe_{name}"
            reading = name.removeprefix("attn_dispatch_") if name.startswith("attn_dispatch") else None
            with (reading_fixed(reading, device) if reading else _nothing()):
                outputs[name] = generate(model, impl, ids, keep, new)  # warm: plans, memo, allocator
                probe.times.clear()
                probe.cpu_times.clear()
                starts: list = []
                sync(device)
                forget_plans()
                with kernels_stubbed(device):
                    generate(model, impl, ids, keep, new, starts)
                sync(device)
                timings[name]["steps"].extend(b - a for a, b in zip(starts[1:], starts[2:]))  # after the prefill
                timings[name]["calls"].extend(probe.times)
                timings[name]["cpu"].extend(probe.cpu_times)
                if r == 0:  # untimed: the ops dispatched (a dispatch mode), then Python calls made (a profile hook)
                    probe.counter, probe.calls = OpCounter(), 0
                    forget_plans()
                    not_counted = None
                    try:
                        with probe.counter, kernels_stubbed(device):
                            generate(model, impl, ids, keep, new)
                    except Exception as error:  # noqa: BLE001 - a compiled engine refusing to run under the mode
                        # torch.compile runs no frame under a user dispatch mode (FlexAttention's compiled call, the
                        # padding reading's engine on stock torch, raises): this reading's ops go uncounted
                        not_counted = f"{type(error).__name__}: {str(error).strip()[:240]}"
                    counts, calls = probe.counter.counts, probe.calls
                    probe.counter, probe.calls = OpCounter(python=True), 0
                    forget_plans()
                    python_counted = True
                    try:
                        with kernels_stubbed(device):
                            generate(model, impl, ids, keep, new)
                    except Exception as error:  # noqa: BLE001 - a compiled engine under the profile hook: dynamo
                        # leaves traced frames to eager, and eager flex materialises every score
                        python_counted = False
                        not_counted = not_counted or f"{type(error).__name__}: {str(error).strip()[:240]}"
                    if not_counted is not None:
                        counts, calls = collections.Counter(), max(probe.calls, 1)
                    for what in ("python_calls", "host_read_calls"):
                        counts[what] = probe.counter.counts[what] * calls / probe.calls if python_counted else 0
                    extra[name]["per_call"], probe.counter = summarise(counts, calls, not_counted), None
                    if reading:
                        extra[name]["engine"] = engine_of_decode()
                        if profile:
                            extra[name]["profile"] = profiled(model, impl, ids, keep, new)
    results = {}
    layers = model.config.num_hidden_layers
    for name, t in timings.items():
        first = [x for i, x in enumerate(t["calls"]) if i % layers == 0]  # each step's first layer: per-step work
        rest = [x for i, x in enumerate(t["calls"]) if i % layers]
        results[name] = {"decode_step_ms_median": statistics.median(t["steps"]) * 1e3,
                         "attention_call_host_us_median": statistics.median(t["calls"]) * 1e6,
                         "attention_call_thread_cpu_us_median": statistics.median(t["cpu"]) * 1e6,
                         "attention_call_host_us_mean": statistics.mean(t["calls"]) * 1e6,
                         "first_layer_call_host_us_median": statistics.median(first) * 1e6,
                         "other_layers_call_host_us_median": statistics.median(rest) * 1e6,
                         "attention_calls_timed": len(t["calls"]), **extra[name]}
    reference = outputs["eager"]
    for name, out in outputs.items():
        results[name]["tokens_equal_eager"] = bool(torch.equal(out, reference))
    return results


@contextmanager
def _nothing():
    yield


def engine_of_decode() -> str:
    used = {f"{m.last_decision.chosen} ({m.last_decision.params['attn_mask_type']}/"
            f"{m.last_decision.params['qkv_format']})" for m in sdpa._MODULES.values()
            if m.last_decision is not None and m.last_decision.params["max_seqlen_q"] == 1}
    return ", ".join(sorted(used))


def profiled(model, impl, ids, keep, new) -> str:
    prof = cProfile.Profile()
    prof.enable()
    generate(model, impl, ids, keep, new)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats("attn_dispatch|torch/nn/functional", 25)
    print(text.getvalue())
    return text.getvalue()[-6000:]


def new_decision_ms(shape: dict, specs: list[str], steps: int = 20) -> dict:
    """Host time of selection's answer for a decode step whose key length it has not seen (each step's first layer
    asks it: the plan is keyed by the exact shapes), on described GPU platforms, for both readings of the mask; the
    bench's prompt (512) and GQA layout at head_dim 128 in bf16, timed on this machine."""
    from attn_dispatch.params import AttentionParams
    from attn_dispatch.sdpa import explain_sdpa

    b, (h, hk), skv = shape["batch"], shape["heads"], 512 + 1
    q, k = torch.zeros(b, h, 1, 128, dtype=torch.bfloat16), torch.zeros(b, hk, skv, 128, dtype=torch.bfloat16)
    mask = torch.ones(b, 1, 1, skv, dtype=torch.bool)
    for row in range(b):
        mask[row, ..., : row * 512 // b] = False
    result = {}
    for reading in READINGS:
        asked = explain_sdpa(q, k, k, mask, enable_gqa=True, recognize_masks=reading == "as_padding")
        params = AttentionParams(**asked.params).replace(device_type="cuda")
        for spec in specs:
            platform = Platform.parse(spec)
            selection.explain(params, platform)
            start = time.perf_counter()
            for i in range(steps):
                chosen = selection.explain(params.replace(max_seqlen_kv=params.max_seqlen_kv + 1 + i), platform).chosen
            result[f"{reading} {spec}"] = {"ms": (time.perf_counter() - start) / steps * 1e3, "chosen": chosen}
    return result


def environment(device: torch.device) -> dict:
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": py_platform.python_version(), "torch": torch.__version__, "machine": py_platform.node(),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "platform": Platform.detect().describe(), "threads": torch.get_num_threads()}
    for dist in ("transformers", "nvidia-cudnn-frontend", "flash-attn-4"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = "absent"
    return info


def _figure(x: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}.{digits}f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON file to write")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rounds", type=int, default=5, help="timed generations per implementation, "
                        "interleaved")
    parser.add_argument("--profile", action="store_true", help="cProfile attn_dispatch's generations")
    parser.add_argument("--platforms", default="h200-cudnn9;h200-cudnn9,no-cudnn-frontend,no-flash-attn-4",
                        help="--device cpu: described GPU platforms on which a new decode step's decision is timed "
                             "(';'-separated specs; '' skips)")
    args = parser.parse_args()
    import transformers

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here")
    if device.type == "cpu":
        torch.set_num_threads(1)  # a shared machine: one thread keeps the kernels' time steady
    glue.register()
    model, ids, keep, new = build(transformers, device, small=device.type == "cpu")
    shape = {"batch": ids.shape[0], "prompt": ids.shape[1], "new_tokens": new,
             "layers": model.config.num_hidden_layers, "hidden": model.config.hidden_size,
             "heads": [model.config.num_attention_heads, model.config.num_key_value_heads],
             "head_dim": model.config.head_dim, "prompt_lengths": keep.sum(1).tolist()}
    results = measure(transformers, model, ids, keep, new, device, args.rounds, args.profile)
    decisions = new_decision_ms(shape, args.platforms.split(";")) if device.type == "cpu" and args.platforms else {}
    print(f"{'implementation':<26} {'step ms':>8} {'call us':>8} {'1st us':>7} {'rest us':>7} {'py calls':>8} "
          f"{'ops':>6} {'copies':>7} {'allocs':>7} {'reads':>6}  engine / tokens == eager   ({shape})")
    for name, r in results.items():
        c = r["per_call"]
        print(f"{name:<26} {r['decode_step_ms_median']:8.2f} {r['attention_call_host_us_mean']:8.1f} "
              f"{r['first_layer_call_host_us_median']:7.1f} {r['other_layers_call_host_us_median']:7.1f} "
              f"{c['python_calls']:8.1f} "
              f"{_figure(c['ops'], 6, 1)} {_figure(c['copies'], 7, 2)} {_figure(c['allocations'], 7, 2)} "
              f"{c['host_reads']:6.2f}  "
              f"{r.get('engine', '')} {r['tokens_equal_eager']}")
    for name, d in decisions.items():
        print(f"a new decode step's decision, {name}: {d['ms']:.2f} ms ({d['chosen']})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": environment(device), "shape": shape, "results": results,
                       "new_decision_ms": decisions}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
