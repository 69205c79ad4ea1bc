"""Shape buckets: many call shapes share one tuning result, so the cost of tuning stays bounded.

Sequence lengths round up to the next quarter-octave step (..., 512, 640, 768, 896, 1024, 1280, ...): at most
four buckets per doubling. Every power of two is a step (so the usual shapes are their own representative), and
a multiple of 64 always rounds to a multiple of 64 (cuDNN's older seqlen rule keeps holding). The batch rounds up
to a power of two. Heads, head dims, dtype, layout, mask, window and every feature flag stay exact: they change
which kernel runs, not just how long it runs.

A bucket is named by its representative: the largest shape in it, on the same side of the 128 grid as the call. It
is timed at the shape of the call that first reaches it (policy/measured.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..params import AttentionParams

STEPS_PER_OCTAVE = (1, 2, 4, 8)


def next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def round_up_steps(n: int, steps_per_octave: int) -> int:
    """Smallest p * (1 + i / steps) >= n, with p the power of two at or below n (plain powers below 16)."""
    if n <= 16 or steps_per_octave == 1:
        return next_power_of_two(n)
    base = 1 << (n.bit_length() - 1)
    step = base // steps_per_octave
    return -(-n // step) * step  # ceil to a multiple of the octave's step


@dataclass(frozen=True)
class BucketScheme:
    """How call shapes map to buckets. `seq_steps_per_octave=1` gives plain powers of two."""

    seq_steps_per_octave: int = 4

    def __post_init__(self) -> None:
        if self.seq_steps_per_octave not in STEPS_PER_OCTAVE:
            raise ValueError(f"seq_steps_per_octave={self.seq_steps_per_octave!r} is not supported; "
                             f"expected one of {', '.join(map(str, STEPS_PER_OCTAVE))}")

    def round_seqlen(self, n: int) -> int:
        """The bucket's largest length. A length off the 128 grid stays off it: kernels mask their last tile
        there, and on the H100 that alone moved the fastest engine (d128 s3000: cuDNN; s3072: flash-attn-4)."""
        rounded = round_up_steps(n, self.seq_steps_per_octave)
        if n % 128 and not rounded % 128:
            rounded -= 64 if n % 64 == 0 else 1  # still >= n, and a multiple of 64 stays one
        return rounded

    @staticmethod
    def round_batch(n: int) -> int:
        return next_power_of_two(n)

    def representative(self, params: AttentionParams) -> AttentionParams:
        """The largest shape of params' bucket: its name (the key)."""
        rounded = {
            "batch_size": self.round_batch(params.batch_size),
            "max_seqlen_q": self.round_seqlen(params.max_seqlen_q),
            "max_seqlen_kv": self.round_seqlen(params.max_seqlen_kv),
        }
        if all(getattr(params, k) == v for k, v in rounded.items()):
            return params
        return params.replace(**rounded)

    def key(self, params: AttentionParams) -> str:
        """Stable text key (same in every process and Python version) of params' bucket."""
        return bucket_key(self.representative(params))


def bucket_key(representative: AttentionParams) -> str:
    fields = representative.to_dict()
    return ";".join(f"{name}={_text(fields[name])}" for name in sorted(fields))


def _text(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(_text(v) for v in value)
    return str(value)
