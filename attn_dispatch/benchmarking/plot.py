"""PNG plot of a bench result: TFLOP/s per engine per shape, one panel per mode, each policy's pick marked.

Works from the JSON alone, so a result produced where matplotlib is missing can be plotted elsewhere.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .bench import short_name

_POLICY_MARKS = {"auto": dict(marker="o", s=110, facecolors="none", edgecolors="tab:blue", linewidths=1.4),
                 "order": dict(marker="s", s=140, facecolors="none", edgecolors="black", linewidths=1.4),
                 "measured": dict(marker="x", s=70, color="red", linewidths=1.6),
                 "checked": dict(marker="+", s=90, color="green", linewidths=1.6)}


def plot_bench(result: dict[str, Any], path: str | Path) -> Path:
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("the PNG plot needs matplotlib: pip install matplotlib (or attn-dispatch[plot])") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    modes = [m for m in ("fwd", "fwd_bwd") if any(r["mode"] == m for r in rows)]
    engines = sorted({pid for r in rows for pid in r["engines"]})
    colors = {pid: plt.get_cmap("tab10")(i % 10) for i, pid in enumerate(engines)}
    width = max(8.0, 0.32 * max(len([r for r in rows if r["mode"] == m]) for m in modes) + 3)
    fig, axes = plt.subplots(len(modes), 1, figsize=(width, 4.2 * len(modes)), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        mode_rows = [r for r in rows if r["mode"] == mode]
        for pid in engines:
            xs = [i for i, r in enumerate(mode_rows) if "tflops" in r["engines"].get(pid, {})]
            ys = [mode_rows[i]["engines"][pid]["tflops"] for i in xs]
            ax.scatter(xs, ys, color=colors[pid], label=short_name(pid), s=22, zorder=3)
        for policy, style in _POLICY_MARKS.items():
            xs, ys = [], []
            for i, r in enumerate(mode_rows):
                pick = r["picks"].get(policy)
                if pick and "tflops" in r["engines"].get(pick, {}):
                    xs.append(i)
                    ys.append(r["engines"][pick]["tflops"])
            if xs:
                ax.scatter(xs, ys, label=f"{policy} policy's pick", zorder=4, **style)
        ax.set_xticks(range(len(mode_rows)))
        ax.set_xticklabels([r["label"] for r in mode_rows], rotation=70, ha="right", fontsize=7)
        ax.set_ylabel("TFLOP/s")
        ax.set_title("forward" if mode == "fwd" else "forward + backward", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, ncol=4, loc="best")
    fig.suptitle(f"attn-dispatch bench: {result.get('platform_text', '')}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
