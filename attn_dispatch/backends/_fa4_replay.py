"""flash-attn-4's compiled launches replayed for repeat calls of one signature, without the interface's Python.

flash_attn.cute.interface spends most of a small call's host time before its launches: resolving tiles and
schedulers, validating, allocating, building compile keys of ~70 fields (the profile's split puts flash-attn-4 at
~0.15-0.2 ms of host time a forward and ~0.7-0.85 ms a training step on the H100 hosts, cuDNN at ~0.03 and ~0.4).
Each launch is a call of a compiled TVM-FFI function that takes torch tensors, and for a dense call everything
before the launches follows from the call's signature (shapes, strides, dtype, device, scale, window). So:
- the first call of a signature runs the interface with its compile caches swapped for recording proxies, which
  note each launch's function and arguments, and whether each tensor the call did not pass in was all zeros when a
  launch first read it;
- each tensor argument is then one of the call's inputs, one of its results, or a buffer of the call's own (as
  recorded: its layout, and zeros where it held zeros, else uninitialised); other arguments must be constants
  (None, numbers, strings, tuples of those); a buffer met in two layouts, or anything else, keeps the interface;
  a call whose inputs share memory (k is v) is not recorded (its tensors would be told apart by position only);
- a replay allocates the results and buffers and makes the recorded launches with the new tensors in their places;
- the first replay of each signature is compared with the interface on the same inputs (bit for bit, except a
  nondeterministic backward: within 2% of the largest value, far below what a missed initialisation gives), not
  while a CUDA graph is captured (the comparison synchronises); a difference or an error and the signature keeps the
  interface, with a warning. A replay that passes is run twice more with its floating-point buffers that held
  zeros filled with +-1e30 instead; if the results still match, the first launch overwrites them (dq_accum: fresh
  memory when recorded, zeroed by the preprocess kernel), and the replay drops their memsets;
- under torch.compile's tracing the interface runs.
This reads private API (a compile cache's attribute name, the compiled functions' arguments), hence the checks.
On by default since its GPU tests passed on the H100 (it was written against a stand-in of the interface):
ATTN_DISPATCH_FA4_REPLAY=0, read when an engine first runs a call, turns it off.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from ..env import PRIVATE_TORCH

logger = logging.getLogger("attn_dispatch.backends")

ENV_SWITCH = "ATTN_DISPATCH_FA4_REPLAY"
MAX_SIGNATURES = 1024  # per kind; the least recently used is dropped (a sweep over shapes must not end replays)
INPUT_ALIGN_BYTES = 16  # the interface copies a tensor whose pointer is not 16-byte aligned (maybe_contiguous)
NONDETERMINISTIC_TOLERANCE = 2e-2  # of the largest |value|: atomics' order moves a bf16 result by ~1 ulp
# Fills that stand in for garbage when the check asks whether a buffer seen holding zeros needs them: any read of
# it before a write (an accumulation, a max, a min) moves a result far past the tolerance.
POISONS = (1e30, -1e30)
_RECORDING = threading.Lock()  # one recorded call at a time: the proxies are swapped in module-wide
_UNSEEN = object()


def replay_enabled() -> bool:
    """On unless ATTN_DISPATCH_FA4_REPLAY=0, or every private shortcut is off (ATTN_DISPATCH_PRIVATE_TORCH=0)."""
    return PRIVATE_TORCH and os.environ.get(ENV_SWITCH, "1") != "0"


@dataclass(frozen=True)
class _Tensor:
    """A recorded tensor argument: an input or a result by name, or the call's own buffer by index."""

    name: str | None = None
    buffer: int | None = None


@dataclass(frozen=True)
class _Alloc:
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    zeros: bool
    fill: float | None = None  # the check's poison (never in a replay that is used)

    def make(self, device: torch.device) -> torch.Tensor:
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)
        if self.fill is not None:
            return t.fill_(self.fill)
        return t.zero_() if self.zeros else t


@dataclass
class Replay:
    launches: tuple  # (fn, args): each argument a _Tensor or a constant
    results: tuple  # result names, in the order the interface returns them
    allocs: dict  # result name -> _Alloc (results the caller does not pass in)
    buffers: tuple  # _Alloc per buffer index
    checked: bool = False
    # Per launch: (fn, its arguments with None where a tensor goes, (position, name) of call tensors, (position,
    # index) of buffers). A launch takes ~25-30 arguments, a few of them tensors: filling only those, a replayed
    # training step makes 279 Python calls, not 461 (cProfile, H100), and a 3-launch replay costs a CPU stand-in
    # 7.1 us, not 14.6.
    plan: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.plan = tuple(
            (fn, [None if isinstance(a, _Tensor) else a for a in args],
             tuple((i, a.name) for i, a in enumerate(args) if isinstance(a, _Tensor) and a.name is not None),
             tuple((i, a.buffer) for i, a in enumerate(args) if isinstance(a, _Tensor) and a.name is None))
            for fn, args in self.launches)

    def run(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        device = next(iter(inputs.values())).device
        tensors = {name: t.detach() for name, t in inputs.items()}
        for name, alloc in self.allocs.items():
            tensors[name] = alloc.make(device)
        buffers = [alloc.make(device) for alloc in self.buffers]
        for fn, template, named, indexed in self.plan:
            args = template.copy()
            for i, name in named:
                args[i] = tensors[name]
            for i, index in indexed:
                args[i] = buffers[index]
            fn(*args)
        return tuple(tensors[name] for name in self.results)


@dataclass
class _Recorder:
    """The launches of one recorded call, from one thread, and which non-input tensors held zeros at first use."""

    thread: int
    inputs: set  # data pointers of the call's inputs
    launches: list = field(default_factory=list)
    zero_at_first_use: dict = field(default_factory=dict)  # data pointer -> bool

    def note(self, owner: str, fn: Any, args: tuple, kwargs: dict) -> None:
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.data_ptr() not in self.inputs \
                    and arg.data_ptr() not in self.zero_at_first_use:
                self.zero_at_first_use[arg.data_ptr()] = not bool(torch.count_nonzero(arg).item())
        self.launches.append((owner, fn, args, kwargs))


class _RecordingCache:
    """One of the interface's compile caches during a recorded call: a lookup hands back the compiled function
    wrapped so that the recording thread's launches are noted (other threads' pass straight through)."""

    def __init__(self, owner: str, cache: Any, recorder: _Recorder) -> None:
        self._owner, self._cache, self._recorder = owner, cache, recorder

    def __contains__(self, key: Any) -> bool:
        return key in self._cache

    def __setitem__(self, key: Any, fn: Any) -> None:
        self._cache[key] = fn

    def __getitem__(self, key: Any) -> Callable[..., Any]:
        fn = self._cache[key]

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == self._recorder.thread:
                self._recorder.note(self._owner, fn, args, kwargs)
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


def _constant(value: Any) -> bool:
    """None, a number, a string or a dtype, or a tuple / list (NamedTuples included) of those."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return True
    return isinstance(value, (tuple, list)) and all(_constant(x) for x in value)


def _layout(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype


def _alloc(t: torch.Tensor, zeros: bool) -> _Alloc:
    return _Alloc(tuple(t.shape), tuple(t.stride()), t.dtype, zeros)


class Replays:
    """Per signature of one kind of call (the forward, or the backward): a Replay, or None where the interface
    must run (not replayable, or its check failed)."""

    def __init__(self, iface: Any, owner: str, results: tuple[str, ...]) -> None:
        self.iface = iface
        self.results = results
        self.enabled = replay_enabled() and hasattr(getattr(iface, owner, None), "compile_cache")
        self.owners = compile_cache_owners(iface) if self.enabled else []
        self.entries: OrderedDict[tuple, Replay | None] = OrderedDict()  # least recently used first

    def __call__(self, settings: tuple, inputs: dict[str, torch.Tensor],
                 interface: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]], *,
                 deterministic: bool = True) -> tuple[torch.Tensor, ...]:
        """The call's results: replayed where the signature allows, else interface(inputs). `inputs` holds the
        tensors the call passes in (results it passes in too, such as a preallocated out); `settings` the call's
        other values the interface reads (scale, window, ...). The signature: both, the tensors by layout."""
        if not self.enabled or torch.compiler.is_compiling() \
                or any(t.data_ptr() % INPUT_ALIGN_BYTES for t in inputs.values()):
            return interface(inputs)
        key = (*((name, t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for name, t in inputs.items()),
               *settings)
        replay = self.entries.get(key, _UNSEEN)
        if replay is not _UNSEEN and replay is not None and replay.checked:
            try:
                self.entries.move_to_end(key)
            except KeyError:  # another thread's call dropped it just now: this call still has it
                pass
            return replay.run(inputs)
        if replay is None:
            return interface(inputs)
        if next(iter(inputs.values())).is_cuda and torch.cuda.is_current_stream_capturing():
            return interface(inputs)  # recording and checking synchronise: later
        if replay is _UNSEEN:
            # Inputs sharing memory (k is v) would be told apart by position only: record a call without that.
            if len({t.data_ptr() for t in inputs.values()}) < len(inputs):
                return interface(inputs)
            if len(self.entries) >= MAX_SIGNATURES:
                self.entries.popitem(last=False)
            result, self.entries[key] = self._record(inputs, interface)
            return result
        return self._check(key, replay, inputs, interface, exact=deterministic)

    def _record(self, inputs, interface) -> tuple[tuple[torch.Tensor, ...], Replay | None]:
        recorder = _Recorder(threading.get_ident(), {t.data_ptr() for t in inputs.values()})
        with _RECORDING:
            saved = {name: getattr(self.iface, name).compile_cache for name in self.owners}
            try:
                for name, cache in saved.items():
                    getattr(self.iface, name).compile_cache = _RecordingCache(name, cache, recorder)
                result = interface(inputs)
            finally:
                for name, cache in saved.items():
                    getattr(self.iface, name).compile_cache = cache
        return result, self._replay_of(recorder, inputs, result)

    def _replay_of(self, recorder: _Recorder, inputs: dict[str, torch.Tensor], result: tuple) -> Replay | None:
        if not recorder.launches or len(result) != len(self.results) \
                or any(not isinstance(t, torch.Tensor) for t in result):
            return None
        known = {_layout(t): name for name, t in inputs.items()}
        call_memory = {t.data_ptr() for t in (*inputs.values(), *result)}
        allocs = {}
        for name, t in zip(self.results, result):
            if name in inputs:
                if _layout(t) != _layout(inputs[name]):  # a passed-in result must come back as itself
                    return None
                continue
            known.setdefault(_layout(t), name)
            allocs[name] = _alloc(t, recorder.zero_at_first_use.get(t.data_ptr(), False))
        buffer_of: dict[int, tuple[int, tuple]] = {}  # data pointer -> (index, layout)
        buffers: list[_Alloc] = []
        launches = []
        for _owner, fn, args, kwargs in recorder.launches:
            if kwargs:
                return None
            recorded = []
            for arg in args:
                if isinstance(arg, torch.Tensor):
                    layout = _layout(arg)
                    if layout in known:
                        recorded.append(_Tensor(name=known[layout]))
                        continue
                    if arg.data_ptr() in call_memory:
                        return None  # an input or result seen in another layout
                    seen = buffer_of.get(arg.data_ptr())
                    if seen is None:
                        seen = buffer_of[arg.data_ptr()] = (len(buffers), layout)
                        buffers.append(_alloc(arg, recorder.zero_at_first_use.get(arg.data_ptr(), True)))
                    elif seen[1] != layout:  # a buffer viewed two ways: not reproduced
                        return None
                    recorded.append(_Tensor(buffer=seen[0]))
                elif _constant(arg):
                    recorded.append(arg)
                else:  # an object the replay cannot vouch for (it might hold per-call state)
                    return None
            launches.append((fn, tuple(recorded)))
        written = {a.name for _, args in launches for a in args if isinstance(a, _Tensor)}
        if not set(allocs) <= written:  # a result no launch wrote (made by a torch op): not reproduced
            return None
        return Replay(tuple(launches), self.results, allocs, tuple(buffers))

    def _check(self, key, replay: Replay, inputs, interface, exact: bool) -> tuple[torch.Tensor, ...]:
        """The first replay of a signature, against the interface on the same inputs."""
        try:
            got = replay.run(inputs)
            want = interface(self._fresh_results(inputs))
            same = all(_close(a, b, exact) for a, b in zip(got, want))
        except Exception as exc:  # noqa: BLE001 - any failure keeps the interface for this signature
            logger.warning("flash-attn-4 replay failed its check (%s); this signature keeps the interface", exc)
            self.entries[key] = None
            return interface(inputs)
        if not same:
            logger.warning("flash-attn-4 replay differed from the interface; this signature keeps it")
            self.entries[key] = None
            for name, t in zip(self.results, want):  # the caller's own buffers hold the interface's results
                if name in inputs:
                    inputs[name].copy_(t)
            return tuple(inputs[name] if name in inputs else t for name, t in zip(self.results, want))
        replay.checked = True
        self._drop_needless_zeroing(replay, inputs, want, exact)
        return got

    def _fresh_results(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The call's inputs with the results it passes in (a preallocated out) swapped for new tensors: a check's
        run must not write into the caller's."""
        return {name: (torch.empty_like(t) if name in self.results else t) for name, t in inputs.items()}

    def _drop_needless_zeroing(self, replay: Replay, inputs, want: tuple, exact: bool) -> None:
        """A floating-point buffer or result that held zeros when first used may have been fresh memory that its
        first launch overwrites (flash-attn-4's dq_accum: torch.empty, zeroed by the preprocess kernel): a replay
        that zeroes it costs a memset a call. Poisoned instead, the replay must still give the interface's results,
        or every zeroing is kept. (Integer buffers, semaphores and tile counters, always keep theirs.)"""
        def may_skip(alloc: _Alloc) -> bool:
            return alloc.zeros and alloc.dtype.is_floating_point

        def poisoned(alloc: _Alloc, value: float | None) -> _Alloc:
            return replace(alloc, zeros=False, fill=value) if may_skip(alloc) else alloc

        if not any(map(may_skip, (*replay.buffers, *replay.allocs.values()))):
            return
        try:
            for value in POISONS:
                trial = replace(replay, buffers=tuple(poisoned(a, value) for a in replay.buffers),
                                allocs={n: poisoned(a, value) for n, a in replay.allocs.items()})
                if not all(_close(a, b, exact) for a, b in zip(trial.run(self._fresh_results(inputs)), want)):
                    return
        except Exception:  # noqa: BLE001 - an error under poison: the zeroing stays
            return
        replay.buffers = tuple(poisoned(a, None) for a in replay.buffers)
        replay.allocs = {n: poisoned(a, None) for n, a in replay.allocs.items()}


def _close(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if exact:
        return torch.equal(a, b)
    scale = b.abs().max().float().item() if b.numel() else 0.0
    return (a.float() - b.float()).abs().max().item() <= NONDETERMINISTIC_TOLERANCE * scale if b.numel() else True
