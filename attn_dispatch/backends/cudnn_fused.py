"""cuDNN fused attention engines: cudnn-frontend graphs (CudnnFrontendEngine) and torch's cuDNN op (TorchCudnnEngine).

CudnnFrontendEngine builds one cudnn-frontend SDPA graph per configuration (forward with stats, backward),
caches it on a key of everything the graph bakes in (shapes, strides, dtype, mask, window, bias, dropout,
scale, device), keeps one cuDNN handle per device (re-pointed at a new stream only when the stream changes) and
one grow-only workspace per (device, stream). Layouts travel as strides: q/k/v are described to cuDNN as
[b, h, s, d] views of the caller's bshd/sbhd tensors (no copies); thd goes through ragged offsets
(cu_seqlens_padded x token stride) and sequence-length tensors, with the softmax stats ragged too (cuDNN >= 9.6).

The cached call path is lean: a call signature seen before (dense bshd/sbhd without padding, bias, ALiBi or a
learnable sink: the common training call) is looked up on a tuple of shapes, strides, dtypes and the config's
identity, its outputs are allocated, and the data pointers go straight to the backend's raw execute
(_cudnn_graph.py). Everything else takes the general path: validate, derive the graph key, look the graph up.
The first training call of a configuration also builds the backward graph, so that a graph cuDNN refuses is
reported by the forward (CudnnGraphError, recorded for the table's `cudnn_rejected` check), not by backward.

Conventions (backends/base.py): lse is cuDNN's natural-log stats ([b, h, s, 1] -> [b, h, s]; thd: the
ragged [t, h] stats returned as an [h, t] view). Rows of padding tokens get output 0 and lse -inf.
Masks follow Transformer Engine (constraints.cudnn_fused.diagonal_band, shared with the table).

`cudnn` is imported when an engine is constructed, never at module import (the tables import on any box).
"""
from __future__ import annotations

import dataclasses
import math
import threading
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..constraints.cudnn_common import graph_bucket, rejection_signature
from ..constraints.cudnn_fused import diagonal_band
from ..runtime_facts import record_rejection
from ..env import PRIVATE_TORCH
from ..params import TOP_LEFT_MASKS
from ..tensor_cache import cached_on, capturing
from . import _torch_native
from ._cudnn_graph import EXECUTE_PATHS, Compiled, CudnnGraphError, GraphBuilder, SdpaKey
from .base import AttnAux, AttnConfig, BwdResult, Engine, FwdResult, KVCacheView, _thd_positions
from ..params import AttentionParams

__all__ = ["CudnnFrontendEngine", "CudnnGraphError", "SdpaKey", "TorchCudnnEngine", "alibi_bias",
           "alibi_default_slopes", "bhsd"]

IO_DTYPES = (torch.float16, torch.bfloat16)
GRAPH_CACHE_SIZE = 512
FAST_CACHE_SIZE = 256


# The CUDA touch points, in one place (tests run the engine's plumbing on the CPU through a stand-in cudnn).
def _on_device(device: int):
    return torch.cuda.device(device)


def _current_device() -> int:
    return torch.cuda.current_device()


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None) if PRIVATE_TORCH else None


def _stream(device: int) -> int:
    """The current stream's cudaStream_t: torch's C accessor (no Stream object) where present."""
    return _RAW_STREAM(device) if _RAW_STREAM is not None else torch.cuda.current_stream(device).cuda_stream


def _empty_workspace(size: int, device: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", device))


def _require_cuda(q: torch.Tensor) -> None:
    if not q.is_cuda:
        raise ValueError(f"q is on {q.device}; cuDNN fused attention needs CUDA tensors")


class _DeviceState:
    """One cuDNN handle per device, its current stream, and a grow-only workspace per stream."""
    def __init__(self, cudnn: Any, device: int):
        with _on_device(device):
            self.handle = cudnn.create_handle()
        self.backend = getattr(self.handle, "backend_handle", None)  # the raw cudnnHandle_t (frontend >= 1.3x)
        self.stream: int | None = None
        self.workspaces: dict[int, torch.Tensor] = {}

    def bind(self, cudnn: Any, stream: int) -> None:
        if stream != self.stream:  # cudnnSetStream is not free: only on a change
            cudnn.set_stream(handle=self.handle, stream=stream)
            self.stream = stream

    def workspace(self, stream: int, size: int, device: int) -> torch.Tensor:
        ws = self.workspaces.get(stream)
        if ws is None or ws.numel() < size:
            ws = _empty_workspace(max(size, 1), device)
            self.workspaces[stream] = ws
        return ws


# --------------------------------------------------------------------------------------------
# Shapes and layouts
# --------------------------------------------------------------------------------------------
def bhsd(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """A [b, h, s, d] view of a bshd/sbhd tensor (no copy)."""
    if fmt == "bshd":
        return x.permute(0, 2, 1, 3)
    if fmt == "sbhd":
        return x.permute(1, 2, 0, 3)
    raise ValueError(f"qkv_format={fmt!r} has no dense [b, h, s, d] view; expected 'bshd' or 'sbhd'")


def _seq_dim(fmt: str) -> int:
    return 1 if fmt == "bshd" else 0


_bucket = graph_bucket  # the thd graph's S extent (shared with the table)


def _lens(cu: torch.Tensor) -> torch.Tensor:
    return (cu[1:] - cu[:-1]).to(torch.int32)


def _cached_lens(cu: torch.Tensor, fresh: bool = False) -> torch.Tensor:
    """int32 [b, 1, 1, 1] sequence lengths of a cu_seqlens tensor, made once per tensor and version (every layer
    of a model passes the same one); fresh: made now (a CUDA graph capture, see tensor_cache)."""
    if fresh:
        return _lens(cu).view(-1, 1, 1, 1)
    return cached_on((cu,), ("cudnn_lens",), lambda: _lens(cu).view(-1, 1, 1, 1))


def _ragged_offsets(cu: torch.Tensor, itype: torch.dtype, stride: int, fresh: bool = False) -> torch.Tensor:
    """cuDNN's ragged offsets [b + 1, 1, 1, 1]: where each sequence starts, in elements (cu x token stride)."""
    if fresh:
        return (cu.to(itype) * stride).view(-1, 1, 1, 1)
    return cached_on((cu,), ("cudnn_ragged", itype, stride), lambda: (cu.to(itype) * stride).view(-1, 1, 1, 1))


def _thd_buffer(like: torch.Tensor | None, shape: tuple, dtype: torch.dtype, device: torch.device, end: int | None,
                gaps: bool, value: float) -> torch.Tensor:
    """A thd output (or gradient) buffer whose rows outside every sequence hold value: cuDNN writes only the
    sequences' rows. Whole-buffer fill with gaps between sequences or an unknown end, else only a tail past end."""
    if gaps or end is None:
        if like is not None:
            return torch.full_like(like, value)
        return torch.full(shape, value, dtype=dtype, device=device)
    buf = torch.empty_like(like) if like is not None else torch.empty(shape, dtype=dtype, device=device)
    if end < buf.shape[0]:
        buf[end:].fill_(value)
    return buf


def _check_cu(name: str, cu: torch.Tensor | None, b: int | None, device: torch.device) -> torch.Tensor:
    if cu is None:
        raise ValueError(f"{name} is required for this call (thd format or a padding mask); got None")
    if cu.dim() != 1 or (b is not None and cu.numel() != b + 1):
        raise ValueError(f"{name} must be a 1-D int32 tensor of batch+1 offsets{f' ({b + 1})' if b else ''}; "
                         f"got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device}; it must be on {device} with q, k, v")
    return cu


def _lens_from_mask(mask: torch.Tensor, b: int, sq: int, skv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence lengths from a padding-style boolean mask (True = masked out): [b, 1, 1, skv] (kv padding, queries
    padded alike when sq == skv) or [b, 1, sq, skv] (rows/columns that keep any key)."""
    if mask.dim() != 4 or mask.shape[0] != b or mask.shape[-1] != skv or mask.shape[1] != 1:
        raise ValueError(f"attention_mask of shape {tuple(mask.shape)} is not a padding mask for b={b}, skv={skv}; "
                         "give cu_seqlens_q/cu_seqlens_kv, or a bool [b, 1, 1, skv] / [b, 1, sq, skv] mask")
    keep = ~mask[:, 0]
    if mask.shape[2] == 1:
        kv = keep[:, 0].sum(-1)
        if sq != skv:
            raise ValueError("a [b, 1, 1, skv] padding mask gives no query lengths when sq != skv; "
                             "give cu_seqlens_q and cu_seqlens_kv")
        return kv.to(torch.int32), kv.to(torch.int32)
    if mask.shape[2] != sq:
        raise ValueError(f"attention_mask of shape {tuple(mask.shape)} does not match sq={sq}")
    return keep.any(-1).sum(-1).to(torch.int32), keep.any(-2).sum(-1).to(torch.int32)


def alibi_default_slopes(h: int) -> torch.Tensor:
    """The standard ALiBi slopes for h heads (the ones cuDNN's built-in ALiBi uses), float32 [h]."""
    n = 2 ** math.floor(math.log2(h))
    slopes = [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    if n < h:
        slopes += [2.0 ** (-4.0 * (2 * i + 1) / n) for i in range(h - n)]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(slopes: torch.Tensor, sq: int, skv: int, top_left: bool, dtype: torch.dtype) -> torch.Tensor:
    """-slope * |i + off - j| as a post-scale bias [1|b, h, sq, skv] (off = 0 top-left, skv - sq bottom-right)."""
    off = 0 if top_left else skv - sq
    i = torch.arange(sq, device=slopes.device, dtype=torch.float32).view(sq, 1)
    j = torch.arange(skv, device=slopes.device, dtype=torch.float32).view(1, skv)
    dist = (i + off - j).abs()
    s = slopes.float()
    s = s.view(1, -1, 1, 1) if s.dim() == 1 else s.view(s.shape[0], s.shape[1], 1, 1)
    return (-s * dist).to(dtype)


# --------------------------------------------------------------------------------------------
# Per-call preparation shared by forward and backward
# --------------------------------------------------------------------------------------------
@dataclass
class _Call:
    """Shapes, views and small tensors of one call, in cuDNN's [b, h, s, d] terms."""
    fmt: str
    b: int
    h: int
    hkv: int
    sq: int
    skv: int
    dqk: int
    dv: int
    padding: bool
    lens_q: torch.Tensor | None = None     # int32 [b]
    lens_kv: torch.Tensor | None = None
    cu_q_pad: torch.Tensor | None = None   # thd: where each sequence starts
    cu_kv_pad: torch.Tensor | None = None
    gaps: bool = False                     # thd with padding between sequences: untouched rows exist
    t_q: int = 0
    t_kv: int = 0
    max_q: int = 0                         # the call's real longest sequences (thd: aux.max_seqlen_*)
    max_kv: int = 0
    end_q: int | None = None               # thd: cu_seqlens[-1] where the host knows it (AttnAux.packed)
    end_kv: int | None = None
    capturing: bool = False                # a CUDA graph is captured: nothing derived from cu_seqlens is cached


def _describe(x: torch.Tensor, fmt: str, s_graph: int) -> tuple[tuple, int | None]:
    """[b, h, s, d] strides of a bshd/sbhd tensor, or of a thd tensor (b stride = S * token stride)."""
    if fmt == "thd":
        st, sh, sd = x.stride()
        return (s_graph * st, sh, st, sd), st
    v = bhsd(x, fmt)
    return tuple(v.stride()), None


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux, cfg: AttnConfig,
             io_dtypes: tuple | None = None) -> _Call:
    """The call's shapes and lengths, checked. io_dtypes: what q, k, v may be (the FP8 engine passes FP8 ones for
    inputs it quantized before an all-to-all)."""
    fmt = cfg.qkv_format
    io_dtypes = io_dtypes or IO_DTYPES  # read per call: the CPU tests widen IO_DTYPES
    for name, t in (("q", q), ("k", k), ("v", v)):
        want = 3 if fmt == "thd" else 4
        if t.dim() != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; qkv_format={fmt!r} needs {want} dims")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous head dim (stride(-1) == 1); got strides {t.stride()}")
    if q.dtype not in io_dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v dtypes {q.dtype}, {k.dtype}, {v.dtype}: this cuDNN call takes "
                         f"{' or '.join(str(d).removeprefix('torch.') for d in io_dtypes)}, the same for all three")
    _require_cuda(q)
    h, hkv, dqk, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    if h % hkv:
        raise ValueError(f"q has {h} heads, k/v {hkv}: num_heads must be a multiple of num_gqa_groups")
    mask = cfg.attn_mask_type
    if mask == "arbitrary":
        raise ValueError("attn_mask_type='arbitrary' is not supported by cuDNN fused attention")
    if fmt == "thd":
        cu_q = _check_cu("cu_seqlens_q", aux.cu_seqlens_q, None, q.device)
        b = cu_q.numel() - 1
        cu_kv = _check_cu("cu_seqlens_kv", aux.cu_seqlens_kv, b, q.device)
        if aux.max_seqlen_q <= 0 or aux.max_seqlen_kv <= 0:
            raise ValueError(f"aux.max_seqlen_q={aux.max_seqlen_q}, aux.max_seqlen_kv={aux.max_seqlen_kv}: thd needs "
                             "the longest sequence lengths (positive ints)")
        pad_q = aux.cu_seqlens_q_padded if aux.cu_seqlens_q_padded is not None else cu_q
        pad_kv = aux.cu_seqlens_kv_padded if aux.cu_seqlens_kv_padded is not None else cu_kv
        _check_cu("cu_seqlens_q_padded", pad_q, b, q.device)
        _check_cu("cu_seqlens_kv_padded", pad_kv, b, q.device)
        capture = capturing(q)  # a CUDA graph's replays may see other cu_seqlens contents: no host facts then
        facts = None if capture else aux.packed
        call = _Call(fmt, b, h, hkv, _bucket(aux.max_seqlen_q), _bucket(aux.max_seqlen_kv), dqk, dv, True,
                     _cached_lens(cu_q, capture), _cached_lens(cu_kv, capture), pad_q, pad_kv,
                     gaps=facts is None and (pad_q is not cu_q or pad_kv is not cu_kv),  # facts: packed back to back
                     t_q=q.shape[0], t_kv=k.shape[0], max_q=aux.max_seqlen_q, max_kv=aux.max_seqlen_kv,
                     end_q=None if facts is None else facts.end_q, end_kv=None if facts is None else facts.end_kv,
                     capturing=capture)
        return call
    sd = _seq_dim(fmt)
    b = q.shape[1 - sd]
    call = _Call(fmt, b, h, hkv, q.shape[sd], k.shape[sd], dqk, dv, mask.startswith("padding"),
                 max_q=q.shape[sd], max_kv=k.shape[sd])
    if call.padding:
        if aux.cu_seqlens_q is not None or aux.cu_seqlens_kv is not None:
            call.capturing = capturing(q)
            call.lens_q = _cached_lens(_check_cu("cu_seqlens_q", aux.cu_seqlens_q, b, q.device), call.capturing).view(b)
            call.lens_kv = _cached_lens(_check_cu("cu_seqlens_kv", aux.cu_seqlens_kv, b, q.device),
                                        call.capturing).view(b)
        elif aux.attention_mask is not None:
            call.lens_q, call.lens_kv = _lens_from_mask(aux.attention_mask, b, call.sq, call.skv)
        else:
            raise ValueError(f"attn_mask_type={mask!r} needs sequence lengths: give cu_seqlens_q/cu_seqlens_kv "
                             "(or a padding attention_mask)")
    return call


def _mask_args(cfg: AttnConfig, call: _Call) -> tuple[str | None, int | None, int | None]:
    """(alignment, left_bound, right_bound) for cuDNN's diagonal band (the table computes the same band)."""
    return diagonal_band(cfg.attn_mask_type, tuple(cfg.window_size), call.sq, call.skv, call.padding)


# --------------------------------------------------------------------------------------------
# Engine 1: cudnn-frontend graphs
# --------------------------------------------------------------------------------------------
@dataclass
class _FastFwd:
    """A forward signature seen before on the lean path (dense, no padding/bias/ALiBi/learnable sink): everything
    but the data pointers is fixed."""
    cfg: AttnConfig
    compiled: Compiled
    key: SdpaKey
    call: _Call
    out_shape: tuple
    flat_out_shape: tuple  # out_shape with heads merged: [..., h * d_v]
    lse_shape: tuple
    dtype: torch.dtype
    device: torch.device
    dev: int
    sink: torch.Tensor | None                # off-by-one: the zero sink logits
    bwd: dict = field(default_factory=dict)  # backward signature -> Compiled


@dataclass
class _FwdState:
    key: SdpaKey
    call: _Call
    bias: torch.Tensor | None       # what cuDNN saw (q dtype)
    bias_grad: bool
    sink: torch.Tensor | None
    seed: torch.Tensor | None       # int64 [2]: Philox seed, offset
    rng_dump: torch.Tensor | None = None
    fast: _FastFwd | None = None


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    """What torch.empty_like(t) would allocate (same strides for dense t), without memory."""
    return torch.empty_like(t, device="meta")


class CudnnFrontendEngine(Engine):
    family = "cudnn_fused"
    provider = "frontend"

    def __init__(self, allow_python_engines: bool = False, execute_path: str = "raw"):
        if execute_path not in EXECUTE_PATHS:
            raise ValueError(f"execute_path={execute_path!r}; expected one of {', '.join(EXECUTE_PATHS)}")
        import cudnn  # noqa: PLC0415 - lazy: the package is optional

        self.cudnn = cudnn
        self.fe_version = tuple(int(x) for x in str(cudnn.__version__).split(".")[:2] if x.isdigit())
        self.cudnn_version = int(cudnn.backend_version())
        self.allow_python_engines = allow_python_engines
        self.execute_path = execute_path
        self._graphs: OrderedDict[SdpaKey, Compiled] = OrderedDict()
        self._failures: dict[SdpaKey, CudnnGraphError] = {}
        self._backward_built: set[tuple] = set()  # forward keys (and backward extras) whose backward graph exists
        self._fast: dict[tuple, _FastFwd] = {}
        self._devices: dict[int, _DeviceState] = {}
        self._lock = threading.Lock()
        self.stats = {"builds": 0, "hits": 0, "build_seconds": 0.0}
        self._sinks: dict[tuple, torch.Tensor] = {}
        self._alibi: tuple | None = None

    # --- caches ---
    def _device(self, index: int) -> _DeviceState:
        state = self._devices.get(index)
        if state is None:
            with self._lock:
                state = self._devices.get(index) or _DeviceState(self.cudnn, index)
                self._devices[index] = state
        return state

    def graph(self, key: SdpaKey) -> Compiled:
        compiled = self._graphs.get(key)
        if compiled is not None:
            self.stats["hits"] += 1
            return compiled
        failure = self._failures.get(key)
        if failure is not None:
            raise failure.fresh()
        start = time.perf_counter()
        try:
            with _on_device(key.device):
                state = self._device(key.device)
                builder = GraphBuilder(self.cudnn, key, state.handle, self.fe_version, self.allow_python_engines,
                                       self.execute_path)
                compiled = builder.build_forward() if key.phase == "fwd" else builder.build_backward()
        except CudnnGraphError as exc:
            self._failures[key] = exc.fresh()
            raise
        if compiled.path == "raw" and state.backend is None:
            compiled.path = "ordered"
        self.stats["builds"] += 1
        self.stats["build_seconds"] += time.perf_counter() - start
        with self._lock:
            self._graphs[key] = compiled
            while len(self._graphs) > GRAPH_CACHE_SIZE:
                self._graphs.popitem(last=False)
        return compiled

    def _graph_or_record(self, key: SdpaKey, signature: Callable[[str], tuple]) -> Compiled:
        try:
            return self.graph(key)
        except CudnnGraphError as exc:
            record_rejection(signature(key.phase), exc.cudnn_message)
            raise

    # --- launching a built graph ---
    def _launch_raw(self, compiled: Compiled, ptrs: dict[str, int], device: int) -> None:
        """The lean launch: data pointers in the backend's slot order, straight to its raw execute."""
        if _current_device() != device:
            with _on_device(device):
                return self._launch_raw(compiled, ptrs, device)
        state = self._devices.get(device) or self._device(device)
        stream = _stream(device)
        state.bind(self.cudnn, stream)
        ws = state.workspace(stream, compiled.workspace_size, device)
        if compiled.bound:
            ptrs.update(compiled.bound)
        try:
            slots = array("Q", [ptrs[n] for n in compiled.slots])
        except KeyError as exc:
            raise RuntimeError(f"cuDNN graph slot {exc.args[0]!r} has no buffer (engine bug)") from None
        compiled.raw(slots.buffer_info()[0], len(slots), ws.data_ptr(), state.backend, compiled.plan_index)

    def _run(self, compiled: Compiled, buffers: dict[str, Any], device: int) -> None:
        """The general launch: raw when the graph allows it, else cudnn-frontend's execute."""
        if compiled.path == "raw":
            try:
                return self._launch_raw(compiled, {n: t.data_ptr() for n, t in buffers.items()}, device)
            except TypeError:
                compiled.path = "ordered"  # a binding whose raw execute takes other arguments: the public path
        if _current_device() != device:
            with _on_device(device):
                return self._run(compiled, buffers, device)
        state = self._device(device)
        stream = _stream(device)
        state.bind(self.cudnn, stream)
        ws = state.workspace(stream, compiled.workspace_size, device)
        if compiled.path == "ordered":
            try:
                compiled.graph.execute(tuple(buffers[n] for n in compiled.names), ws, handle=state.handle,
                                       tensor_uids=compiled.uids)
                return
            except (TypeError, ValueError):
                compiled.path = "dict"  # a frontend without the ordered form: the dict form from now on
        compiled.graph.execute({compiled.tensors[n]: buffers[n] for n in compiled.names}, ws, handle=state.handle)

    # --- per-call pieces ---
    def _bias(self, q: torch.Tensor, aux: AttnAux, cfg: AttnConfig, call: _Call) -> tuple:
        """(bias tensor for cuDNN or None, bias_grad, native_alibi)."""
        if cfg.bias_type == "no_bias":
            return None, False, False
        if cfg.bias_type == "pre_scale_bias":
            raise ValueError("bias_type='pre_scale_bias' is not supported by cuDNN fused attention; "
                             "use post_scale_bias")
        if cfg.bias_type == "alibi":
            if call.padding:
                raise ValueError("ALiBi with a padding mask is not supported by the cuDNN engine")
            top_left = cfg.attn_mask_type in TOP_LEFT_MASKS
            if aux.alibi_slopes is None and call.sq == call.skv and "causal" in cfg.attn_mask_type \
                    and cfg.window_size[0] < 0:
                return None, False, True  # cuDNN's built-in ALiBi: the standard slopes, causal
            slopes = aux.alibi_slopes if aux.alibi_slopes is not None else alibi_default_slopes(call.h).to(q.device)
            if slopes.shape not in ((call.h,), (call.b, call.h)):
                raise ValueError(f"alibi_slopes has shape {tuple(slopes.shape)}; expected [{call.h}] or "
                                 f"[{call.b}, {call.h}]")
            key = (slopes.data_ptr(), slopes._version, tuple(slopes.shape), call.sq, call.skv, top_left, q.dtype)
            if self._alibi is None or self._alibi[0] != key:
                self._alibi = (key, alibi_bias(slopes, call.sq, call.skv, top_left, q.dtype))
            return self._alibi[1], False, False
        bias = aux.bias
        if bias is None:
            raise ValueError(f"bias_type={cfg.bias_type!r} but aux.bias is None")
        if bias.dim() != 4 or bias.shape[0] not in (1, call.b) or bias.shape[1] not in (1, call.h) \
                or tuple(bias.shape[2:]) != (call.sq, call.skv):
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected [1|{call.b}, 1|{call.h}, {call.sq}, "
                             f"{call.skv}]")
        grad = bias.requires_grad and tuple(bias.shape[:2]) == (1, call.h)  # cuDNN's dBias: [1, h, sq, skv] only
        b = bias.detach()
        if b.dtype != q.dtype or b.stride(-1) != 1:
            b = b.to(q.dtype).contiguous()
        return b, grad, False

    def _sink(self, aux: AttnAux, cfg: AttnConfig, call: _Call, device: torch.device) -> torch.Tensor | None:
        if cfg.softmax_type == "vanilla":
            return None
        if cfg.softmax_type == "off-by-one":
            key = (device, call.h)
            sink = self._sinks.get(key)
            if sink is None:
                sink = self._sinks[key] = torch.zeros(1, call.h, 1, 1, dtype=torch.float32, device=device)
            return sink
        if aux.softmax_offset is None or aux.softmax_offset.numel() != call.h:
            raise ValueError(f"softmax_type='learnable' needs aux.softmax_offset of shape [{call.h}]")
        return aux.softmax_offset.detach().float().reshape(1, call.h, 1, 1).contiguous()

    @staticmethod
    def _seed(aux: AttnAux, device: torch.device) -> torch.Tensor:
        """Philox (seed, offset), int64 [2]: the caller's aux.extra['dropout_seed'] (the module draws it inside its
        RNG tracker, so that recomputation reuses it), else a fresh draw."""
        seed = aux.extra.get("dropout_seed") if aux.extra else None
        if seed is None:
            return torch.randint(0, 1 << 62, (2,), dtype=torch.int64, device=device, generator=aux.dropout_generator)
        if seed.dtype != torch.int64 or seed.numel() != 2 or not seed.is_contiguous() or seed.device != device:
            raise ValueError(f"aux.extra['dropout_seed'] is {seed.dtype} {tuple(seed.shape)} on {seed.device}; "
                             f"expected a contiguous int64 tensor of 2 elements on {device}")
        return seed

    def _key(self, phase: str, call: _Call, cfg: AttnConfig, dtype: torch.dtype, device: int,
             operands: dict[str, torch.Tensor], bias: torch.Tensor | None, bias_grad: bool, alibi: bool,
             sink: torch.Tensor | None, stats_stride: tuple, rng_dump: bool, sink_grad: bool = False) -> SdpaKey:
        strides, tokens = [], []
        for name, t in operands.items():
            s, token = _describe(t, call.fmt, call.skv if name in ("k", "v", "dk", "dv") else call.sq)
            strides.append((name, s))
            if token is not None:
                tokens.append((name, token))
        alignment, left, right = _mask_args(cfg, call)
        return SdpaKey(
            phase=phase, dtype=str(dtype).removeprefix("torch."), device=device, b=call.b, h=call.h,
            hkv=call.hkv, sq=call.sq, skv=call.skv, dqk=call.dqk, dv=call.dv, strides=tuple(strides),
            ragged=call.fmt == "thd", ragged_tokens=tuple(tokens), padding=call.padding, alignment=alignment,
            left_bound=left, right_bound=right,
            bias=(tuple(bias.shape), tuple(bias.stride())) if bias is not None else None, bias_grad=bias_grad,
            alibi=alibi, dropout=float(cfg.dropout_p), scale=float(cfg.softmax_scale), sink=sink is not None,
            sink_grad=sink_grad, deterministic=bool(cfg.deterministic) and phase == "bwd",
            offsets_int64=self.cudnn_version >= 90500, stats_stride=stats_stride,
            max_total=(_bucket(call.t_q), _bucket(call.t_kv)) if call.fmt == "thd" and phase == "bwd" else (0, 0),
            rng_dump=rng_dump)

    def _aux_buffers(self, call: _Call, key: SdpaKey, operands: dict[str, torch.Tensor], bias, sink, seed) -> dict:
        buf: dict[str, Any] = {}
        if key.padding:
            buf["seq_len_q"] = call.lens_q.view(call.b, 1, 1, 1)
            buf["seq_len_kv"] = call.lens_kv.view(call.b, 1, 1, 1)
        if key.ragged:
            itype = torch.int64 if key.offsets_int64 else torch.int32
            for name, token in key.ragged_tokens:
                side = "q" if name in ("q", "o", "do", "dq") else "kv"
                off = f"off_{side}_{token}"
                if off not in buf:
                    buf[off] = _ragged_offsets(call.cu_q_pad if side == "q" else call.cu_kv_pad, itype, token,
                                               call.capturing)
            buf["off_stats"] = _ragged_offsets(call.cu_q_pad, itype, call.h, call.capturing)
        if bias is not None:
            buf["bias"] = bias
        if sink is not None:
            buf["sink"] = sink
        if seed is not None:
            buf["seed"], buf["offset"] = seed[0:1].view(1, 1, 1, 1), seed[1:2].view(1, 1, 1, 1)
        buf.update(operands)
        return buf

    def _signature(self, call: _Call, cfg: AttnConfig, dtype: torch.dtype, phase: str, bias) -> tuple:
        """The table's rejection signature of this call (constraints.cudnn_common.rejection_signature)."""
        shape = slopes = None
        if bias is not None and cfg.bias_type == "post_scale_bias":
            shape = ("1" if bias.shape[0] == 1 else "b") + ("1" if bias.shape[1] == 1 else "h") + "ss"
        if cfg.bias_type == "alibi":
            slopes = "bh" if bias is not None and bias.shape[0] != 1 else "h"
        try:
            p = AttentionParams(
                dtype=dtype, qkv_format=call.fmt, batch_size=call.b, num_heads=call.h, num_gqa_groups=call.hkv,
                head_dim_qk=call.dqk, head_dim_v=call.dv, max_seqlen_q=call.max_q, max_seqlen_kv=call.max_kv,
                attn_mask_type=cfg.attn_mask_type, window_size=tuple(cfg.window_size), bias_type=cfg.bias_type,
                bias_shape=shape, alibi_slopes_shape=slopes, dropout=cfg.dropout_p, softmax_type=cfg.softmax_type,
                deterministic=cfg.deterministic)
        except ValueError:
            return ("unrepresentable", phase)
        return rejection_signature(p, cfg.deterministic, phase)

    # --- Engine interface ---
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux, cfg: AttnConfig) -> FwdResult:
        fast = self._fast_entry(q, k, v, aux, cfg)
        if fast is not None:
            return self._forward_fast(fast, q, k, v, aux, cfg, fast.out_shape)
        return self._forward_general(q, k, v, aux, cfg)

    def forward_flat(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux,
                     cfg: AttnConfig) -> FwdResult:
        """The cached path allocates out as [..., h * d_v] and hands cuDNN its pointer: no view per call."""
        fast = self._fast_entry(q, k, v, aux, cfg)
        if fast is not None:
            return self._forward_fast(fast, q, k, v, aux, cfg, fast.flat_out_shape)
        out, lse, state, max_logit = self._forward_general(q, k, v, aux, cfg)
        return FwdResult(out.flatten(-2), lse, state, max_logit)

    def _fast_entry(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux,
                    cfg: AttnConfig) -> _FastFwd | None:
        fast = self._fast.get((id(cfg), q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype,
                               k.dtype, v.dtype, q.device, k.device, v.device,
                               q.requires_grad or k.requires_grad or v.requires_grad))
        if fast is not None and (fast.cfg is cfg or fast.cfg == cfg) and "cudnn_rng_dump" not in aux.extra:
            return fast
        return None

    def _forward_fast(self, fast: _FastFwd, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux,
                      cfg: AttnConfig, out_shape: tuple) -> FwdResult:
        """out_shape: fast.out_shape, or fast.flat_out_shape (the same memory, heads merged)."""
        self.stats["hits"] += 1
        out = torch.empty(out_shape, dtype=fast.dtype, device=fast.device)
        lse = torch.empty(fast.lse_shape, dtype=torch.float32, device=fast.device)
        ptrs = {"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "o": out.data_ptr(), "stats": lse.data_ptr()}
        seed = None
        if cfg.dropout_p > 0:
            seed = self._seed(aux, fast.device)
            ptrs["seed"] = seed.data_ptr()
            ptrs["offset"] = ptrs["seed"] + 8  # seed[1]
        if fast.sink is not None:
            ptrs["sink"] = fast.sink.data_ptr()
        self._launch_raw(fast.compiled, ptrs, fast.dev)
        return FwdResult(out, lse, _FwdState(fast.key, fast.call, None, False, fast.sink, seed, None, fast))

    def _forward_general(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux,
                         cfg: AttnConfig) -> FwdResult:
        if cfg.return_max_logit:
            raise ValueError("return_max_logit=True is not supported by the cuDNN frontend engine")
        call = _prepare(q, k, v, aux, cfg)
        dev = q.device.index if q.device.index is not None else _current_device()
        bias, bias_grad, alibi = self._bias(q, aux, cfg, call)
        sink = self._sink(aux, cfg, call, q.device)
        seed = self._seed(aux, q.device) if cfg.dropout_p > 0 else None
        if call.fmt == "thd":
            out = _thd_buffer(None, (call.t_q, call.h, call.dv), q.dtype, q.device, call.end_q, call.gaps, 0.0)
            lse_store = _thd_buffer(None, (call.t_q, call.h), torch.float32, q.device, call.end_q, call.gaps,
                                    float("-inf"))
            stats_stride = (call.h * call.sq, 1, call.h, 1)
            operands = {"q": q, "k": k, "v": v, "o": out}
        else:
            shape = (call.b, call.sq, call.h, call.dv) if call.fmt == "bshd" else (call.sq, call.b, call.h, call.dv)
            out = torch.empty(shape, dtype=q.dtype, device=q.device)
            lse_store = torch.empty(call.b, call.h, call.sq, dtype=torch.float32, device=q.device)
            stats_stride = (call.h * call.sq, call.sq, 1, 1)
            operands = {"q": bhsd(q, call.fmt), "k": bhsd(k, call.fmt), "v": bhsd(v, call.fmt),
                        "o": bhsd(out, call.fmt)}
        rng_dump = aux.extra.get("cudnn_rng_dump") if cfg.dropout_p > 0 else None
        key = self._key("fwd", call, cfg, q.dtype, dev, {"q": q, "k": k, "v": v, "o": out}, bias, bias_grad, alibi,
                        sink, stats_stride, rng_dump is not None)

        def signature(phase: str) -> tuple:  # computed only when cuDNN refuses a graph
            return self._signature(call, cfg, q.dtype, phase, bias)

        compiled = self._graph_or_record(key, signature)
        grad = q.requires_grad or k.requires_grad or v.requires_grad
        if grad:  # a backward cuDNN refuses is reported now, before any kernel runs
            self._prebuild_backward(key, call, cfg, q, k, v, out, dev, bias, bias_grad, alibi, sink, aux, signature)
        buffers = self._aux_buffers(call, key, operands, bias, sink, seed)
        buffers["stats"] = lse_store
        if rng_dump is not None:
            buffers["rng_dump"] = rng_dump
        self._run(compiled, buffers, dev)
        if call.fmt == "thd":
            lse = lse_store.t()  # [h, t] view of cuDNN's ragged [t, h] stats
        else:
            lse = lse_store
            if call.padding:
                _clear_padded_rows(out, lse, call)
        fast = None
        if (compiled.path == "raw" and call.fmt != "thd" and not call.padding and bias is None and not alibi
                and cfg.softmax_type != "learnable" and rng_dump is None):
            flat_shape = tuple(out.shape[:-2]) + (out.shape[-2] * out.shape[-1],)
            fast = _FastFwd(cfg, compiled, key, call, tuple(out.shape), flat_shape, tuple(lse.shape), q.dtype,
                            q.device, dev, sink)
            if len(self._fast) >= FAST_CACHE_SIZE:
                self._fast.clear()
            self._fast[(id(cfg), q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
                        v.dtype, q.device, k.device, v.device, grad)] = fast
        return FwdResult(out, lse, _FwdState(key, call, bias, bias_grad, sink, seed, rng_dump, fast))

    def _prebuild_backward(self, fwd_key: SdpaKey, call: _Call, cfg: AttnConfig, q, k, v, out, dev: int, bias,
                           bias_grad: bool, alibi: bool, sink, aux: AttnAux, signature: Callable[[str], tuple]) -> None:
        """Build (or find) the backward graph this forward's backward will ask for: dO laid out like the output,
        gradients allocated like q, k, v, the stats as the forward returns them. Once per forward graph (and what
        the backward key adds to it): the meta tensors and the key cost tens of us per call on the general path
        (thd, padding, bias)."""
        sink_grad = (cfg.softmax_type == "learnable" and aux.softmax_offset is not None
                     and aux.softmax_offset.requires_grad)
        done = (fwd_key, sink_grad, bool(cfg.deterministic), call.t_q, call.t_kv)
        if done in self._backward_built:
            return
        operands = {"q": q, "k": k, "v": v, "o": out, "do": _meta_like(out), "dq": _meta_like(q),
                    "dk": _meta_like(k), "dv": _meta_like(v)}
        thd = call.fmt == "thd"
        stats_stride = (call.h * call.sq, 1, call.h, 1) if thd else (call.h * call.sq, call.sq, 1, 1)
        key = self._key("bwd", call, cfg, q.dtype, dev, operands, bias, bias_grad, alibi, sink, stats_stride, False,
                        sink_grad)
        self._graph_or_record(key, signature)
        if len(self._backward_built) >= GRAPH_CACHE_SIZE:
            self._backward_built.clear()
        self._backward_built.add(done)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, state: _FwdState, aux: AttnAux, cfg: AttnConfig) -> BwdResult:
        fast = state.fast
        if fast is not None:
            compiled = fast.bwd.get((dout.shape, dout.stride(), dout.dtype, out.stride(), lse.stride(), q.stride(),
                                     k.stride(), v.stride()))
            if compiled is not None:
                return self._backward_fast(fast, compiled, dout, q, k, v, out, lse, state)
        return self._backward_general(dout, q, k, v, out, lse, state, aux, cfg)

    def _backward_fast(self, fast: _FastFwd, compiled: Compiled, dout, q, k, v, out, lse,
                       state: _FwdState) -> BwdResult:
        self.stats["hits"] += 1
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        ptrs = {"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "o": out.data_ptr(), "do": dout.data_ptr(),
                "stats": lse.data_ptr(), "dq": dq.data_ptr(), "dk": dk.data_ptr(), "dv": dv.data_ptr()}
        if state.seed is not None:
            ptrs["seed"] = state.seed.data_ptr()
            ptrs["offset"] = ptrs["seed"] + 8
        if fast.sink is not None:
            dsink = torch.zeros(fast.sink.shape, dtype=torch.float32, device=fast.device)
            ptrs["sink"], ptrs["dsink"] = fast.sink.data_ptr(), dsink.data_ptr()
        self._launch_raw(compiled, ptrs, fast.dev)
        return BwdResult(dq, dk, dv)

    def _backward_general(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, state: _FwdState, aux: AttnAux,
                          cfg: AttnConfig) -> BwdResult:
        call, dev = state.call, state.key.device
        if aux.bias is not None and aux.bias.requires_grad and not state.bias_grad and cfg.bias_type != "alibi":
            raise ValueError(f"the bias of shape {tuple(aux.bias.shape)} requires grad, but cuDNN computes dBias only "
                             f"for a [1, {call.h}, sq, skv] bias; detach it or use that shape")
        if call.fmt == "thd":
            dq = _thd_buffer(q, (), q.dtype, q.device, call.end_q, call.gaps, 0.0)
            dk, dv = (_thd_buffer(t, (), t.dtype, t.device, call.end_kv, call.gaps, 0.0) for t in (k, v))
        else:
            dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        operands = {"q": q, "k": k, "v": v, "o": out, "do": dout, "dq": dq, "dk": dk, "dv": dv}
        given_lse = lse
        if call.fmt == "thd":
            stats = lse.t()
            if stats.stride() != (call.h, 1):
                stats = stats.contiguous()
            stats_stride = (call.h * call.sq, 1, call.h, 1)
            views = operands
        else:
            if not lse.is_contiguous():  # cuDNN < 9.26 reads only packed [b, h, s, 1] stats in the backward
                lse = lse.contiguous()
            stats = lse.unsqueeze(-1)
            stats_stride = tuple(stats.stride())
            views = {n: bhsd(t, call.fmt) for n, t in operands.items()}
        sink_grad = (cfg.softmax_type == "learnable" and aux.softmax_offset is not None
                     and aux.softmax_offset.requires_grad)
        key = self._key("bwd", call, cfg, q.dtype, dev, operands, state.bias, state.bias_grad, state.key.alibi,
                        state.sink, stats_stride, False, sink_grad)
        compiled = self._graph_or_record(key, lambda phase: self._signature(call, cfg, q.dtype, phase, state.bias))
        buffers = self._aux_buffers(call, key, views, state.bias, state.sink, state.seed)
        buffers["stats"] = stats
        dbias = dsink = None
        if key.bias_grad:
            dbias = buffers["dbias"] = torch.empty(state.bias.shape, dtype=q.dtype, device=q.device)
        if key.sink:
            dsink = buffers["dsink"] = torch.zeros(1, call.h, 1, 1, dtype=torch.float32, device=q.device)
        self._run(compiled, buffers, dev)
        if call.padding and call.fmt != "thd":
            _clear_padded_grads(dq, dk, dv, call)
        if state.fast is not None and compiled.path == "raw" and lse is given_lse:
            state.fast.bwd[(dout.shape, dout.stride(), dout.dtype, out.stride(), lse.stride(), q.stride(), k.stride(),
                            v.stride())] = compiled
        if dbias is not None and aux.bias is not None and dbias.dtype != aux.bias.dtype:
            dbias = dbias.to(aux.bias.dtype)
        dsoftmax = None
        if sink_grad:
            dsoftmax = dsink.view(call.h).to(aux.softmax_offset.dtype)
        return BwdResult(dq, dk, dv, dbias, dsoftmax)

    # --- KV-cache inference ---
    def forward_kv_cache(self, q: torch.Tensor, cache: KVCacheView, cu_seqlens_q: torch.Tensor, max_seqlen_q: int,
                         cfg: AttnConfig) -> torch.Tensor:
        """The step's queries, padded to [b, s_q, h, d], attend the cache in place through a padded graph whose
        sequence lengths are the step's: a contiguous cache's rows viewed as k/v, or the page pool as cuDNN's
        paged 'containers' with the page table (cudnn-frontend sdpa paged_attention_k_table/v_table, cuDNN >=
        9.5). The graph's extents are powers of two (keys: up to the row or table capacity), so that a decode
        loop builds a graph a few times per sequence length doubling instead of at every step; cuDNN bounds the
        work by the sequence-length tensors."""
        b, t, h = cache.batch, q.shape[0], q.shape[1]
        sq = _kv_bucket(max_seqlen_q)
        rows, cols = _thd_positions(cu_seqlens_q, b, max_seqlen_q, t)
        q4 = q.new_zeros(b, sq, h, q.shape[-1])
        q4[rows, cols] = q
        bshd = dataclasses.replace(cfg, qkv_format="bshd")
        if cache.page_table is None:
            skv = _kv_bucket(cache.max_seqlen_kv, cache.page_size)
            aux = AttnAux(cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cache.cu_seqlens_kv)
            out4 = self.forward(q4, cache.k[:b, :skv], cache.v[:b, :skv], aux, bshd).out
        else:
            out4 = self._forward_paged(q4, cache, cu_seqlens_q, bshd)
        return out4[rows, cols]

    def _forward_paged(self, q4: torch.Tensor, cache: KVCacheView, cu_seqlens_q: torch.Tensor,
                       cfg: AttnConfig) -> torch.Tensor:
        _require_cuda(q4)
        b, sq, h, dqk = q4.shape
        page, table = cache.page_size, cache.page_table
        pages = -(-_kv_bucket(cache.max_seqlen_kv, table.shape[1] * page) // page)
        call = _Call("bshd", b, h, cache.k.shape[2], sq, pages * page, dqk, cache.v.shape[-1], True,
                     _lens(cu_seqlens_q), cache.seqlens_kv.to(torch.int32), max_q=sq, max_kv=cache.max_seqlen_kv)
        dev = q4.device.index if q4.device.index is not None else _current_device()
        out = torch.empty(b, sq, h, call.dv, dtype=q4.dtype, device=q4.device)
        lse = torch.empty(b, h, sq, dtype=torch.float32, device=q4.device)
        operands = {"q": q4, "k": cache.k, "v": cache.v, "o": out}  # the pool described as [pages, hkv, page, d]
        key = self._key("fwd", call, cfg, q4.dtype, dev, operands, None, False, False, None,
                        (h * sq, sq, 1, 1), False)
        key = dataclasses.replace(key, paged=(cache.k.shape[0], page, pages, table.stride(0)))
        compiled = self._graph_or_record(key, lambda phase: ("kv-cache paged", phase))
        buffers = self._aux_buffers(call, key, {n: bhsd(x, "bshd") for n, x in operands.items()}, None, None, None)
        tables = table[:b, :pages].view(b, 1, pages, 1)
        buffers.update(stats=lse, page_table_k=tables, page_table_v=tables)
        self._run(compiled, buffers, dev)
        return out


def _kv_bucket(n: int, capacity: int | None = None) -> int:
    """A KV-cache graph's extent for n tokens: the next power of two, at most the capacity (never below n)."""
    bucket = 1 << max(0, n - 1).bit_length()
    return max(n, bucket if capacity is None else min(bucket, capacity))


def _padded_row_mask(lens: torch.Tensor, s: int) -> torch.Tensor:
    """[b, s] True for rows past each sequence's length."""
    return torch.arange(s, device=lens.device).view(1, s) >= lens.view(-1, 1)


def _clear_padded_rows(out: torch.Tensor, lse: torch.Tensor, call: _Call) -> None:
    """Rows of padding tokens: output 0, lse -inf (cuDNN leaves them unspecified)."""
    rows = _padded_row_mask(call.lens_q, call.sq)                         # [b, sq]
    lse.masked_fill_(rows.view(call.b, 1, call.sq), float("-inf"))
    sel = rows if call.fmt == "bshd" else rows.t()
    out.masked_fill_(sel[:, :, None, None], 0.0)


def _clear_padded_grads(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, call: _Call) -> None:
    for grads, lens, s in (((dq,), call.lens_q, call.sq), ((dk, dv), call.lens_kv, call.skv)):
        rows = _padded_row_mask(lens, s)
        sel = (rows if call.fmt == "bshd" else rows.t())[:, :, None, None]
        for g in grads:
            g.masked_fill_(sel, 0.0)


# --------------------------------------------------------------------------------------------
# Engine 2: torch's built-in cuDNN SDPA op
# --------------------------------------------------------------------------------------------
@dataclass
class _TorchState:
    fmt: str
    views: tuple           # (q, k, v) [b, h, s, d] views the op saw
    out4: torch.Tensor     # the op's output [b, h, sq, dv]
    bias: torch.Tensor | None
    rest: tuple            # (cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset)
    lse_dims: int
    is_causal: bool
    lse_stride: tuple      # the op's own logsumexp layout


def _in_layout_of(t: torch.Tensor, stride: tuple) -> torch.Tensor:
    """t itself where its strides are `stride`, else a copy with those strides."""
    if t.stride() == tuple(stride):
        return t
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


class TorchCudnnEngine(_torch_native.NativeOpPath, Engine):
    family = "cudnn_fused"
    provider = "torch"

    def __init__(self):
        if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
            raise ImportError(f"torch {torch.__version__} has no aten._scaled_dot_product_cudnn_attention")
        self.fwd_op = torch.ops.aten._scaled_dot_product_cudnn_attention
        self.bwd_op = torch.ops.aten._scaled_dot_product_cudnn_attention_backward

    native_call = staticmethod(_torch_native.cudnn_call)  # SDPA's own op and autograd where it fits

    @staticmethod
    def _validate(q: torch.Tensor, aux: AttnAux, cfg: AttnConfig) -> bool:
        """is_causal, or ValueError for what the op cannot express."""
        if cfg.qkv_format not in ("bshd", "sbhd"):
            raise ValueError(f"qkv_format={cfg.qkv_format!r}: torch's cuDNN op takes bshd or sbhd")
        mask, window = cfg.attn_mask_type, tuple(cfg.window_size)
        if mask not in ("no_mask", "causal", "causal_bottom_right"):
            raise ValueError(f"attn_mask_type={mask!r}: torch's cuDNN op supports no_mask and causal")
        if mask == "causal_bottom_right" and aux.max_seqlen_q not in (0, aux.max_seqlen_kv):
            raise ValueError("causal_bottom_right with sq != skv: torch's cuDNN op is top-left causal only")
        if window not in ((-1, -1), (-1, 0)):
            raise ValueError(f"window_size={window}: torch's cuDNN op has no sliding window")
        if cfg.bias_type not in ("no_bias", "post_scale_bias"):
            raise ValueError(f"bias_type={cfg.bias_type!r}: torch's cuDNN op takes only a post-scale bias")
        if cfg.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={cfg.softmax_type!r}: torch's cuDNN op has no softmax sink")
        if cfg.return_max_logit:
            raise ValueError("return_max_logit=True is not supported by torch's cuDNN op")
        if cfg.dropout_p > 0 and aux.dropout_generator is not None:
            raise ValueError("aux.dropout_generator: torch's cuDNN op draws from the default CUDA generator only")
        return "causal" in mask

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, aux: AttnAux, cfg: AttnConfig) -> FwdResult:
        is_causal = self._validate(q, aux, cfg)
        fmt = cfg.qkv_format
        if fmt == "sbhd":  # the op expects bshd memory viewed as bhsd (sdp_utils check_cudnn_layout)
            q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))
        q4, k4, v4 = (bhsd(t, "bshd") for t in (q, k, v))
        if is_causal and cfg.attn_mask_type == "causal_bottom_right" and q4.shape[2] != k4.shape[2]:
            raise ValueError("causal_bottom_right with sq != skv: torch's cuDNN op is top-left causal only")
        bias = None
        if cfg.bias_type == "post_scale_bias":
            if aux.bias is None:
                raise ValueError("bias_type='post_scale_bias' but aux.bias is None")
            b, h, sq, skv = q4.shape[0], q4.shape[1], q4.shape[2], k4.shape[2]
            bias = aux.bias.detach().to(q.dtype).expand(b, h, sq, skv)
        res = self.fwd_op(q4, k4, v4, bias, True, float(cfg.dropout_p), is_causal, False, scale=cfg.softmax_scale)
        out4, lse = res[0], res[1]
        lse_dims, lse_stride = lse.dim(), tuple(lse.stride())
        lse = lse.reshape(lse.shape[0], lse.shape[1], lse.shape[2])
        out = out4.permute(0, 2, 1, 3)  # bshd view of the op's output
        if fmt == "sbhd":
            out = out.transpose(0, 1)
        state = _TorchState(fmt, (q4, k4, v4), out4, bias, tuple(res[2:8]), lse_dims, is_causal, lse_stride)
        return FwdResult(out, lse, state)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, state: _TorchState, aux: AttnAux, cfg: AttnConfig) -> BwdResult:
        if aux.bias is not None and aux.bias.requires_grad:
            raise ValueError("the bias requires grad, but torch's cuDNN op returns no bias gradient; detach it or use "
                             "the cudnn_fused:frontend provider")
        q4, k4, v4 = state.views
        # torch caches the backward graph on q, k, v alone (MHA.cpp's MHAParams) and bakes in the strides of O, dO and
        # the stats it was first built with: they go in the layouts of the op's own results, as torch's autograd
        # passes them, else a call in another layout (a context-parallel merged out in sbhd) reads them wrongly
        d = dout.transpose(0, 1) if state.fmt == "sbhd" else dout
        do4 = _in_layout_of(d.permute(0, 2, 1, 3), state.out4.stride())
        o = out.transpose(0, 1) if state.fmt == "sbhd" else out
        o4 = _in_layout_of(o.permute(0, 2, 1, 3), state.out4.stride())
        lse_in = _in_layout_of(lse.unsqueeze(-1) if state.lse_dims == 4 else lse, state.lse_stride)
        cum_q, cum_k, max_q, max_k, seed, offset = state.rest
        dq4, dk4, dv4 = self.bwd_op(do4, q4, k4, v4, o4, lse_in, seed, offset, state.bias, cum_q, cum_k, max_q, max_k,
                                    float(cfg.dropout_p), state.is_causal, scale=cfg.softmax_scale)
        grads = [g.permute(0, 2, 1, 3) for g in (dq4, dk4, dv4)]
        if state.fmt == "sbhd":
            grads = [g.transpose(0, 1) for g in grads]
        return BwdResult(*grads)
