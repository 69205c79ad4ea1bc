"""Megatron-core: run a GPT's (or any layer spec's) core attention through attn_dispatch, with one line:

    from attn_dispatch.integrations.megatron import with_attn_dispatch
    layer_spec = with_attn_dispatch(get_gpt_layer_local_spec())     # or the Transformer Engine spec

`DispatchedCoreAttention` takes the constructor and forward Megatron gives its `core_attention` submodule
(the local DotProductAttention's, plus TEDotProductAttention's k_channels / v_channels / num_splits) and maps them
to attn_dispatch.DotProductAttention's (Transformer Engine's) meaning, as Megatron's own TEDotProductAttention
wrapper maps them for Transformer Engine: mask type, softmax scale, sliding window, softmax offsets (sinks),
dropout under Megatron's RNG tracker, tensor-parallel heads, PackedSeqParams as thd, context parallelism from
Megatron's process groups, and the max logit that qk-clip reads. What has no meaning here is refused when the
layer is built, naming the setting, its value and what is allowed. Megatron-core is imported only when used;
its version differences are handled by looking for the feature, not the version number.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from typing import Any

import torch

from ..env import EnvFlags
from ..module import DotProductAttention
from ..params import CP_COMM_TYPES

# The oldest megatron-core whose core-attention interface (constructor keywords, forward, PackedSeqParams) this
# module was checked against; older ones are refused with this number.
MIN_MEGATRON_CORE = "0.12.0"

# Megatron's AttnMaskType member name -> attn_dispatch's mask type (Transformer Engine's names: the same words).
MASK_TYPES = {
    "no_mask": "no_mask", "padding": "padding", "causal": "causal", "padding_causal": "padding_causal",
    "arbitrary": "arbitrary", "causal_bottom_right": "causal_bottom_right",
}
# Packed (thd) calls take their sequences from cu_seqlens, so their mask type must be a padding one; Megatron's
# TEDotProductAttention promotes the plain types the same way.
_THD_MASK_TYPES = {"no_mask": "padding", "causal": "padding_causal",
                   "causal_bottom_right": "padding_causal_bottom_right"}
# Mask types that take no mask tensor: Megatron's data loaders still build a causal mask, which the Transformer
# Engine path does not use either.
_TENSORLESS_MASK_TYPES = ("no_mask", "causal", "causal_bottom_right")

# The core-attention classes with_attn_dispatch replaces, as (module, class name): matched by name so that a spec
# naming Transformer Engine's class can be rewritten where Transformer Engine is not installed.
REPLACED_CORE_ATTENTION = (
    ("megatron.core.transformer.dot_product_attention", "DotProductAttention"),
    ("megatron.core.extensions.transformer_engine", "TEDotProductAttention"),
)


def megatron_core_version() -> str:
    """The installed megatron-core's version; ImportError (with the install line) when it is missing or older
    than MIN_MEGATRON_CORE."""
    from importlib import metadata

    from packaging.version import Version

    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise ImportError("attn_dispatch.integrations.megatron needs megatron-core: pip install "
                          f"'attn-dispatch[megatron]' (megatron-core >= {MIN_MEGATRON_CORE})") from exc
    try:
        version = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:  # a source checkout of Megatron-LM
        from megatron.core import package_info

        version = package_info.__version__
    if Version(version) < Version(MIN_MEGATRON_CORE):
        raise ImportError(f"megatron-core {version} is installed; attn_dispatch.integrations.megatron supports "
                          f"megatron-core >= {MIN_MEGATRON_CORE} (pip install 'megatron-core>={MIN_MEGATRON_CORE}')")
    return version


class DispatchedCoreAttention(DotProductAttention):
    """Megatron-core's core attention, run by attn_dispatch: sbhd q, k, v in ([s, b, h, d]; [t, h, d] with
    PackedSeqParams), [s, b, h*dv] out ([t, h*dv] packed). `last_decision` and `explain()` (which takes this
    forward's arguments) say which engine ran and why."""

    # The base class's shortcut reads Transformer Engine's forward arguments; this forward takes Megatron's.
    __call__ = torch.nn.Module.__call__

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None, *, k_channels: int | None = None,
                 v_channels: int | None = None, num_splits: int | None = None, model_comm_pgs: Any = None,
                 **unsupported: Any) -> None:
        megatron_core_version()
        if unsupported:
            raise ValueError(f"DispatchedCoreAttention got arguments it cannot map: {sorted(unsupported)}; it takes "
                             "Megatron's core-attention arguments (config, layer_number, attn_mask_type, "
                             "attention_type, attention_dropout, softmax_scale, cp_comm_type, pg_collection) and "
                             "TEDotProductAttention's k_channels, v_channels and num_splits (None)")
        _refuse_unmapped_config(config, num_splits)
        groups = _process_groups(pg_collection if pg_collection is not None else model_comm_pgs)
        cp_group, cp_global_ranks, comm = _context_parallel(config, groups, cp_comm_type)
        layer_number = max(1, layer_number)  # as Megatron's own core attention counts layers
        window = _layer_window(config, layer_number)
        tracker = _rng_tracker()
        super().__init__(
            num_attention_heads=config.num_attention_heads, kv_channels=_kv_channels(config, k_channels, v_channels),
            num_gqa_groups=config.num_query_groups,
            attention_dropout=config.attention_dropout if attention_dropout is None else attention_dropout,
            qkv_format="sbhd", attn_mask_type=mask_type_name(attn_mask_type, "attn_mask_type"),
            window_size=window, sequence_parallel=bool(config.sequence_parallel),
            tp_size=config.tensor_model_parallel_size, tp_group=groups.tp,
            get_rng_state_tracker=tracker, layer_number=layer_number, attention_type=attention_type,
            cp_group=cp_group, cp_global_ranks=cp_global_ranks, cp_comm_type=comm, softmax_scale=softmax_scale,
            softmax_type=getattr(config, "softmax_type", "vanilla"),
            return_max_logit=bool(getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit",
                                                                                False)))
        self.config = config
        self.sliding_window = window  # this layer's window from the config (None: full attention)
        self.current_max_attn_logits: torch.Tensor | None = None  # read (and reset) by Megatron's qk-clip
        if self.softmax_type == "learnable":
            self._init_learnable_offset(config)

    def _init_learnable_offset(self, config: Any) -> None:
        """The learnable sink logits as Megatron's own core attention makes them: params_dtype, config.init_method
        (so that switching keeps the model's initialisation)."""
        offset = torch.nn.Parameter(torch.zeros(self._heads_local, dtype=config.params_dtype))
        if getattr(config, "perform_initialization", True) and getattr(config, "init_method", None) is not None:
            with torch.no_grad():
                config.init_method(offset)
        self.softmax_offset = offset

    # --- forward -----------------------------------------------------------------------------------------
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None = None, attn_mask_type: Any = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None,
                num_splits: int | None = None) -> torch.Tensor:
        if num_splits is not None:
            raise ValueError(f"num_splits={num_splits!r}: attn_dispatch does not split the KV sequence on request "
                             "(a FlashAttention-3 option); pass None")
        if packed_seq_params is not None:
            self._follow_dynamic_cp(packed_seq_params)
        kwargs = self.call_arguments(query, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        out = super().forward(query, key, value, **kwargs) if kwargs else super().forward(query, key, value)
        if self.return_max_logit:
            out, max_logit = out
            # Megatron's qk-clip reads the largest logit per head since it last reset this attribute.
            self.current_max_attn_logits = max_logit if self.current_max_attn_logits is None else \
                torch.maximum(self.current_max_attn_logits, max_logit)
        return out

    def explain(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None = None, attn_mask_type: Any = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None):
        """The Decision forward would act on for these (forward's) arguments, without running it."""
        kwargs = self.call_arguments(query, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        return super().explain(query, key, value, **kwargs)

    def call_arguments(self, query: torch.Tensor, attention_mask: Any, attn_mask_type: Any, attention_bias: Any,
                       packed_seq_params: Any) -> dict[str, Any]:
        """Megatron's forward arguments as attn_dispatch.DotProductAttention's keywords ({} for a plain call)."""
        kwargs: dict[str, Any] = {}
        mask_type = self.attn_mask_type if attn_mask_type is None else \
            mask_type_name(attn_mask_type, "attn_mask_type")
        fmt = "sbhd"
        if packed_seq_params is not None:
            fmt = _packed_format(packed_seq_params)
            kwargs.update(_packed_arguments(packed_seq_params))
            if fmt == "thd":
                kwargs["qkv_format"] = "thd"
                mask_type = _THD_MASK_TYPES.get(mask_type, mask_type)
                attention_mask = None  # cu_seqlens say where each sequence is
        elif mask_type == "no_mask" and self.sliding_window is not None and query.shape[0] == 1:
            mask_type = "causal_bottom_right"  # a decode step with a sliding window: the window ends at the query
        if mask_type in _TENSORLESS_MASK_TYPES:
            attention_mask = None
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if mask_type != self.attn_mask_type:
            kwargs["attn_mask_type"] = mask_type
        if attention_bias is not None:  # Megatron's bias is added to the scaled logits, as Transformer Engine's
            kwargs.update(core_attention_bias_type="post_scale_bias", core_attention_bias=attention_bias)
        return kwargs

    def _follow_dynamic_cp(self, packed_seq_params: Any) -> None:
        """PackedSeqParams may carry this batch's CP group (Megatron's dynamic context parallelism), or
        local_cp_size=1 to run without one: the group stays until the next such call, as in TEDotProductAttention."""
        group, local_cp_size = getattr(packed_seq_params, "cp_group", None), \
            getattr(packed_seq_params, "local_cp_size", None)
        if group is None and local_cp_size is None:
            return
        if group is None and local_cp_size != 1:
            raise ValueError(f"packed_seq_params.local_cp_size={local_cp_size!r} without a cp_group: only 1 (turn "
                             "context parallelism off for this batch) can be served without the group")
        if self.cp_comm_type == "a2a+p2p" and group is not None:
            raise ValueError("packed_seq_params.cp_group with cp_comm_type='a2a+p2p': a dynamic CP group is one "
                             "process group, while 'a2a+p2p' runs over two (Megatron's hierarchical CP groups)")
        if group is self.cp_group:
            return
        ranks = None if group is None else torch.distributed.get_process_group_ranks(group)
        self.set_context_parallel_group(group, ranks, None, self.cp_comm_type)
        self._forget_plans()  # plans made for the previous group's size

    # --- checkpoints ---------------------------------------------------------------------------------------
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron's distributed checkpoint of this module: the learnable softmax offsets, split across
        tensor-parallel ranks along the head dimension (as Megatron's own core attention saves them)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = {"softmax_offset": self.softmax_offset} if self.softmax_type == "learnable" else {}
        accepted = inspect.signature(make_sharded_tensors_for_checkpoint).parameters
        extra: dict[str, Any] = {}
        if "tp_group" in accepted:
            extra["tp_group"] = self.tp_group
        if "dp_cp_group" in accepted:
            from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

            extra["dp_cp_group"] = ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"]
        return make_sharded_tensors_for_checkpoint(state, prefix, {"softmax_offset": 0}, sharded_offsets, **extra)


def mask_type_name(mask_type: Any, name: str) -> str:
    """attn_dispatch's mask type for a Megatron AttnMaskType member (or its name)."""
    key = mask_type if isinstance(mask_type, str) else getattr(mask_type, "name", None)
    if key not in MASK_TYPES:
        raise ValueError(f"{name}={mask_type!r} has no attn_dispatch equivalent; expected an AttnMaskType among "
                         f"{', '.join(MASK_TYPES)}")
    return MASK_TYPES[key]


@dataclasses.dataclass(frozen=True)
class _Groups:
    tp: Any
    cp: Any
    hcp: Any


def _process_groups(collection: Any) -> _Groups:
    """Megatron's tensor-, context- and hierarchical-context-parallel groups: from the layer's process-group
    collection (pg_collection; model_comm_pgs before megatron-core 0.15), else from parallel_state."""
    if collection is not None:
        return _Groups(getattr(collection, "tp", None), getattr(collection, "cp", None),
                       getattr(collection, "hcp", None))
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return _Groups(None, None, None)
    hcp = None
    if hasattr(ps, "get_hierarchical_context_parallel_groups"):
        hcp = ps.get_hierarchical_context_parallel_groups(check_initialized=False)
    return _Groups(ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group(check_initialized=False), hcp)


def _context_parallel(config: Any, groups: _Groups, cp_comm_type: str | None) -> tuple[Any, Any, str]:
    """(cp_group, cp_global_ranks, cp_comm_type) for the module, as TEDotProductAttention hands them to
    Transformer Engine; no group when config.context_parallel_size is 1."""
    size = getattr(config, "context_parallel_size", 1)
    comm = "p2p" if cp_comm_type is None else cp_comm_type
    if comm not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type={cp_comm_type!r} is not supported; expected one of "
                         f"{', '.join(map(repr, CP_COMM_TYPES))} (or None for 'p2p')")
    if size == 1:
        return None, None, comm
    if comm == "a2a+p2p":
        hcp = groups.hcp
        if not isinstance(hcp, (list, tuple)) or len(hcp) != 2 or any(g is None for g in hcp):
            raise ValueError(f"cp_comm_type='a2a+p2p' needs Megatron's two hierarchical context-parallel groups "
                             f"(a2a inside, p2p across); got {hcp!r}: set config.hierarchical_context_parallel_sizes "
                             "(two sizes) when initializing parallel_state, or pass pg_collection with hcp")
        return list(hcp), None, comm
    if groups.cp is None:
        raise ValueError(f"config.context_parallel_size={size} but there is no context-parallel group: initialize "
                         "megatron.core.parallel_state (initialize_model_parallel(context_parallel_size=...)) or "
                         "pass pg_collection with cp")
    group_size = torch.distributed.get_world_size(groups.cp)
    if group_size != size:
        raise ValueError(f"config.context_parallel_size={size} but the context-parallel group has {group_size} ranks")
    return groups.cp, torch.distributed.get_process_group_ranks(groups.cp), comm


def _kv_channels(config: Any, k_channels: int | None, v_channels: int | None) -> int | tuple[int, int]:
    if (k_channels is None) != (v_channels is None):
        raise ValueError(f"k_channels={k_channels!r}, v_channels={v_channels!r}: give both head dims (query/key and "
                         "value, as multi-latent attention does) or neither (config.kv_channels for both)")
    if k_channels is None:
        return config.kv_channels
    return (k_channels, v_channels) if k_channels != v_channels else k_channels


def _layer_window(config: Any, layer_number: int) -> tuple[int, int] | None:
    """config.window_size where this layer has a sliding window (config.window_attn_skip_freq picks the layers
    where megatron-core has it), else None."""
    window = getattr(config, "window_size", None)
    if window is None:
        return None
    try:
        from megatron.core.transformer.utils import is_layer_window_attention
    except ImportError:  # before window_attn_skip_freq: every layer has the window
        return tuple(window)
    return tuple(window) if is_layer_window_attention(window, getattr(config, "window_attn_skip_freq", None),
                                                      layer_number) else None


def _rng_tracker():
    """Megatron's CUDA RNG tracker getter where the tracker holds states (model_parallel_cuda_manual_seed ran), as
    TEDotProductAttention passes it; None otherwise (dropout then draws from torch's default generator)."""
    from megatron.core import tensor_parallel

    get_tracker = tensor_parallel.get_cuda_rng_tracker
    return get_tracker if get_tracker().is_initialized() else None


def _refuse_unmapped_config(config: Any, num_splits: int | None) -> None:
    """Megatron settings this module cannot honour: each refused with what it would need."""
    for field in ("num_attention_heads", "kv_channels", "num_query_groups"):
        if getattr(config, field, None) is None:
            raise ValueError(f"config.{field} is None: pass a megatron.core TransformerConfig (its __post_init__ "
                             "fills kv_channels and num_query_groups)")
    if num_splits is not None:
        raise ValueError(f"num_splits={num_splits!r}: attn_dispatch does not split the KV sequence on request "
                         "(a FlashAttention-3 option); pass None")
    if getattr(config, "batch_invariant_mode", False):
        raise ValueError("config.batch_invariant_mode=True: attn_dispatch does not promise outputs independent of "
                         "the batch (the engine can change with the batch's shape); set it to False")
    backend = getattr(config, "attention_backend", None)
    if getattr(backend, "name", None) == "local":
        raise ValueError("config.attention_backend=AttnBackend.local asks for Megatron's own core attention (and "
                         "sets NVTE_FLASH_ATTN=NVTE_FUSED_ATTN=NVTE_UNFUSED_ATTN=0, which leaves attn_dispatch no "
                         "engine); use AttnBackend.auto (attn_dispatch chooses), flash, fused or unfused")
    if getattr(config, "fp8_dot_product_attention", False) or getattr(config, "fp8_multi_head_attention", False):
        raise ValueError("config.fp8_dot_product_attention / fp8_multi_head_attention: Megatron runs FP8 attention "
                         "inside Transformer Engine's fp8_autocast, which attn_dispatch does not read (its FP8 "
                         "attention runs inside attn_dispatch.fp8_autocast); set both to False")
    if getattr(config, "deterministic_mode", False) and EnvFlags.from_environ().allow_nondeterministic \
            and not torch.are_deterministic_algorithms_enabled():
        raise ValueError("config.deterministic_mode=True but attn_dispatch may pick non-deterministic kernels: set "
                         "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (as Megatron requires for Transformer Engine) or call "
                         "torch.use_deterministic_algorithms(True)")
    dropout = getattr(config, "attention_dropout", 0.0)
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0 or math.isnan(dropout):
        raise ValueError(f"config.attention_dropout={dropout!r} must be a float in [0, 1)")


def _packed_format(packed_seq_params: Any) -> str:
    fmt = getattr(packed_seq_params, "qkv_format", None)
    if fmt is None or fmt == "sbhd":
        return "sbhd"
    if fmt != "thd":
        raise ValueError(f"packed_seq_params.qkv_format={fmt!r}: Megatron's attention hands its core attention sbhd "
                         "tensors, or thd ones for packed sequences; expected 'thd', 'sbhd' or None")
    return fmt


def _packed_arguments(packed_seq_params: Any) -> dict[str, Any]:
    """PackedSeqParams' sequence fields as forward keywords (those set; max lengths as ints)."""
    kwargs: dict[str, Any] = {}
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        value = getattr(packed_seq_params, name, None)
        if value is not None:
            kwargs[name] = value
    for name in ("max_seqlen_q", "max_seqlen_kv"):
        value = getattr(packed_seq_params, name, None)
        if value is not None:  # a 0-d tensor before megatron-core 0.14
            kwargs[name] = int(value)
    return kwargs


# --- layer specs ------------------------------------------------------------------------------------------
def with_attn_dispatch(spec: Any) -> Any:
    """A copy of a Megatron layer spec (get_gpt_layer_local_spec(), get_gpt_layer_with_transformer_engine_spec(),
    ...), or of a block spec holding layer specs, in which every core_attention that is Megatron's
    DotProductAttention or TEDotProductAttention is DispatchedCoreAttention (its params kept). Any other
    core_attention is refused, naming it: its semantics may differ from dot-product attention's."""
    megatron_core_version()
    from megatron.core.transformer.spec_utils import ModuleSpec

    result = copy.deepcopy(spec)
    replaced: list[str] = []

    def visit(node: Any, path: str) -> None:
        if isinstance(node, ModuleSpec):
            visit(node.submodules, f"{path}.submodules")
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for field in dataclasses.fields(node):
                value = getattr(node, field.name)
                where = f"{path}.{field.name}"
                if field.name == "core_attention" and value is not None:
                    setattr(node, field.name, _dispatched(value, where, ModuleSpec))
                    replaced.append(where)
                else:
                    visit(value, where)
        elif isinstance(node, (list, tuple)):
            for i, item in enumerate(node):
                visit(item, f"{path}[{i}]")

    visit(result, "spec")
    if not replaced:
        raise ValueError(f"with_attn_dispatch found no core_attention in {type(spec).__name__}; pass a layer spec "
                         "such as get_gpt_layer_local_spec(), or a block spec holding layer specs")
    return result


def _dispatched(value: Any, where: str, module_spec: type) -> Any:
    module, params = (value.module, value.params) if isinstance(value, module_spec) else (value, {})
    if isinstance(module, tuple):
        name = tuple(module)
    elif isinstance(module, type):
        name = (module.__module__, module.__qualname__)
    else:
        name = (type(module).__module__, repr(module))
    if name == (DispatchedCoreAttention.__module__, DispatchedCoreAttention.__qualname__):
        return value
    if name not in REPLACED_CORE_ATTENTION:
        allowed = ", ".join(f"{m}.{c}" for m, c in REPLACED_CORE_ATTENTION)
        raise ValueError(f"{where} is {name[0]}.{name[1]}; with_attn_dispatch replaces only {allowed} (another "
                         "core attention may compute something else)")
    return module_spec(module=DispatchedCoreAttention, params=dict(params)) if params else DispatchedCoreAttention
