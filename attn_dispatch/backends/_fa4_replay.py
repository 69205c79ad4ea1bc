"""flash-attn-4's compiled forward replayed for repeat calls of one signature, without the interface's Python.

flash_attn.cute.interface._flash_attn_fwd spends most of a small call's host time before its kernel launch:
resolving tiles and schedulers, validating, allocating out and lse, building a compile key of ~70 fields (the
profile's split puts flash-attn-4's forward at ~0.15-0.2 ms of host time on the H100 hosts, cuDNN's at ~0.03). The
launch is one call of a compiled TVM-FFI function that takes torch tensors, and for a dense forward everything
before it follows from the call's signature (shapes, strides, dtype, device, scale, window). So:
- the first call of a signature runs the interface with its compile caches swapped for recording proxies;
- the signature is replayable only if the interface made exactly one compiled call, from _flash_attn_fwd's cache,
  with positional arguments whose tensors are q, k, v, out and lse (matched by storage, shape, stride and dtype):
  anything else (a varlen scan, scheduler metadata, a split-KV combine, a copy of an input) keeps the interface;
- a replay allocates out and lse as the interface did and calls the recorded function with the new tensors in
  their places and the other arguments (scale, window, None) as recorded;
- the first replay of each signature is compared bit for bit with the interface on the same inputs (not while a
  CUDA graph is being captured: the comparison synchronises); a difference or an error and the signature keeps the
  interface, with a warning. Under torch.compile's tracing the interface runs.
This reads private API (a compile cache's attribute name, the compiled function's arguments), hence the checks.
Off until it has run on a GPU (written in session 13 against a stand-in of the interface):
ATTN_DISPATCH_FA4_REPLAY=1, read when an engine first runs a forward, turns it on.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

logger = logging.getLogger("attn_dispatch.backends")

ENV_SWITCH = "ATTN_DISPATCH_FA4_REPLAY"
FORWARD_OWNER = "_flash_attn_fwd"
MAX_SIGNATURES = 256
INPUT_ALIGN_BYTES = 16  # the interface copies a tensor whose pointer is not 16-byte aligned (maybe_contiguous)
_SLOTS = ("q", "k", "v", "out", "lse")
_RECORDING = threading.Lock()  # one recorded call at a time: the proxies are swapped in module-wide


def replay_enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "0") == "1"


class _Slot:
    """A recorded argument that was one of the call's tensors (q, k, v, out or lse)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


@dataclass
class Replay:
    fn: Callable[..., Any]
    args: tuple  # _Slot or a constant, in the recorded order
    out_layout: tuple | None  # (shape, stride, dtype) of the out the interface allocated; None: the caller's out
    lse_layout: tuple  # (shape, stride, dtype)
    checked: bool = False

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if out is None:
            shape, stride, dtype = self.out_layout
            out = torch.empty_strided(shape, stride, dtype=dtype, device=q.device)
        shape, stride, dtype = self.lse_layout
        lse = torch.empty_strided(shape, stride, dtype=dtype, device=q.device)
        tensors = {"q": q.detach(), "k": k.detach(), "v": v.detach(), "out": out.detach(), "lse": lse}
        self.fn(*(tensors[a.name] if isinstance(a, _Slot) else a for a in self.args))
        return out, lse


class _RecordingCache:
    """One of the interface's compile caches during a recorded call: a lookup hands back the compiled function
    wrapped so that the recording thread's calls of it are recorded (other threads' pass straight through)."""

    def __init__(self, owner: str, cache: Any, calls: list, thread: int) -> None:
        self._owner, self._cache, self._calls, self._thread = owner, cache, calls, thread

    def __contains__(self, key: Any) -> bool:
        return key in self._cache

    def __setitem__(self, key: Any, fn: Any) -> None:
        self._cache[key] = fn

    def __getitem__(self, key: Any) -> Callable[..., Any]:
        fn = self._cache[key]

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == self._thread:
                self._calls.append((self._owner, fn, args, kwargs))
            return fn(*args, **kwargs)
        return recorded

    def __len__(self) -> int:
        return len(self._cache)

    def __iter__(self):
        return iter(self._cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


def compile_cache_owners(iface: Any) -> list[str]:
    """The interface's functions that keep a compile cache (each launches its compiled kernels through it)."""
    return sorted(name for name, obj in vars(iface).items() if callable(obj) and hasattr(obj, "compile_cache"))


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % INPUT_ALIGN_BYTES == 0 for t in tensors)


class ForwardReplays:
    """Per signature: a Replay, or None where the interface must run (not replayable, or its check failed)."""

    def __init__(self, iface: Any) -> None:
        self.iface = iface
        self.enabled = replay_enabled() and hasattr(getattr(iface, FORWARD_OWNER, None), "compile_cache")
        self.owners = compile_cache_owners(iface) if self.enabled else []
        self.entries: dict[tuple, Replay | None] = {}

    def __call__(self, key: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None,
                 interface: Callable[[torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of the forward: replayed where the signature allows, else interface(out)."""
        inputs = (q, k, v) if out is None else (q, k, v, out)
        if not self.enabled or torch.compiler.is_compiling() or not _aligned(*inputs):
            return interface(out)
        if key not in self.entries:
            if len(self.entries) >= MAX_SIGNATURES:
                return interface(out)
            result, replay = self._record(q, k, v, out, interface)
            self.entries[key] = replay
            return result
        replay = self.entries[key]
        if replay is None:
            return interface(out)
        if not replay.checked:
            return self._check(key, replay, q, k, v, out, interface)
        return replay.run(q, k, v, out)

    def _record(self, q, k, v, out, interface) -> tuple[tuple[torch.Tensor, torch.Tensor], Replay | None]:
        calls: list = []
        with _RECORDING:
            saved = {name: getattr(self.iface, name).compile_cache for name in self.owners}
            try:
                for name, cache in saved.items():
                    getattr(self.iface, name).compile_cache = _RecordingCache(name, cache, calls,
                                                                             threading.get_ident())
                result = interface(out)
            finally:
                for name, cache in saved.items():
                    getattr(self.iface, name).compile_cache = cache
        return result, self._replay_of(calls, q, k, v, out, *result)

    @staticmethod
    def _replay_of(calls: list, q, k, v, given_out, out, lse) -> Replay | None:
        if len(calls) != 1 or lse is None:
            return None
        owner, fn, args, kwargs = calls[0]
        if owner != FORWARD_OWNER or kwargs:
            return None
        layouts = {name: (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
                   for name, t in zip(_SLOTS, (q, k, v, out, lse))}
        recorded, seen = [], set()
        for arg in args:
            if isinstance(arg, torch.Tensor):
                layout = (arg.data_ptr(), tuple(arg.shape), tuple(arg.stride()), arg.dtype)
                name = next((n for n, lay in layouts.items() if lay == layout and n not in seen), None)
                if name is None:  # a tensor the replay would not have: scheduler metadata, a copy of an input, ...
                    return None
                seen.add(name)
                recorded.append(_Slot(name))
            elif _constant(arg):
                recorded.append(arg)
            else:  # an object the replay cannot vouch for (it might hold per-call state)
                return None
        if seen != set(_SLOTS):
            return None
        out_layout = None if given_out is not None else (tuple(out.shape), tuple(out.stride()), out.dtype)
        return Replay(fn, tuple(recorded), out_layout, (tuple(lse.shape), tuple(lse.stride()), lse.dtype))

    def _check(self, key, replay: Replay, q, k, v, out, interface) -> tuple[torch.Tensor, torch.Tensor]:
        """The first replay of a signature, against the interface on the same inputs (bit for bit)."""
        if q.is_cuda and torch.cuda.is_current_stream_capturing():  # comparing would synchronise: check later
            return interface(out)
        try:
            got = replay.run(q, k, v, out)
            want = interface(None if out is None else torch.empty_like(out))
            same = all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(got, want))
        except Exception as exc:  # noqa: BLE001 - any failure keeps the interface for this signature
            logger.warning("flash-attn-4 forward replay failed its check (%s); this signature keeps the interface",
                           exc)
            self.entries[key] = None
            return interface(out)
        if not same:
            logger.warning("flash-attn-4 forward replay differed from the interface; this signature keeps it")
            self.entries[key] = None
            if out is not None:
                out.copy_(want[0])
                return out, want[1]
            return want
        replay.checked = True
        return got


def _constant(value: Any) -> bool:
    """None, a number, a string or a dtype, or a tuple / list (NamedTuples included) of those."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return True
    return isinstance(value, (tuple, list)) and all(_constant(x) for x in value)
