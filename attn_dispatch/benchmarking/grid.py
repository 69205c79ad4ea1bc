"""Shape grids for benchmarks and tuning, and the shapes-file format `attn-dispatch tune/bench --shapes` read.

Shapes file: a JSON list of objects, each holding AttentionParams keywords, e.g.
    [{"dtype": "bf16", "batch_size": 8, "num_heads": 16, "num_gqa_groups": 4, "head_dim_qk": 128,
      "max_seqlen_q": 4096, "attn_mask_type": "causal", "is_training": true}]
Omitted keys take AttentionParams' defaults (device_type defaults to 'cuda'); window_size is a two-item list.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..params import AttentionParams

TOKENS_PER_BATCH = 32768  # batch x seqlen held constant across the grid, as in shared/device/README.md


def default_grid(device_type: str = "cuda", dtype: str = "bfloat16") -> list[AttentionParams]:
    """The default grid: D 64/128/256, S 512..16k, causal or not, GQA, plus two shapes off the bucket steps (so the
    measured policy's bucketing is tested too). 31 geometries; the bench runs each forward and forward+backward."""
    shapes = []

    def add(d: int, s: int, causal: bool, *, heads: int | None = None, kv: int | None = None,
            batch: int | None = None) -> None:
        heads = heads or (8 if d == 256 else 16)
        shapes.append(AttentionParams(
            dtype=dtype, batch_size=batch or max(1, TOKENS_PER_BATCH // s), num_heads=heads, num_gqa_groups=kv,
            head_dim_qk=d, max_seqlen_q=s, attn_mask_type="causal" if causal else "no_mask", device_type=device_type))

    for d in (64, 128, 256):
        for s in (512, 1024, 4096, 16384):
            for causal in (False, True):
                add(d, s, causal)
    add(128, 2048, True, kv=4)      # GQA
    add(128, 8192, True, kv=4)
    add(128, 16384, False, kv=2)
    add(64, 8192, True, kv=2)
    add(256, 2048, False, kv=2)
    add(128, 3000, True, batch=10)  # off the bucket steps: tuned at 3072 x batch 16
    add(64, 12000, False, batch=3)  # tuned at 12288 x batch 4
    return shapes


def quick_grid(device_type: str = "cpu", dtype: str = "float32") -> list[AttentionParams]:
    """A handful of tiny shapes: smoke runs and CPU tests."""
    return [
        AttentionParams(dtype=dtype, batch_size=2, num_heads=2, head_dim_qk=d, max_seqlen_q=s,
                        attn_mask_type=mask, device_type=device_type)
        for d, s, mask in ((16, 32, "no_mask"), (16, 64, "causal"), (32, 48, "no_mask"))
    ] + [AttentionParams(dtype=dtype, batch_size=2, num_heads=4, num_gqa_groups=2, head_dim_qk=32, max_seqlen_q=64,
                         attn_mask_type="causal", device_type=device_type)]


GRIDS = {"default": default_grid, "quick": quick_grid}


def load_shapes(path: str | Path) -> list[AttentionParams]:
    """Read a shapes file (see the module docstring); errors name the entry and the key."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"--shapes {str(path)!r}: cannot read it ({exc.strerror or exc})") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"--shapes {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, list) or not data:
        raise ValueError(f"--shapes {str(path)!r} must hold a non-empty JSON list of objects of AttentionParams "
                         "keywords")
    return [shape_from_dict(item, where=f"--shapes {path} entry {i}") for i, item in enumerate(data)]


def shape_from_dict(item: object, *, where: str = "shape") -> AttentionParams:
    allowed = [f.name for f in dataclasses.fields(AttentionParams) if f.init]
    if not isinstance(item, dict):
        raise ValueError(f"{where} is {type(item).__name__} {item!r}; expected an object with keys among "
                         f"{', '.join(allowed)}")
    unknown = sorted(set(item) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: key {unknown[0]!r} is not an AttentionParams field; allowed: "
                         f"{', '.join(allowed)}")
    values = dict(item)
    if isinstance(values.get("window_size"), list):
        values["window_size"] = tuple(values["window_size"])
    try:
        return AttentionParams(**values)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc


def shape_label(params: AttentionParams) -> str:
    """Short label for tables and plots: 'd128 s4096 b8 h16/4 causal'."""
    heads = f"h{params.num_heads}" + (f"/{params.num_gqa_groups}" if params.num_gqa_groups != params.num_heads
                                      else "")
    seq = f"s{params.max_seqlen_q}" + (f"x{params.max_seqlen_kv}" if params.max_seqlen_kv != params.max_seqlen_q
                                       else "")
    dims = f"d{params.head_dim_qk}" + (f"/{params.head_dim_v}" if params.head_dim_v != params.head_dim_qk else "")
    extra = [] if params.attn_mask_type == "no_mask" else [params.attn_mask_type]
    if params.qkv_format != "bshd":
        extra.append(params.qkv_format)
    return " ".join([dims, seq, f"b{params.batch_size}", heads] + extra)
