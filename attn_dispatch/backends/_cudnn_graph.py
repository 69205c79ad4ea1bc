"""cudnn-frontend SDPA graphs for the cuDNN engine: the key a graph bakes in, the builder, and the built graph's
launch data (which buffer goes in which slot of cuDNN's variant pack).

A built graph is launched the cheapest way the installed frontend offers, decided once per graph:
- 'raw': the backend's `_execute_with_raw_ptrs(ptr_array, n, workspace, handle, plan)`, the call cudnn-frontend
  1.32's own `pygraph.execute` ends in (cudnn/_pygraph.py `_execute`, backend path). The slot order is the
  backend's variant-pack order (`_variant_pack_uids()`, ascending uid), resolved to our buffer names at build
  time, so a call only gathers data pointers. Needs a backend plan (not a python CuTe-DSL engine).
- 'ordered': `execute(buffers, workspace, handle=, tensor_uids=)` (frontend >= 1.2x, validates per call).
- 'dict': `execute({graph tensor: buffer}, workspace, handle=)` (every frontend).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .base import EngineRefused

PYTHON_ENGINE_NAMES = ("sdpa_fwd_prefill", "sdpa_bwd_sm", "sdpa_fwd_decode")
EXECUTE_PATHS = ("raw", "ordered", "dict")


class CudnnGraphError(EngineRefused):
    """cuDNN (through cudnn-frontend) cannot build this attention graph. Carries cuDNN's own message."""

    def __init__(self, phase: str, stage: str, message: str, key: Any):
        self.phase, self.stage, self.cudnn_message, self.key = phase, stage, message, key
        super().__init__(f"cuDNN rejected the {phase} attention graph at {stage}: {message}")

    def fresh(self) -> "CudnnGraphError":
        """The same error without a traceback. Engines cache refusals as these and raise a new one each time:
        a cached exception that was raised keeps every frame it passed through alive (and the tensors and
        process groups in them) until the cyclic GC runs, or to interpreter exit."""
        return CudnnGraphError(self.phase, self.stage, self.cudnn_message, self.key)


@dataclass(frozen=True)
class SdpaKey:
    """Everything a cuDNN SDPA graph bakes in."""
    phase: str                 # 'fwd' | 'bwd'
    dtype: str                 # 'float16' | 'bfloat16' (| 'float32': CPU tests only)
    device: int
    b: int
    h: int
    hkv: int
    sq: int                    # graph S dims (thd: bucketed max sequence lengths)
    skv: int
    dqk: int
    dv: int
    strides: tuple             # ((name, (sb, sh, ss, sd)), ...) for every [b, h, s, d] operand
    ragged: bool               # thd
    ragged_tokens: tuple       # thd: ((name, token stride), ...) for the ragged offsets
    padding: bool
    alignment: str | None      # 'top_left' | 'bottom_right' | None
    left_bound: int | None
    right_bound: int | None
    bias: tuple | None         # (dims, strides) of the bias tensor
    bias_grad: bool
    alibi: bool                # cuDNN's built-in ALiBi
    dropout: float
    scale: float
    sink: bool
    sink_grad: bool
    deterministic: bool
    offsets_int64: bool
    stats_stride: tuple
    max_total: tuple = (0, 0)  # bwd, thd: token counts bounding the workspace
    rng_dump: bool = False     # tests: dump the dropout keep mask
    paged: tuple = ()          # fwd over a paged KV cache: (num_pages, page_size, table_pages, table_row_stride)

    def stride(self, name: str) -> tuple:
        return dict(self.strides)[name]


@dataclass
class Compiled:
    """A built graph and how to launch it."""
    graph: Any
    tensors: dict            # name -> graph tensor
    names: tuple             # operands in a fixed order (ordered / dict paths)
    uids: tuple | None
    workspace_size: int
    plan: str
    path: str = "dict"       # 'raw' | 'ordered' | 'dict'
    slots: tuple = ()        # raw: buffer name per variant-pack slot
    bound: dict = field(default_factory=dict)  # raw: name -> pointer of inputs the graph binds itself
    raw: Any = None          # raw: the backend graph's _execute_with_raw_ptrs
    plan_index: int = -1     # raw: the backend plan the build selected (-1: the backend's own choice)
    keep_alive: tuple = ()   # raw: the tensors behind `bound`


def _dtype_of(cudnn: Any, name: str) -> Any:
    dt = cudnn.data_type
    return {"float16": dt.HALF, "bfloat16": dt.BFLOAT16, "float32": dt.FLOAT}[name]


def contiguous_strides(dims: list[int]) -> list[int]:
    out, acc = [], 1
    for d in reversed(dims):
        out.append(acc)
        acc *= d
    return list(reversed(out))


class GraphBuilder:
    """Builds the forward or backward SDPA graph of one SdpaKey (pure description: no tensors involved)."""

    def __init__(self, cudnn: Any, key: SdpaKey, handle: Any, fe_version: tuple, allow_python_engines: bool,
                 path: str = "raw"):
        self.cudnn, self.key, self.fe_version, self.path = cudnn, key, fe_version, path
        dt = cudnn.data_type
        self.io = _dtype_of(cudnn, key.dtype)
        self.graph = cudnn.pygraph(io_data_type=self.io, intermediate_data_type=dt.FLOAT,
                                   compute_data_type=dt.FLOAT, handle=handle)
        self.tensors: dict[str, Any] = {}
        self.allow_python_engines = allow_python_engines

    # --- operands ---
    def _dims(self, name: str) -> list[int]:
        k = self.key
        heads = k.hkv if name in ("k", "v", "dk", "dv") else k.h
        seq = k.skv if name in ("k", "v", "dk", "dv") else k.sq
        d = k.dv if name in ("v", "dv", "o", "do") else k.dqk
        if k.paged and name in ("k", "v"):  # the page pool ('container'): [num_pages, h_kv, page_size, d]
            return [k.paged[0], heads, k.paged[1], d]
        return [k.b, heads, seq, d]

    def _offset(self, name: str) -> Any:
        t = self.tensors.get(name)
        if t is None:
            dtype = self.cudnn.data_type.INT64 if self.key.offsets_int64 else self.cudnn.data_type.INT32
            t = self.graph.tensor(name=name, dim=[self.key.b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dtype)
            self.tensors[name] = t
        return t

    def _ragged_name(self, operand: str) -> str:
        side = "q" if operand in ("q", "o", "do", "dq") else "kv"
        return f"off_{side}_{dict(self.key.ragged_tokens)[operand]}"

    def operand(self, name: str) -> Any:
        t = self.graph.tensor(name=name, dim=self._dims(name), stride=list(self.key.stride(name)), data_type=self.io)
        if self.key.ragged:
            t.set_ragged_offset(self._offset(self._ragged_name(name)))
        self.tensors[name] = t
        return t

    def output(self, name: str, t: Any) -> None:
        t.set_output(True).set_dim(self._dims(name)).set_stride(list(self.key.stride(name))).set_data_type(self.io)
        if self.key.ragged:
            t.set_ragged_offset(self._offset(self._ragged_name(name)))
        self.tensors[name] = t

    def small(self, name: str, dims: list[int], dtype: Any, stride: list[int] | None = None) -> Any:
        t = self.graph.tensor(name=name, dim=dims, stride=stride or contiguous_strides(dims), data_type=dtype)
        self.tensors[name] = t
        return t

    def stats(self, t: Any | None = None) -> Any:
        k = self.key
        if t is None:
            t = self.graph.tensor(name="stats", dim=[k.b, k.h, k.sq, 1], stride=list(k.stats_stride),
                                  data_type=self.cudnn.data_type.FLOAT)
        else:
            t.set_output(True).set_dim([k.b, k.h, k.sq, 1]).set_stride(list(k.stats_stride)) \
                .set_data_type(self.cudnn.data_type.FLOAT)
        if k.ragged:
            t.set_ragged_offset(self._offset("off_stats"))
        self.tensors["stats"] = t
        return t

    # --- the op's keyword arguments shared by forward and backward ---
    def common_kwargs(self) -> dict:
        c, k, f32, i32 = self.cudnn, self.key, self.cudnn.data_type.FLOAT, self.cudnn.data_type.INT32
        kw: dict[str, Any] = {"attn_scale": k.scale}
        if k.alignment is not None:
            kw["diagonal_alignment"] = (c.diagonal_alignment.TOP_LEFT if k.alignment == "top_left"
                                        else c.diagonal_alignment.BOTTOM_RIGHT)
            if k.left_bound is not None:
                kw["diagonal_band_left_bound"] = k.left_bound
            if k.right_bound is not None:
                kw["diagonal_band_right_bound"] = k.right_bound
        if k.padding:
            kw["use_padding_mask"] = True
            kw["seq_len_q"] = self.small("seq_len_q", [k.b, 1, 1, 1], i32)
            kw["seq_len_kv"] = self.small("seq_len_kv", [k.b, 1, 1, 1], i32)
        if k.bias is not None:
            dims, strides = k.bias
            kw["bias"] = self.small("bias", list(dims), self.io, list(strides))
        if k.alibi:
            kw["use_alibi_mask"] = True
        if k.dropout > 0:
            i64 = c.data_type.INT64
            kw["dropout"] = (k.dropout, self.small("seed", [1, 1, 1, 1], i64), self.small("offset", [1, 1, 1, 1], i64))
        if k.sink:
            kw["sink_token"] = self.small("sink", [1, k.h, 1, 1], f32)
        if k.paged:  # cudnn-frontend sdpa: page tables [b, 1, pages per sequence, 1] index the containers
            _, page_size, pages, row_stride = k.paged
            for side in ("k", "v"):
                kw[f"paged_attention_{side}_table"] = self.small(f"page_table_{side}", [k.b, 1, pages, 1], i32,
                                                                 [row_stride, row_stride, 1, 1])
            kw["paged_attention_max_seq_len_kv"] = k.skv
        return kw

    def build_forward(self) -> Compiled:
        g, k = self.graph, self.key
        q, kk, v = self.operand("q"), self.operand("k"), self.operand("v")
        kw = self.common_kwargs()
        if self.fe_version >= (1, 13):
            kw["generate_stats"] = True
        else:
            kw["is_inference"] = False
        if k.rng_dump:
            kw["rng_dump"] = self.small("rng_dump", [k.b, k.h, k.sq, k.skv], self.cudnn.data_type.FLOAT)
        o, stats = g.sdpa(q=q, k=kk, v=v, name="sdpa", **kw)
        self.output("o", o)
        self.stats(stats)
        return self.finish()

    def build_backward(self) -> Compiled:
        g, k = self.graph, self.key
        q, kk, v = self.operand("q"), self.operand("k"), self.operand("v")
        o, do = self.operand("o"), self.operand("do")
        stats = self.stats()
        kw = self.common_kwargs()
        kw["use_deterministic_algorithm"] = k.deterministic
        if k.ragged:
            kw["max_total_seq_len_q"], kw["max_total_seq_len_kv"] = k.max_total
        if k.bias_grad:
            dims, _ = k.bias
            kw["dBias"] = self.small("dbias", list(dims), self.io)
        if k.sink:  # dSink whenever a sink is given (the combination run on the H100); used when it has a grad
            kw["dSink_token"] = self.small("dsink", [1, k.h, 1, 1], self.cudnn.data_type.FLOAT)
        dq, dk, dv = g.sdpa_backward(q=q, k=kk, v=v, o=o, dO=do, stats=stats, name="sdpa_backward", **kw)
        for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
            self.output(name, t)
        if k.bias_grad:
            self.tensors["dbias"].set_output(True)
        if k.sink:
            self.tensors["dsink"].set_output(True)
        return self.finish()

    def finish(self) -> Compiled:
        g = self.graph
        workspace = build_graph(self.cudnn, g, self.key.phase, self.key, self.allow_python_engines)
        names = tuple(sorted(self.tensors))
        try:
            uids = tuple(int(self.tensors[n].get_uid()) for n in names)
        except Exception:  # noqa: BLE001 - older bindings: the dict form of execute
            uids = None
        compiled = Compiled(g, dict(self.tensors), names, uids, workspace, plan_name(g),
                            path="ordered" if uids is not None else "dict")
        if self.path == "raw" and uids is not None:
            _attach_raw_path(compiled)
        elif self.path == "dict":
            compiled.path = "dict"
        return compiled


def build_graph(cudnn: Any, g: Any, phase: str, key: Any, allow_python_engines: bool = False) -> int:
    """validate -> operation graph -> plans (heuristics A, then fallback) -> support check -> built plans; the
    workspace size. Every cuDNN failure becomes one CudnnGraphError naming the stage and cuDNN's message."""
    stage = "validate"
    try:
        g.validate()
        stage = "build_operation_graph"
        g.build_operation_graph()
        stage = "create_execution_plans"
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        if not allow_python_engines and has_python_plans(g):
            g.deselect_engines(list(PYTHON_ENGINE_NAMES))
        stage = "check_support"
        g.check_support()
        stage = "build_plans"
        g.build_plans()
        return int(g.get_workspace_size())
    except Exception as exc:  # noqa: BLE001 - every cuDNN failure becomes one clear error
        raise CudnnGraphError(phase, stage, f"{type(exc).__name__}: {exc}".strip(), key) from exc


def plan_name(graph: Any) -> str:
    """The engine the build selected: a python engine's name, else the backend plan's (e.g. 'eng8_k...')."""
    engine = getattr(graph, "selected_engine", None)
    if engine is not None:
        return getattr(engine, "name", None) or "python engine"
    try:
        return "cudnn backend " + str(graph.get_plan_name_at_index(graph._plan_index))
    except Exception:  # noqa: BLE001 - informational only
        return "cudnn backend"


def _attach_raw_path(compiled: Compiled) -> None:
    """Resolve the backend's variant-pack order to buffer names once; leave the ordered path on anything
    unexpected (a python engine selected, a slot we cannot name, a frontend without these internals)."""
    g = compiled.graph
    try:
        if getattr(g, "selected_engine", None) is not None:
            return
        lowered = g._lowered_graph
        raw = getattr(lowered, "_execute_with_raw_ptrs", None)
        order = g._variant_pack_uids()
        plans = g._plans
        if raw is None or not order:
            return
        index = g._materialize_backend_plan(g._plan_index).cpp_index if plans else None
        name_of = dict(zip(compiled.uids, compiled.names))
        bindings = getattr(g, "_data_bindings", {}) or {}
        slots, bound = [], {}
        for uid in order:
            name = name_of.get(int(uid))
            if name is None:
                data = bindings.get(uid)
                if data is None or not hasattr(data, "data_ptr"):
                    return
                name = f"_bound_{uid}"
                bound[name] = data
            slots.append(name)
    except Exception:  # noqa: BLE001 - private frontend internals: fall back to the public execute
        return
    compiled.slots, compiled.raw, compiled.path = tuple(slots), raw, "raw"
    compiled.bound = {n: d.data_ptr() for n, d in bound.items()}
    compiled.plan_index = -1 if index is None else int(index)
    compiled.keep_alive = tuple(bound.values())


def has_python_plans(graph: Any) -> bool:
    """Whether cudnn-frontend ranked one of its own CuTe-DSL engines for this graph (frontend >= 1.2x)."""
    try:
        from cudnn.engines.engine_ids import is_python_engine
    except ImportError:
        return False
    return any(is_python_engine(cfg.engine_id) for cfg in getattr(graph, "plans", ()) or ())
