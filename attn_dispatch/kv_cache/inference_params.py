"""InferenceParams: the KV cache of a generation loop, with Transformer Engine's constructor and meaning.

Each step, `pre_step({seq_id: new_tokens, ...})` says which sequences run and how many new tokens each brings
(the prompt when a sequence joins, 1 per decode step, a chunk in chunked prefill); a sequence missing from the
dict has left and its slot or pages are freed. The batch order of the step's q/k/v is the dict's order. Each
attention layer (DotProductAttention(layer_number=...)) then appends its new k/v and attends to everything the
sequence has cached, bottom-right aligned.

Caches are [capacity, max_sequence_length, heads, dim] (contiguous: sequence i of the step in row i, rows moved
when the batch order changes) or page pools [total_num_pages, page_size, heads, dim] with a page table. Every
check of a step runs before anything is written: a rejected step leaves sequences, pages and caches as they were.

Differences from Transformer Engine (2.x inference.py), each a fix rather than a change of meaning:
- a continuing sequence advances by its step length (TE's non-paged manager adds 1 whatever the step);
- total_num_pages may be below max_batch_size * pages per sequence (TE requires equality): the pool is then
  shared, and a step that needs more pages than are free is refused with the sequence and the counts;
- device= (keyword) places the caches, so that CPU runs work (TE uses the current CUDA device).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..backends.base import KVCacheView

QKV_FORMATS = ("bshd", "sbhd", "thd")
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class KVCacheError(ValueError):
    """A step or a call the KV cache cannot take; nothing was written."""


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return value


@dataclass(frozen=True)
class _Step:
    """One pre_step's facts, shared by every layer of the step."""

    serial: int
    seq_ids: tuple
    step_lens: tuple[int, ...]
    lens: tuple[int, ...]             # cached tokens after the step
    cu_q: torch.Tensor                # int32 [b + 1]
    seqlens_kv: torch.Tensor          # int32 [b]
    cu_kv: torch.Tensor               # int32 [b + 1]
    dest: torch.Tensor                # int64 [total]: flat cache position of each new token, thd order
    rows: torch.Tensor                # int64 [total]: each new token's sequence (batch index)
    cols: torch.Tensor                # int64 [total]: its index among the sequence's new tokens

    @property
    def batch(self) -> int:
        return len(self.seq_ids)

    @property
    def total(self) -> int:
        return sum(self.step_lens)

    @property
    def max_q(self) -> int:
        return max(self.step_lens)

    @property
    def max_kv(self) -> int:
        return max(self.lens)


class InferenceParams:
    """KV-cache state of a generation loop (Transformer Engine's InferenceParams arguments; see module doc)."""

    def __init__(self, max_batch_size: int, max_sequence_length: int, num_heads_kv: int | None = None,
                 head_dim_k: int | None = None, dtype: torch.dtype | None = None, head_dim_v: int | None = None,
                 is_paged: bool = False, total_num_pages: int | None = None, page_size: int | None = None,
                 max_ctx_len: int | None = None, qkv_format: str = "bshd", custom_cache_manager: Any = None, *,
                 device: torch.device | str | None = None) -> None:
        self.max_batch_size = _positive("max_batch_size", max_batch_size)
        self.max_sequence_length = _positive("max_sequence_length", max_sequence_length)
        for name, value in (("num_heads_kv", num_heads_kv), ("head_dim_k", head_dim_k), ("dtype", dtype)):
            if value is None:
                raise ValueError(f"{name} is required (as in Transformer Engine >= 2.2): the cache is allocated "
                                 "from num_heads_kv, head_dim_k and dtype")
        self.num_heads_kv = _positive("num_heads_kv", num_heads_kv)
        self.head_dim_k = _positive("head_dim_k", head_dim_k)
        self.head_dim_v = self.head_dim_k if head_dim_v is None else _positive("head_dim_v", head_dim_v)
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported for the KV cache; expected one of "
                             f"{', '.join(map(str, CACHE_DTYPES))}")
        self.dtype = dtype
        if qkv_format not in QKV_FORMATS:
            raise ValueError(f"qkv_format={qkv_format!r} is not supported; expected one of {', '.join(QKV_FORMATS)}")
        self.input_qkv_format = qkv_format
        self.max_ctx_len = None if max_ctx_len is None else _positive("max_ctx_len", max_ctx_len)
        if custom_cache_manager is not None:
            raise NotImplementedError("custom_cache_manager is not supported by attn_dispatch: its caches are "
                                      "contiguous (is_paged=False) or paged (is_paged=True)")
        self.is_paged = bool(is_paged)
        if self.is_paged:
            if page_size is None:
                raise ValueError("is_paged=True needs page_size (tokens per page)")
            self.page_size = _positive("page_size", page_size)
            if self.max_sequence_length % self.page_size:
                raise ValueError(f"max_sequence_length={max_sequence_length} must be a multiple of page_size="
                                 f"{page_size} (a sequence holds whole pages)")
            self.max_pages_per_seq = self.max_sequence_length // self.page_size
            if total_num_pages is None:
                total_num_pages = self.max_batch_size * self.max_pages_per_seq
            self.total_num_pages = _positive("total_num_pages", total_num_pages)
        else:
            for name, value in (("page_size", page_size), ("total_num_pages", total_num_pages)):
                if value is not None:
                    raise ValueError(f"{name}={value!r} given with is_paged=False; a contiguous cache has no pages")
            self.page_size = self.max_sequence_length  # a row per sequence: one page of the whole length
            self.max_pages_per_seq, self.total_num_pages = 1, self.max_batch_size
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # 'cuda' means the current device, as tensors say
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cache_qkv_format = "bshd"
        self._caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._serial = 0
        self._appended: dict[int, int] = {}  # layer -> serial of the step whose tokens it has written
        self.reset()

    # --- Transformer Engine's public surface -------------------------------------------------------------
    def reset(self) -> None:
        """Forget every sequence (caches stay allocated; their contents are dead)."""
        self.sequences: OrderedDict = OrderedDict()           # seq_id -> cached tokens after the step
        self.sequences_pre_step: OrderedDict = OrderedDict()  # seq_id -> cached tokens before it
        self.step_dict: OrderedDict = OrderedDict()
        self.batch_size = 0
        self._free_pages = list(range(self.total_num_pages))
        self._pages: dict[Any, list[int]] = {}
        cap = self.max_batch_size
        # Transformer Engine's tensors: [max_batch_size + 1] running sums (the tail repeats the last value).
        self.cu_seqlens_q = torch.zeros(cap + 1, dtype=torch.int32, device=self.device)
        self.cu_seqlens_kv = torch.zeros(cap + 1, dtype=torch.int32, device=self.device)
        self.pre_step_seqlens = torch.zeros(cap, dtype=torch.int32, device=self.device)
        self.page_table = torch.zeros(cap, self.max_pages_per_seq, dtype=torch.int32, device=self.device) \
            if self.is_paged else None
        self._step: _Step | None = None

    def allocate_memory(self, layer_number: int) -> None:
        """Allocate layer_number's K and V caches (done on the layer's first step otherwise)."""
        _positive("layer_number", layer_number)
        if layer_number in self._caches:
            return
        shape = (self.total_num_pages, self.page_size, self.num_heads_kv)
        self._caches[layer_number] = (
            torch.zeros(*shape, self.head_dim_k, dtype=self.dtype, device=self.device),
            torch.zeros(*shape, self.head_dim_v, dtype=self.dtype, device=self.device))

    def get_seqlens_pre_step(self) -> torch.Tensor:
        return self.pre_step_seqlens

    def pre_step(self, step_dict: Mapping, *, joining: Any = None) -> None:
        """Start a step: {seq_id: new tokens} in the batch order of the step's q/k/v. Every sequence not in the
        dict leaves (its slot or pages are freed); a new seq_id joins with its prompt. joining (ours): the ids
        expected to join this step; given, any other id the cache does not hold is refused as unknown (a
        mistyped id would otherwise start a fresh sequence)."""
        items = self._validate_step(step_dict, joining)
        leaving = [s for s in self.sequences if s not in step_dict]
        for seq in leaving:
            self._free_pages.extend(self._pages.pop(seq, ()))
        old_rows = {seq: i for i, seq in enumerate(self.sequences)}
        new_lens = [self.sequences.get(seq, 0) + n for seq, n in items]
        if self.is_paged:
            for (seq, _), length in zip(items, new_lens):
                pages = self._pages.setdefault(seq, [])
                while len(pages) * self.page_size < length:
                    pages.append(self._free_pages.pop(0))
        else:
            self._move_rows([(old_rows[seq], i) for i, (seq, _) in enumerate(items)
                             if seq in old_rows and old_rows[seq] != i])
        self.sequences_pre_step = OrderedDict((seq, self.sequences.get(seq, 0)) for seq, _ in items)
        self.sequences = OrderedDict((seq, length) for (seq, _), length in zip(items, new_lens))
        self.step_dict = OrderedDict(items)
        self.batch_size = len(items)
        self._serial += 1
        self._step = self._device_step(items, new_lens)

    def __repr__(self) -> str:
        kind = (f"paged, {self.total_num_pages} pages of {self.page_size}" if self.is_paged
                else f"contiguous, {self.max_batch_size} x {self.max_sequence_length}")
        return (f"InferenceParams({kind}, heads={self.num_heads_kv}, head_dim_k={self.head_dim_k}, "
                f"head_dim_v={self.head_dim_v}, dtype={self.dtype}, sequences={dict(self.sequences)})")

    # --- what the module calls ------------------------------------------------------------------------------
    @property
    def current_step(self) -> _Step:
        if self._step is None:
            raise KVCacheError("no step in progress: call inference_params.pre_step({seq_id: new_tokens, ...}) "
                               "before the forward")
        return self._step

    def check_layer_free(self, layer_number: int) -> None:
        """Raises if this layer has already written the current step's tokens (a second forward would append
        them again)."""
        step = self.current_step
        if self._appended.get(layer_number) == step.serial:
            raise KVCacheError(f"layer_number={layer_number} has already appended this step's k/v to the cache; "
                               "call pre_step() before the next step, and give each layer its own layer_number")

    def gather_new(self, x: torch.Tensor, fmt: str) -> torch.Tensor:
        """The step's new tokens of x (bshd [b, s, ...], sbhd [s, b, ...] or thd [t, ...]) as thd [total, ...]."""
        step = self.current_step
        if fmt == "thd":
            return x[:step.total]
        batch_dim = 0 if fmt == "bshd" else 1
        s = x.shape[1 - batch_dim]
        if all(n == s for n in step.step_lens):
            return (x if fmt == "bshd" else x.transpose(0, 1)).reshape(step.total, *x.shape[2:])
        index = step.rows * s + step.cols if fmt == "bshd" else step.cols * step.batch + step.rows
        return x.reshape(-1, *x.shape[2:]).index_select(0, index)

    def scatter_out(self, out: torch.Tensor, fmt: str, like: torch.Tensor) -> torch.Tensor:
        """out thd [total, h*d] back to the layout of the step's input `like` (bshd/sbhd/thd); padding rows 0."""
        step = self.current_step
        if fmt == "thd":
            if like.shape[0] == step.total:
                return out
            full = out.new_zeros(like.shape[0], out.shape[-1])
            full[:step.total] = out
            return full
        b, s = (like.shape[0], like.shape[1]) if fmt == "bshd" else (like.shape[1], like.shape[0])
        if all(n == s for n in step.step_lens):
            out = out.view(b, s, -1)
            return out if fmt == "bshd" else out.transpose(0, 1).contiguous()
        full = out.new_zeros(b, s, out.shape[-1])
        full[step.rows, step.cols] = out
        return full if fmt == "bshd" else full.transpose(0, 1).contiguous()

    def append(self, layer_number: int, k: torch.Tensor, v: torch.Tensor) -> KVCacheView:
        """Write the step's new k/v (thd [total, hkv, d], from gather_new) into layer_number's cache and return
        what attention reads. The caller has validated shapes (check_new_kv) and the layer (check_layer_free)."""
        step = self.current_step
        self.allocate_memory(layer_number)
        k_cache, v_cache = self._caches[layer_number]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, step.dest, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, step.dest, v)
        self._appended[layer_number] = step.serial
        table = self.page_table[:step.batch] if self.is_paged else None
        return KVCacheView(k_cache, v_cache, step.seqlens_kv, step.cu_kv, step.max_kv, self.page_size, table)

    def check_new_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v (thd, the step's new tokens) match the cache: heads, head dims, dtype, device, token count."""
        step = self.current_step
        for name, x, dim in (("key_layer", k, self.head_dim_k), ("value_layer", v, self.head_dim_v)):
            if x.shape[0] != step.total:
                raise KVCacheError(f"{name} holds {x.shape[0]} new tokens but pre_step announced {step.total} "
                                   f"({dict(self.step_dict)})")
            if tuple(x.shape[1:]) != (self.num_heads_kv, dim):
                raise KVCacheError(f"{name} has heads x head_dim {tuple(x.shape[1:])}, the cache holds "
                                   f"({self.num_heads_kv}, {dim}) (InferenceParams num_heads_kv, head_dim)")
            if x.dtype != self.dtype:
                raise KVCacheError(f"{name} is {x.dtype}, the cache is {self.dtype} (InferenceParams dtype)")
            if x.device != self.device:
                raise KVCacheError(f"{name} is on {x.device}, the cache on {self.device} (InferenceParams device)")

    # --- internals ---------------------------------------------------------------------------------------------
    def _validate_step(self, step_dict: Any, joining: Any) -> list[tuple[Any, int]]:
        if not isinstance(step_dict, Mapping):
            raise KVCacheError(f"step_dict must map seq_id -> new tokens (an OrderedDict); got {type(step_dict)}")
        items = list(step_dict.items())
        if joining is not None:
            expected = set(joining)
            for seq, _ in items:
                if seq not in self.sequences and seq not in expected:
                    raise KVCacheError(f"sequence {seq!r} is unknown: the cache holds {list(self.sequences)} and "
                                       f"joining lists {sorted(expected, key=repr)}")
        if not items:
            raise KVCacheError("step_dict is empty: a step needs at least one sequence")
        if len(items) > self.max_batch_size:
            raise KVCacheError(f"the step has {len(items)} sequences, more than max_batch_size={self.max_batch_size}")
        limit = self.max_sequence_length
        for seq, n in items:
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise KVCacheError(f"sequence {seq!r}: new tokens {n!r} must be a positive integer")
            if n > limit:
                raise KVCacheError(f"sequence {seq!r}: a step of {n} tokens is longer than the cache "
                                   f"(max_sequence_length={limit})")
            held = self.sequences.get(seq, 0)
            if held + n > limit:
                raise KVCacheError(f"sequence {seq!r}: the cache is full: it holds {held} tokens, the step adds "
                                   f"{n}, max_sequence_length={limit}")
        total = sum(n for _, n in items)
        if self.max_ctx_len is not None and self.input_qkv_format == "thd" and total > self.max_ctx_len:
            raise KVCacheError(f"the step brings {total} tokens, more than max_ctx_len={self.max_ctx_len}")
        if self.is_paged:
            free = len(self._free_pages) + sum(len(self._pages.get(s, ())) for s in self.sequences
                                               if s not in step_dict)
            for seq, n in items:
                have = len(self._pages.get(seq, ())) if seq in self.sequences else 0
                need = -(-(self.sequences.get(seq, 0) + n) // self.page_size) - have
                if need > free:
                    raise KVCacheError(f"sequence {seq!r}: the page pool is exhausted: it needs {need} more pages "
                                       f"of {self.page_size} tokens, {free} of total_num_pages="
                                       f"{self.total_num_pages} are left for it")
                free -= need
        return items

    def _move_rows(self, moves: list[tuple[int, int]]) -> None:
        """Contiguous cache: bring continuing sequences to their new batch rows (only rows that change)."""
        if not moves or not self._caches:
            return
        held = list(self.sequences.values())  # still the previous step's rows
        length = max(held[src] for src, _ in moves)
        src = torch.tensor([m[0] for m in moves], device=self.device)
        dst = torch.tensor([m[1] for m in moves], device=self.device)
        for k_cache, v_cache in self._caches.values():
            for cache in (k_cache, v_cache):
                cache[dst, :length] = cache[src, :length]  # the right side is gathered first: overlaps are safe

    def _device_step(self, items: list[tuple[Any, int]], lens: list[int]) -> _Step:
        cap, b = self.max_batch_size, len(items)
        step_lens = [n for _, n in items]
        pre = [length - n for length, n in zip(lens, step_lens)]
        cu_q, cu_kv = [0], [0]
        for n, length in zip(step_lens, lens):
            cu_q.append(cu_q[-1] + n)
            cu_kv.append(cu_kv[-1] + length)
        pad = cap - b
        host = torch.tensor(cu_q + [cu_q[-1]] * pad + cu_kv + [cu_kv[-1]] * pad + pre + [0] * pad + lens,
                            dtype=torch.int32)
        packed = host.to(self.device, non_blocking=False)
        n_cu = cap + 1
        self.cu_seqlens_q.copy_(packed[:n_cu])
        self.cu_seqlens_kv.copy_(packed[n_cu:2 * n_cu])
        self.pre_step_seqlens.copy_(packed[2 * n_cu:2 * n_cu + cap])
        seqlens_kv = packed[2 * n_cu + cap:]
        if self.is_paged:
            rows_host = [self._pages[seq] + [0] * (self.max_pages_per_seq - len(self._pages[seq])) for seq, _ in items]
            self.page_table[:b].copy_(torch.tensor(rows_host, dtype=torch.int32))
        total = cu_q[-1]
        dev = self.device
        lengths = torch.tensor(step_lens, device=dev)
        rows = torch.repeat_interleave(torch.arange(b, device=dev), lengths, output_size=total)
        cols = torch.arange(total, device=dev) - self.cu_seqlens_q[:b].long()[rows]
        pos = self.pre_step_seqlens[:b].long()[rows] + cols
        if self.is_paged:
            page = self.page_table[:b].long()[rows, pos // self.page_size]
            dest = page * self.page_size + pos % self.page_size
        else:
            dest = rows * self.page_size + pos
        return _Step(self._serial, tuple(seq for seq, _ in items), tuple(step_lens), tuple(lens),
                     self.cu_seqlens_q[:b + 1], seqlens_kv, self.cu_seqlens_kv[:b + 1], dest, rows, cols)
