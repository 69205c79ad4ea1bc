"""Check factories shared by several tables. Each returns a Check with the table's code prefix."""
from __future__ import annotations

from packaging.version import Version

from ..env import EnvFlags
from ..params import AttentionParams
from ..platform import ENGINE_PACKAGES, Platform
from .base import Check, Failure, Table, fail
from .context_parallel import params_failures

_ENV_NAME = {"flash": "NVTE_FLASH_ATTN", "cudnn_fused": "NVTE_FUSED_ATTN", "unfused": "NVTE_UNFUSED_ATTN"}
TE_SELECTION = "Transformer Engine, pytorch/attention/dot_product_attention/utils.py get_attention_backend"


def env_variable_for(family: str) -> str:
    return _ENV_NAME["flash" if family.startswith("flash_attn") else family]


def env_enabled(table: Table) -> Check:
    var = env_variable_for(table.family)

    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        if not env.family_enabled(table.family):
            return fail(f"{var}=0 disables {table.family}", f"unset {var} or set {var}=1")
        return None
    return Check(f"{table.family}.env_disabled", f"{var} is not 0", "environment",
                 "Transformer Engine environment variables (NVTE_FLASH_ATTN, NVTE_FUSED_ATTN, NVTE_UNFUSED_ATTN)", fn)


def on_cuda(table: Table, *, min_sm: int, max_sm: int | None = None, source: str, why: str = "") -> Check:
    """A CUDA call on a GPU with min_sm <= compute capability <= max_sm."""
    span = f"sm{min_sm}" if max_sm == min_sm else f"sm{min_sm}" + (f"..sm{max_sm}" if max_sm is not None else "+")

    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        if p.device_type != "cuda" or plat.device_type != "cuda":
            where = "the tensors are on the CPU" if p.device_type != "cuda" else "this platform has no CUDA GPU"
            return fail(f"{table.family} needs a CUDA GPU ({span}); {where}", "move q, k, v to a CUDA device"
                        if p.device_type != "cuda" else None)
        if plat.sm < min_sm or (max_sm is not None and plat.sm > max_sm):
            return fail(f"{table.family} ({table.provider}) needs compute capability {span}"
                        f"{' ' + why if why else ''}; this GPU ({plat.device_name}) is sm{plat.sm}")
        return None
    return Check(f"{table.family}.compute_capability", f"CUDA device, {span}", "platform", source, fn)


def package(table: Table, key: str, *, minimum: str | None, tested_max: str | None = None, source: str,
            name: str = "package") -> Check:
    """Installed, at least `minimum`; above `tested_max` needs ATTN_DISPATCH_ALLOW_UNTESTED_VERSIONS=1."""
    distribution, module = ENGINE_PACKAGES[key]
    bounds = f">= {minimum}" if minimum else "any version"
    if tested_max:
        bounds += f", tested up to {tested_max}"

    minimum_version = Version(minimum) if minimum else None
    tested_release = Version(tested_max).release if tested_max else None

    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        status = plat.package(key)
        if not status.installed:
            return fail(f"{distribution} is not available: {status.error or 'not installed'}",
                        f"pip install '{distribution}{'>=' + minimum if minimum else ''}'")
        version = plat.package_version(key)
        if version is None:
            return None  # 'unknown' version: the import check decides
        if minimum_version is not None and version < minimum_version:
            return fail(f"{distribution} {status.version} is installed; {table.id} needs >= {minimum}",
                        f"pip install -U '{distribution}>={minimum}'")
        if tested_release and version.release > tested_release and not env.allow_untested_versions:
            return fail(f"{distribution} {status.version} is newer than the newest release tested here "
                        f"({tested_max}); it is not used unless allowed",
                        "set ATTN_DISPATCH_ALLOW_UNTESTED_VERSIONS=1 to use it anyway, "
                        f"or pip install '{distribution}<={tested_max}'")
        return None
    return Check(f"{table.family}.{name}", f"{distribution} {bounds}", "package", source, fn)


def loads(table: Table) -> Check:
    """The engine's package imported without error in this process (checked once it was first tried)."""
    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        error = plat.facts.load_failures.get(table.id)
        if error:
            return fail(f"{table.id} failed to load in this process: {error}",
                        "reinstall the package; `attn-dispatch platform` shows what was found")
        return None
    return Check(f"{table.family}.{table.provider}_loads", "the engine imports without error", "package",
                 "observed at run time", fn)


def dtypes(table: Table, allowed: tuple[str, ...], *, source: str) -> Check:
    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        if p.dtype not in allowed:
            return fail(f"dtype {p.dtype} is not supported by {table.id}; it takes {', '.join(allowed)}",
                        f"cast q, k, v to {' or '.join(allowed)}" if "bfloat16" in allowed else None)
        return None
    return Check(f"{table.family}.dtype", "dtype in " + ", ".join(allowed), "dtype", source, fn)


def masks(table: Table, allowed: tuple[str, ...], *, source: str) -> Check:
    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        if p.attn_mask_type not in allowed:
            return fail(f"attn_mask_type={p.attn_mask_type!r} is not supported by {table.id}; "
                        f"it supports {', '.join(allowed)}")
        return None
    return Check(f"{table.family}.mask_type", "attn_mask_type in " + ", ".join(allowed), "mask", source, fn)


def formats(table: Table, allowed: tuple[str, ...], *, source: str) -> Check:
    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        if p.qkv_format not in allowed:
            return fail(f"qkv_format={p.qkv_format!r} is not supported by {table.id}; it takes {', '.join(allowed)}")
        return None
    return Check(f"{table.family}.qkv_format", "qkv_format in " + ", ".join(allowed), "format", source, fn)


def bias_types(table: Table, allowed: tuple[str, ...], *, source: str) -> Check:
    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        if p.bias_type not in allowed:
            return fail(f"core_attention_bias_type={p.bias_type!r} is not supported by {table.id}; "
                        f"it supports {', '.join(allowed)}")
        return None
    return Check(f"{table.family}.bias_type", "bias type in " + ", ".join(allowed), "bias", source, fn)


def softmax_types(table: Table, allowed: tuple[str, ...], *, source: str) -> Check:
    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        if p.softmax_type not in allowed:
            return fail(f"softmax_type={p.softmax_type!r} is not supported by {table.id}; "
                        f"it supports {', '.join(allowed)}")
        return None
    return Check(f"{table.family}.softmax_type", "softmax_type in " + ", ".join(allowed), "softmax", source, fn)


def no_dropout(table: Table, *, source: str) -> Check:
    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        if p.dropout > 0 and p.is_training:
            return fail(f"attention_dropout={p.dropout} but {table.id} has no dropout",
                        "set attention_dropout=0, or run in eval mode")
        return None
    return Check(f"{table.family}.dropout", "no attention dropout", "dropout", source, fn)


def no_fp8(table: Table, *, source: str) -> Check:
    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        if p.fp8 or p.dtype == "fp8":
            return fail(f"FP8 attention is not implemented by {table.id} in attn-dispatch",
                        "FP8 calls run on cudnn_fused:fp8 (cuDNN's FP8 SDPA, Hopper and newer)")
        return None
    return Check(f"{table.family}.fp8", "no FP8", "dtype", source, fn)


def no_return_max_logit(table: Table, *, source: str) -> Check:
    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        if p.return_max_logit:
            return fail(f"return_max_logit=True is not supported by {table.id}", "use the unfused engine")
        return None
    return Check(f"{table.family}.return_max_logit", "return_max_logit=False", "softmax", source, fn)


TE_KV_FILTER = ("Transformer Engine attention/dot_product_attention/utils.py get_attention_backend "
                "('Filter: KV cache' table)")


def kv_cache(table: Table, *, contiguous: bool, paged: bool, page_multiple: int = 1, source: str,
             why_not: str = "") -> Check:
    """KV-cache inference (InferenceParams): which caches the engine attends in place. why_not says why one
    it cannot take is refused (e.g. its kernel has no page table)."""
    kinds = [name for name, ok in (("contiguous", contiguous), ("paged", paged)) if ok]
    requires = ("KV cache: " + " or ".join(kinds)) if kinds else "no inference KV cache"
    if paged and page_multiple > 1:
        requires += f" (page_size % {page_multiple} == 0)"

    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        if not p.inference_kv_cache:
            return None
        kind = "paged" if p.kv_cache_paged else "contiguous"
        if kind not in kinds:
            other = [k for k in kinds if k != kind]
            return fail(f"a {kind} KV cache is not supported by {table.id}" + (f": {why_not}" if why_not else ""),
                        f"use a {other[0]} cache (InferenceParams(is_paged={other[0] == 'paged'}))" if other
                        else "the unfused engine attends any KV cache")
        if p.kv_cache_paged and p.kv_page_size and p.kv_page_size % page_multiple:
            return fail(f"page_size={p.kv_page_size} is not a multiple of {page_multiple}, which {table.id}'s "
                        "paged kernel requires", f"InferenceParams(page_size=<multiple of {page_multiple}>)")
        return None
    return Check(f"{table.family}.kv_cache", requires, "inference", source, fn)


def cp_comm_types(table: Table, allowed: tuple[str, ...], *, source: str) -> Check:
    """Context parallelism: which comm types this engine runs under (empty tuple: none)."""
    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        if p.cp_size > 1 and p.cp_comm_type not in allowed:
            if not allowed:
                return fail(f"context parallelism (cp_size={p.cp_size}) is not supported by {table.id}")
            return fail(f"cp_comm_type={p.cp_comm_type!r} is not supported by {table.id} under context "
                        f"parallelism; it supports {', '.join(allowed)}",
                        f"use cp_comm_type={allowed[0]!r}")
        return None
    requires = ("cp_comm_type in " + ", ".join(allowed)) if allowed else "no context parallelism"
    return Check(f"{table.family}.cp_comm_type", requires, "context_parallel", source, fn)


def head_dim_limit(table: Table, *, max_qk: int, max_v: int | None = None, multiple: int = 8,
                   same_qk_v: bool = False, source: str, name: str = "head_dim") -> Check:
    max_v = max_qk if max_v is None else max_v
    requires = f"head_dim_qk <= {max_qk}, head_dim_v <= {max_v}, multiples of {multiple}"
    if same_qk_v:
        requires += ", head_dim_qk == head_dim_v"

    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        problems = []
        if p.head_dim_qk > max_qk:
            problems.append(f"head_dim_qk={p.head_dim_qk} > {max_qk}")
        if p.head_dim_v > max_v:
            problems.append(f"head_dim_v={p.head_dim_v} > {max_v}")
        for label, d in (("head_dim_qk", p.head_dim_qk), ("head_dim_v", p.head_dim_v)):
            if d % multiple:
                problems.append(f"{label}={d} is not a multiple of {multiple}")
        if same_qk_v and p.head_dim_qk != p.head_dim_v:
            problems.append(f"head_dim_qk={p.head_dim_qk} != head_dim_v={p.head_dim_v}")
        if problems:
            fix = None
            if any("multiple" in x for x in problems):
                fix = f"pad head dims to a multiple of {multiple}"
            return fail(f"{table.id} supports {requires}: " + "; ".join(problems), fix)
        return None
    return Check(f"{table.family}.{name}", requires, "head_dim", source, fn)


def context_parallel(table: Table) -> Check:
    """Under cp_size > 1: attn-dispatch's context parallelism supports the call's features under its comm type.
    Added to every table by the registry. Whether the engine can run the per-block calls is selection's part
    (it evaluates this same table on constraints.context_parallel.block_params and composes)."""
    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        if p.cp_size <= 1:
            return None
        ours = params_failures(p)
        if ours:
            return fail("; ".join(message for _, message, _ in ours), next((f for _, _, f in ours if f), None))
        return None
    return Check(f"{table.family}.cp_support", "context parallelism: a comm type attn-dispatch implements for the "
                 "call's features (formats, masks, sliding windows, heads)", "context_parallel",
                 "attn_dispatch.constraints.context_parallel (SUPPORT, params_failures); windows: " +
                 "Transformer Engine context_parallel.py attn_forward_func_with_cp (a2a, all_gather)", fn)


def no_softcap(table: Table) -> Check:
    """Logit soft-capping is passed only to the engines whose tables declare a softcap check of their own (unfused,
    flash_attn_4); the registry adds this refusal to every other table."""
    def fn(p: AttentionParams, plat: Platform, env: EnvFlags) -> Failure | None:
        if p.softcap:
            return fail(f"softcap={p.softcap:g} (logit soft-capping) is not passed to {table.id} by attn-dispatch",
                        "the unfused engine supports it, and flash_attn_4 (sm90/sm100)")
        return None
    return Check(f"{table.family}.softcap", "no logit soft-capping (softcap=0)", "softmax",
                 "attn-dispatch scope: only the unfused and flash_attn_4 engines are given softcap", fn)
