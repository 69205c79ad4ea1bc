"""Timing engines and policies against each other: the grids, the benchmark core behind `attn-dispatch bench`,
the hot-path harness and plots. A caller of selection, like the module: nothing below it imports this package."""
