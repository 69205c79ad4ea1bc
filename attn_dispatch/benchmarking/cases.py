"""Model-shaped attention calls for the performance profile: the grid it is fitted on, and a held-out grid with
other lengths, head dims, batch x heads and model configurations that it is checked on (benchmarks/
bench_user_step.py times both on the GPU machines)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
import math
from functools import lru_cache


@dataclass(frozen=True)
class Case:
    b: int
    s: int
    h: int
    d: int
    mask: str = "causal"
    hkv: int = 0          # 0: h (MHA)
    dv: int = 0           # 0: d
    skv: int = 0          # 0: s
    window: tuple[int, int] | None = None
    fmt: str = "bshd"
    train: bool = True
    name: str = ""
    # thd: each packed sequence's tokens (queries = keys), b of them, the longest s; empty: the harness draws them
    # (bench_user_step.make_tensors: uniform in [s/2, s], the first s)
    seqlens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for field_, default in (("hkv", self.h), ("dv", self.d), ("skv", self.s)):
            if getattr(self, field_) == 0:
                object.__setattr__(self, field_, default)
        if self.seqlens:
            object.__setattr__(self, "seqlens", tuple(self.seqlens))  # a list read back from JSON
            if self.fmt != "thd" or len(self.seqlens) != self.b or max(self.seqlens) != self.s \
                    or min(self.seqlens) < 1:
                raise ValueError(f"seqlens={self.seqlens} need fmt='thd' (got {self.fmt!r}), b={len(self.seqlens)} "
                                 f"sequences (got b={self.b}) of 1 to s={self.s} tokens, the longest s")

    @property
    def label(self) -> str:
        heads = f"h{self.h}" + (f"/{self.hkv}" if self.hkv != self.h else "")
        dims = f"d{self.d}" + (f"/{self.dv}" if self.dv != self.d else "")
        seq = f"s{self.s}" + (f"x{self.skv}" if self.skv != self.s else "")
        extra = [self.mask] + ([f"w{self.window[0]},{self.window[1]}"] if self.window else [])
        extra += [self.fmt] if self.fmt != "bshd" else []
        if self.seqlens:
            low = min(self.seqlens)
            extra.append("uniform" if low == self.s else f"lens{low}-{self.s}")
        extra.append("fwd+bwd" if self.train else "fwd")
        return " ".join(([self.name] if self.name else []) + [dims, seq, f"b{self.b}", heads] + extra)

    def to_dict(self) -> dict:
        return asdict(self)


def _both(cases: list[Case]) -> list[Case]:
    """Each shape in training (forward + backward) and in inference (forward)."""
    out = []
    for c in cases:
        out.append(c)
        out.append(Case(**{**c.to_dict(), "train": False}))
    return out


def fit_cases() -> list[Case]:
    """The grid the shipped profile is fitted on (74 shapes, each fwd and fwd+bwd)."""
    shapes = []
    for d in (64, 128, 256):
        h = 8 if d == 256 else 16
        for s in (512, 2048, 8192, 32768):
            for mask in ("no_mask", "causal"):
                shapes.append(Case(b=max(1, 32768 // s), s=s, h=h, d=d, mask=mask))
    for s in (1024, 4096, 16384):
        shapes.append(Case(b=max(1, 32768 // s), s=s, h=16, d=96))
        shapes.append(Case(b=max(1, 32768 // s), s=s, h=16, d=192, dv=128))
    shapes += [Case(b=16, s=2048, h=16, d=80, mask=m) for m in ("no_mask", "causal")]
    for s in (1024, 4096, 16384):  # GQA 4 and 8
        shapes.append(Case(b=max(1, 32768 // s), s=s, h=32, hkv=8, d=128))
        shapes.append(Case(b=max(1, 32768 // s), s=s, h=16, hkv=2, d=128))
    shapes += [Case(b=1, s=1024, h=8, d=128), Case(b=1, s=8192, h=8, d=128),
               Case(b=64, s=256, h=16, d=64, mask="no_mask"), Case(b=128, s=128, h=16, d=64)]
    shapes += [Case(b=8, s=4096, h=16, d=128, window=(1024, 0)), Case(b=2, s=16384, h=16, d=128, window=(1024, 0)),
               Case(b=2, s=16384, h=32, hkv=8, d=128, window=(4096, 0)),
               Case(b=4, s=8192, h=8, d=256, window=(4096, 0)),
               Case(b=8, s=4096, h=16, d=64, mask="no_mask", window=(256, 256))]
    shapes += [Case(b=32, s=1024, h=16, d=128, fmt="sbhd"), Case(b=8, s=4096, h=16, d=128, fmt="sbhd"),
               Case(b=2, s=16384, h=16, d=128, fmt="sbhd"), Case(b=16, s=2048, h=16, d=64, mask="no_mask", fmt="sbhd")]
    shapes += [Case(b=32, s=1024, h=16, d=128, mask="padding_causal", fmt="thd"),
               Case(b=8, s=4096, h=16, d=128, mask="padding_causal", fmt="thd"),
               Case(b=2, s=16384, h=16, d=128, mask="padding_causal", fmt="thd"),
               Case(b=16, s=2048, h=16, d=64, mask="padding", fmt="thd")]
    shapes += [Case(b=8, s=1024, skv=4096, h=16, d=128, mask="no_mask"),
               Case(b=4, s=512, skv=8192, h=16, d=128, mask="causal_bottom_right")]
    # Second fitting pass: where host-bound and GPU-bound meet, GQA 16, more d256, no-mask windows, small thd.
    shapes += [Case(b=16, s=1024, h=16, d=64), Case(b=16, s=512, h=16, d=64, mask="no_mask"),
               Case(b=8, s=512, h=16, d=128), Case(b=16, s=256, h=32, d=128), Case(b=4, s=2048, h=16, d=64),
               Case(b=2, s=2048, h=16, d=128), Case(b=8, s=1024, h=8, d=256), Case(b=1, s=4096, h=8, d=256),
               Case(b=4, s=2048, h=16, hkv=4, d=256)]
    shapes += [Case(b=32, s=1024, h=32, hkv=2, d=128), Case(b=8, s=4096, h=32, hkv=2, d=128)]
    shapes += [Case(b=32, s=512, h=16, d=64, mask="padding", fmt="thd"),
               Case(b=8, s=2048, h=32, hkv=8, d=128, mask="padding_causal", fmt="thd")]
    shapes += [Case(b=2, s=8192, h=16, d=128, mask="no_mask", window=(64, 64)),
               Case(b=8, s=2048, h=16, d=64, mask="no_mask", window=(512, 512))]
    shapes += [Case(b=4, s=4096, h=32, hkv=8, d=128, fmt="sbhd")]
    return _both(shapes)


def eval_cases() -> list[Case]:
    """Held out: none of these shapes is in fit_cases (other lengths, dims, batch x heads, model configs)."""
    shapes = [
        Case(b=1, s=8192, h=32, hkv=8, d=128, name="llama8b"),
        Case(b=2, s=4096, h=8, hkv=4, d=256, name="gemma"),
        Case(b=2, s=4096, h=16, d=192, dv=128, name="mla"),
        Case(b=1, s=24576, h=32, hkv=8, d=128, name="longctx"),
        Case(b=32, s=512, h=16, d=64, mask="no_mask", name="bert"),
        Case(b=8, s=256, h=16, d=128, name="small"),
        Case(b=1, s=12288, h=32, hkv=8, d=128, window=(4096, 0), name="mistral"),
        Case(b=8, s=3000, h=16, d=80, mask="no_mask", name="d80"),
        Case(b=4, s=6144, h=16, d=96, name="d96"),
        Case(b=16, s=1536, h=12, d=64, name="gpt2"),
        Case(b=2, s=4096, h=28, hkv=4, d=128, name="qwen2"),
        Case(b=2, s=8192, h=32, hkv=8, d=128, fmt="sbhd", name="megatron"),
        Case(b=8, s=2048, h=16, d=128, fmt="sbhd", name="megatron-s"),
        Case(b=4, s=8192, h=32, hkv=8, d=128, mask="padding_causal", fmt="thd", name="packed"),
        Case(b=16, s=1024, h=16, d=64, mask="padding", fmt="thd", name="packed-enc"),
        Case(b=4, s=128, h=32, d=128, name="tiny"),
        Case(b=16, s=1536, h=8, d=256, mask="no_mask", name="vision"),
        Case(b=2, s=12000, h=16, d=128, mask="no_mask", name="enc-long"),
        Case(b=4, s=2048, skv=6144, h=16, d=128, mask="no_mask", name="cross"),
        Case(b=4, s=6144, h=16, d=64, mask="no_mask", window=(128, 128), name="local"),
        Case(b=8, s=2048, h=32, hkv=2, d=128, name="gqa16"),
    ]
    return _both(shapes)


def fit_extra_cases() -> list[Case]:
    """Fit rows added after the held-out diagnosis: packed (thd) calls at d64/d128/d256 and
    several lengths (thd costs more per call than dense, and one thd row per region left the model guessing),
    the d64 training lengths where flash-attn-4 and cuDNN cross, small windows, d256 and MLA in between, and more
    host-bound calls. None is in eval_cases or eval_fresh_cases."""
    shapes = [
        Case(b=32, s=1024, h=12, d=64, mask="padding", fmt="thd"),
        Case(b=8, s=4096, h=16, d=64, mask="padding", fmt="thd"),
        Case(b=4, s=8192, h=16, d=64, mask="padding", fmt="thd"),
        Case(b=64, s=256, h=16, d=64, mask="padding", fmt="thd"),
        Case(b=2, s=8192, h=32, hkv=8, d=128, mask="padding_causal", fmt="thd"),
        Case(b=4, s=4096, h=32, hkv=4, d=128, mask="padding_causal", fmt="thd"),
        Case(b=32, s=512, h=16, d=128, mask="padding_causal", fmt="thd"),
        Case(b=8, s=2048, h=16, d=128, mask="padding", fmt="thd"),
        Case(b=4, s=4096, h=8, d=256, mask="padding_causal", fmt="thd"),
        Case(b=32, s=1024, h=12, d=64), Case(b=8, s=4096, h=12, d=64), Case(b=8, s=3072, h=12, d=64),
        Case(b=16, s=1024, h=16, d=64, mask="no_mask"),
        Case(b=4, s=8192, h=16, d=64, mask="no_mask", window=(64, 64)),
        Case(b=2, s=8192, h=32, hkv=8, d=128, window=(256, 0)),
        Case(b=4, s=4096, h=16, d=128, mask="no_mask", window=(128, 128)),
        Case(b=4, s=3072, h=8, d=256, mask="no_mask"), Case(b=4, s=2048, h=16, d=192, dv=128),
        Case(b=8, s=128, h=16, d=128), Case(b=16, s=256, h=12, d=64, mask="no_mask"),
        Case(b=2, s=512, h=32, hkv=8, d=128),
    ]
    return _both(shapes)


def fit_gqa_cases() -> list[Case]:
    """Small-batch GQA training and inference of 1B-8B LLM layers (h 16/8, 32/8, 32/4 at d 128, s 2k-8k), which the
    fit grids covered with one or two rows: a check on a 1B Llama found the profile picking torch's cuDNN op for its
    attention (b1 h16/8 s4096), 0.85x torch SDPA's kernel. None is in eval_cases or eval_fresh_cases."""
    shapes = [
        Case(b=1, s=4096, h=16, hkv=8, d=128), Case(b=2, s=4096, h=16, hkv=8, d=128),
        Case(b=1, s=2048, h=16, hkv=8, d=128), Case(b=1, s=8192, h=16, hkv=8, d=128),
        Case(b=1, s=4096, h=32, hkv=8, d=128), Case(b=2, s=2048, h=32, hkv=8, d=128),
        Case(b=1, s=8192, h=32, hkv=4, d=128), Case(b=4, s=1024, h=16, hkv=8, d=128),
    ]
    return _both(shapes)


def eval_fresh_cases() -> list[Case]:
    """A second held-out grid, chosen before any of it was measured and not tuned on: model
    calls other than eval_cases' and the fit grids' (LLM with GQA, long context, encoders, small batches, head dims
    64/80/96/128/192/256, windows, thd, cross and bottom-right causal)."""
    shapes = [
        Case(b=2, s=4096, h=8, hkv=1, d=128, name="llama70b-tp8"),
        Case(b=1, s=20000, h=32, hkv=8, d=128, name="long20k"),
        Case(b=1, s=6144, h=28, hkv=4, d=128, name="qwen7b"),
        Case(b=2, s=6144, h=32, hkv=8, d=128, window=(2048, 0), name="swa"),
        Case(b=2, s=4096, h=8, hkv=4, d=256, window=(1024, 0), name="gemma2-local"),
        Case(b=8, s=2048, h=32, d=96, name="phi"),
        Case(b=4, s=4096, h=20, d=80, name="d80-causal"),
        Case(b=16, s=1500, h=20, d=64, mask="no_mask", name="whisper-enc"),
        Case(b=64, s=577, h=16, d=64, mask="no_mask", name="vit-l"),
        Case(b=32, s=384, h=12, d=64, mask="no_mask", name="roberta"),
        Case(b=16, s=512, skv=1536, h=12, d=64, mask="no_mask", name="t5-cross"),
        Case(b=16, s=64, h=32, hkv=8, d=128, name="prefill64"),
        Case(b=1, s=1024, h=16, d=128, name="b1"),
        Case(b=1, s=8192, h=16, d=192, dv=128, name="mla-8k"),
        Case(b=16, s=1024, h=8, d=256, mask="no_mask", name="d256-enc"),
        Case(b=8, s=2048, h=32, hkv=4, d=128, fmt="sbhd", name="megatron-gqa"),
        Case(b=32, s=1024, h=16, d=64, mask="no_mask", fmt="sbhd", name="sbhd-enc"),
        Case(b=8, s=4096, h=32, hkv=8, d=128, mask="padding_causal", fmt="thd", name="packed-llm"),
        Case(b=8, s=2048, h=12, d=64, mask="padding", fmt="thd", name="packed-enc64"),
        Case(b=2, s=16384, h=32, hkv=8, d=128, mask="padding_causal", fmt="thd", name="packed-long"),
        Case(b=2, s=8192, h=16, d=64, mask="no_mask", window=(256, 256), name="local64"),
        Case(b=4, s=1024, skv=4096, h=32, hkv=8, d=128, mask="causal_bottom_right", name="chunked-prefill"),
        Case(b=1, s=8192, h=64, hkv=8, d=128, name="gqa8-h64"),
        Case(b=32, s=128, h=12, d=64, name="tiny64"),
    ]
    return _both(shapes)


# The held-out (blind) grids: BLIND_SEEDS[i] draws eval-blind<i + 1> (plain eval-blind for i = 0). Each was committed
# before any of it was measured, to check the model as it then stood. From the fourth on, a seed is the first from a
# start seed whose draw covers head dims 64/80/96/128/192/256, thd, sbhd and both kinds of window, chosen by that
# coverage alone. Start seeds, in order: 20261127, 20261133, 20261134, 20261139, 20261140, 20261141, 20261145,
# 20261154, 20261155, 20261156, 20261159, 20261160, 20261161 (the first two with the coverage), 20261164, 20261168,
# then as noted below. What each grid checked: benchmarks/results/README.md.
BLIND_SEEDS = (20261124, 20261125, 20261126, 20261132, 20261133, 20261138, 20261139, 20261140, 20261144, 20261153,
               20261154, 20261155, 20261158, 20261159, 20261160, 20261161, 20261163, 20261167, 20261168,
               20261175,  # eval-blind20: the first from 20261169 with the coverage, after fit-dense
               20261178,  # eval-blind21: the first from 20261176, after the rate fit left windows out
               20261181,  # eval-blind22: the first from 20261179, the shipped profile unchanged
               20261187,  # eval-blind23 and eval-blind24: the first two from 20261182, drawn after the
               20261188,  # checked policy was written, to check it
               20261189)  # eval-blind25: the first from 20261189, the profile and policies unchanged
# Grids drawn before the packed family's kv-head count had to divide its head count (fit-drawn had 10 rows refused
# for h12/hkv8): their draws must not change, so they keep the old draw.
_LEGACY_DRAWS = 3  # the first three blind seeds, and the fit-drawn grids, which exclude only those
# The fit-drawn grids: the blind grids' families drawn with other seeds, the families where engines cross weighted
# up; every blind grid is left out of them (they are drawn after, and excluding, the blind grids).
FIT_DRAWN_SEEDS = {"fit-drawn-a": (7001, 7002, 7003), "fit-drawn-b": (7004, 7005, 7006),
                   "fit-drawn-c": (7007, 7008, 7009)}
_BLIND_COUNTS = (("llm", 6), ("long", 3), ("encoder", 4), ("small", 3), ("windowed", 3), ("packed", 3), ("mla", 1),
                 ("d256", 1))
_FIT_COUNTS = (("windowed", 7), ("mla", 3), ("d256", 3), ("packed", 4), ("encoder", 5), ("llm", 5), ("small", 2),
               ("long", 2))
# fit-dense: more fit rows, with a host/GPU split, in the families where the profile's pick missed the
# fastest engine on every lease of a repeated blind grid (benchmarks/static_bound.py over eleven blind grids: mid-size
# encoders, packed d128, causal windows, GQA causal forwards near s3000, d256). Drawn after, and excluding, every
# grid before it; the blind grids from BLIND_SEEDS[_DENSE_FROM] on exclude it.
FIT_DENSE_SEEDS = (7101, 7102)
_DENSE_COUNTS = (("encoder", 6), ("llm", 3), ("windowed", 3), ("packed", 3), ("d256", 2), ("small", 2))
_DENSE_FROM = 19


def _case_key(c: Case) -> tuple:
    return (c.b, c.s, c.skv, c.h, c.hkv, c.d, c.dv, c.mask, c.window, c.fmt, c.seqlens)


def _draw(seed: int, counts: tuple[tuple[str, int], ...], seen: set[tuple], legacy: bool = False) -> list[Case]:
    """Shapes drawn at random from model-shaped families (LLM layers with GQA, long context, encoders, small
    batches, head dims 64/80/96/128/192/256, windows, thd and sbhd, lengths on and off the 128 grid); a shape in
    `seen` is drawn again (at most 50 times, then the draw is skipped). Adds what it draws to `seen`. legacy: the
    packed family as first drawn (its kv-head count may not divide its head count)."""
    import random

    rng = random.Random(seed)
    pick = rng.choice

    def batch(s: int, tokens: tuple[int, ...]) -> int:
        return max(1, min(64, pick(tokens) // s))

    def llm(i: int) -> Case:
        h = pick((16, 24, 32, 40, 64))
        s = pick((1000, 1536, 2048, 3000, 4096, 6144, 8192, 12288))
        return Case(b=batch(s, (4096, 8192, 16384)), s=s, h=h, hkv=pick([g for g in (1, 2, 4, 8) if h % g == 0]),
                    d=128, fmt="sbhd" if i % 3 == 2 else "bshd", name=f"llm{i}")

    # Later draws widen the families the earlier grids (fit-drawn included) exhausted: long, MLA and d256.
    def long(i: int) -> Case:
        if legacy:
            h = pick((8, 16, 32))
            return Case(b=1, s=pick((16384, 20480, 24576, 32768)), h=h, hkv=max(1, h // pick((4, 8))), d=128,
                        name=f"long{i}")
        h = pick((8, 16, 24, 32, 40))
        return Case(b=pick((1, 1, 2)), s=pick((14000, 16384, 18432, 20480, 28672, 32768)), h=h,
                    hkv=pick([g for g in (1, 2, 4, 8) if h % g == 0 and h // g >= 4]), d=128, name=f"long{i}")

    def encoder(i: int) -> Case:
        s = pick((128, 197, 256, 384, 500, 512, 1024, 2048))
        return Case(b=batch(s, (4096, 16384, 32768)), s=s, h=pick((8, 12, 16, 20)), d=pick((64, 80, 96, 128)),
                    mask="no_mask", name=f"enc{i}")

    def small(i: int) -> Case:
        return Case(b=pick((1, 2, 4, 8)), s=pick((64, 100, 128, 256, 512)), h=pick((8, 16, 32)), d=pick((64, 128)),
                    mask=pick(("causal", "no_mask")), name=f"small{i}")

    def windowed(i: int) -> Case:
        s, w = pick((2048, 3000, 4096, 8192)), pick((128, 512, 1024, 2048))
        causal = i % 3 != 1  # every third a two-sided window (no mask)
        return Case(b=batch(s, (8192, 16384)), s=s, h=pick((8, 16)), hkv=pick((4, 8)), d=pick((64, 128, 256)),
                    mask="causal" if causal else "no_mask", window=(w, 0) if causal else (w, w), name=f"win{i}")

    def packed(i: int) -> Case:
        d = pick((64, 128))
        s = pick((1024, 2048, 4096, 8192))
        b, h = batch(s, (8192, 16384, 32768)), pick((12, 16, 32))
        hkv = (pick((4, 8)) if legacy else pick([g for g in (4, 8) if h % g == 0])) if d == 128 else 0
        return Case(b=b, s=s, h=h, hkv=hkv, d=d, mask=pick(("padding", "padding_causal")), fmt="thd",
                    name=f"packed{i}")

    def mla(i: int) -> Case:
        if legacy:
            return Case(b=pick((1, 2)), s=pick((2048, 4096, 8192)), h=pick((16, 32)), d=192, dv=128,
                        name=f"mla{i}")
        return Case(b=pick((1, 2, 4)), s=pick((1500, 2048, 3072, 4096, 6144, 8192)), h=pick((16, 32, 64)), d=192,
                    dv=128, name=f"mla{i}")

    def d256(i: int) -> Case:
        if legacy:
            return Case(b=pick((2, 4)), s=pick((2048, 3000, 4096)), h=pick((8, 16)), hkv=pick((4, 8)), d=256,
                        name=f"d256-{i}")
        h = pick((8, 16, 32))
        return Case(b=pick((1, 2, 4, 8)), s=pick((1024, 1800, 2048, 3000, 4096, 8192)), h=h,
                    hkv=pick([g for g in (1, 2, 4, 8, 16) if h % g == 0 and g < h]), d=256, name=f"d256-{i}")

    families = {"llm": llm, "long": long, "encoder": encoder, "small": small, "windowed": windowed,
                "packed": packed, "mla": mla, "d256": d256}
    shapes: list[Case] = []
    for family, count in counts:
        for i in range(count):
            for _ in range(50):
                case = families[family](i)
                if _case_key(case) not in seen:  # a repeat of an earlier draw or of another grid: draw again
                    seen.add(_case_key(case))
                    shapes.append(case)
                    break
    return shapes


def _hand_grids() -> list:
    return [fit_cases, eval_cases, fit_extra_cases, fit_gqa_cases, eval_fresh_cases]


def eval_blind_cases(seed: int = BLIND_SEEDS[0]) -> list[Case]:
    """A held-out grid, drawn at random from model-shaped families with a fixed seed and
    committed before any of it was measured or any model change was made with it in view. It shares no call with
    the hand-made grids or an earlier blind grid. 24 distinct shapes, fwd and fwd+bwd each."""
    return list(_blind_draw(seed, BLIND_SEEDS))


@lru_cache(maxsize=None)
def _blind_draw(seed: int, seeds: tuple[int, ...]) -> tuple[Case, ...]:
    """eval_blind_cases' draw, once per seed (each excludes every earlier one: uncached, the draws recurse 2^n
    times)."""
    index = seeds.index(seed)
    earlier = _hand_grids() + [lambda s=s: list(_blind_draw(s, seeds)) for s in seeds[:index]]
    if index >= _LEGACY_DRAWS:  # later blind grids are drawn after the fit-drawn grids, and exclude them too
        earlier += [lambda n=n: fit_drawn_cases(n) for n in FIT_DRAWN_SEEDS]
    if index >= _DENSE_FROM:
        earlier.append(fit_dense_cases)
    seen = {_case_key(c) for grid in earlier for c in grid()}
    return tuple(_both(_draw(seed, _BLIND_COUNTS, seen, legacy=index < _LEGACY_DRAWS)))


def fit_drawn_cases(name: str) -> list[Case]:
    """Fit rows drawn from the blind grids' families (a fit set from the distribution the blind grids test), with
    windows, MLA, d256, thd and encoders weighted up: where flash-attn-4 and cuDNN cross. No call of any other grid
    (blind grids included) or of an earlier fit-drawn seed."""
    seen = {_case_key(c) for grid in _hand_grids() for c in grid()}
    seen |= {_case_key(c) for s in BLIND_SEEDS[:_LEGACY_DRAWS] for c in eval_blind_cases(s)}
    shapes: list[Case] = []
    for grid, seeds in FIT_DRAWN_SEEDS.items():
        for seed in seeds:
            drawn = _draw(seed, _FIT_COUNTS, seen, legacy=True)
            if grid == name:
                shapes += [Case(**{**c.to_dict(), "name": f"s{seed % 100}-{c.name}"}) for c in drawn]
        if grid == name:
            return _both(shapes)
    raise ValueError(f"no fit-drawn grid {name!r}; expected one of {sorted(FIT_DRAWN_SEEDS)}")


def fit_dense_cases() -> list[Case]:
    """Fit rows from the blind families where the profile missed (FIT_DENSE_SEEDS): no call of any grid before it.
    Labels are prefixed s<last two digits of the seed>-, as the fit-drawn grids' are (s1-, s2- occur in both; the
    calls differ)."""
    earlier = _hand_grids() + [lambda n=n: fit_drawn_cases(n) for n in FIT_DRAWN_SEEDS]
    earlier += [lambda s=s: eval_blind_cases(s) for s in BLIND_SEEDS[:_DENSE_FROM]]
    seen = {_case_key(c) for grid in earlier for c in grid()}
    shapes: list[Case] = []
    for seed in FIT_DENSE_SEEDS:
        shapes += [Case(**{**c.to_dict(), "name": f"s{seed % 100}-{c.name}"}) for c in _draw(seed, _DENSE_COUNTS, seen)]
    return _both(shapes)


# fit-windows: dense calls under windows of 112-768 keys, where the profile held few (a windowed pack's GPU time is
# read off its dense twin's, and the measured windows were mostly 128 or over 512 keys wide). The seed is the first
# from 20261901 whose draw covers every head dim, both kinds of window, GQA, and d64 and d256 causal windows of at
# most 320 keys.
FIT_WINDOWS_SEED = 20261904
# eval-windows: the same family, held out (drawn and committed before it was measured, after the fit grid became
# source data): the next seed with that coverage whose draw shares no call with another grid.
EVAL_WINDOWS_SEED = 20261907


def fit_windows_cases(seed: int | None = None, prefix: str = "fw") -> list[Case]:
    """12 dense windowed shapes (16k or 32k tokens, head dims 64-256, GQA, causal and two-sided windows of 112-768
    keys), each in training and inference (24 rows)."""
    import random

    rng = random.Random(FIT_WINDOWS_SEED if seed is None else seed)
    shapes = []
    for i in range(12):
        d = rng.choice((64, 96, 128, 192, 256))
        w = 16 * round(math.exp(rng.uniform(math.log(112), math.log(768))) / 16)
        s = rng.choice([x for x in (1024, 2048, 4096, 8192, 16384) if x >= 2 * w])
        h = rng.choice((8, 16, 24, 32))
        hkv = rng.choice([g for g in (1, 2, 4, 8, h) if h % g == 0])
        kind = rng.choice(("causal-window", "causal-window", "two-sided"))
        shapes.append(Case(b=max(1, rng.choice((16384, 32768)) // s), s=s, h=h, hkv=hkv, d=d,
                           dv=128 if d == 192 else 0, mask="causal" if kind == "causal-window" else "no_mask",
                           window=(w, 0) if kind == "causal-window" else (w, w), name=f"{prefix}{i}"))
    return _both(shapes)


def _fit_windows_coverage(cases: list[Case]) -> bool:
    return ({c.d for c in cases} == {64, 96, 128, 192, 256} and {c.window[1] == 0 for c in cases} == {True, False}
            and any(c.hkv < c.h for c in cases)
            and all(any(c.d == d and c.window == (w, 0) and w <= 320 for c in cases for w in (c.window[0],))
                    for d in (64, 256)))


def fit_unmasked_cases() -> list[Case]:
    """Dense unmasked calls at head dims 96 and 192/128 over 2k-16k tokens, where the profile held none (its d96
    unmasked calls were all encoders of at most 1024 tokens, where flash-attn-4 is host-bound): a packed call's GPU
    time is read off its dense twin's, and packed d96 unmasked training read flash-attn-4 at half its measured rate.
    6 shapes of 32k tokens, each in training and inference (12 rows)."""
    shapes = [Case(b=16, s=2048, h=16, hkv=8, d=96, mask="no_mask"), Case(b=8, s=4096, h=24, d=96, mask="no_mask"),
              Case(b=4, s=8192, h=16, hkv=4, d=96, mask="no_mask"), Case(b=2, s=16384, h=16, d=96, mask="no_mask"),
              Case(b=8, s=4096, h=16, d=192, dv=128, mask="no_mask"),
              Case(b=2, s=16384, h=16, hkv=4, d=192, dv=128, mask="no_mask")]
    return _both([Case(**{**c.to_dict(), "name": f"fu{i}"}) for i, c in enumerate(shapes)])


def fit_thd_cases() -> list[Case]:
    """Every packed (thd) call of the grids the profile is built from, measured again after the thd host path
    changed (each engine's host time per packed call fell by 0.1-0.5 ms, by different amounts); a run
    of this grid replaces the earlier runs of its calls in the profile (build_profile.py --refresh). The fit-drawn
    grids' calls come first (the blind grids' families), then the hand-made grids'; calls whose kv-head count does
    not divide the head count are left out (refused by every engine)."""
    grids = [lambda n=n: fit_drawn_cases(n) for n in FIT_DRAWN_SEEDS] + _hand_grids()
    return [c for grid in grids for c in grid() if c.fmt == "thd" and c.h % c.hkv == 0]


# Grids whose runs replace the earlier runs of the same calls on the same machine in the profile (build_profile.py).
REFRESH_GRIDS = frozenset({"fit-thd"})


# eval-blind-packed: a held-out grid of packed (thd) calls whose sequence lengths are drawn and fixed in the grid
# (ragged: log-uniform from 32 tokens to the longest; one long document among short ones; uniform; the harness's own
# [s/2, s] spread), to check predictions of packed calls from their lengths' distribution. Drawn and committed
# before any of it was measured; the seed is the first from 20261201 whose draw covers what _packed_coverage asks
# (two long ragged causal packs among them: the kind of call the profile missed).
PACKED_SEEDS = (20261202,)
# eval-blind-packed-2: drawn after the packed model was fitted on the profile's packed calls and on eval-blind-packed
# (which was looked at), to check it. Other ranges than the first grid's: longest lengths, token budgets (12k, 24k),
# up to 48 sequences, lengths from 16 tokens, 24 and 40 heads, other windows, and packs of short sequences with half
# of them long (bimodal). The seed is the first from 20261301 whose draw covers what _packed_2_coverage asks.
PACKED_2_SEED = 20261315
# eval-blind-packed-3: drawn after both packed grids became fit data and the machine shift was fitted, to check them.
# Other ranges again: longest lengths 640-16384, token budgets 16k and 32k, up to 64 sequences from 24 tokens, 20, 28
# and 48 heads, windows 96-2048 (2048 as in the first grid). The seed is the first from 20261401 whose draw covers
# what _packed_3_coverage asks.
PACKED_3_SEED = 20261402
# eval-blind-packed-4: drawn after the three packed grids became fit data and the machine's varlen factor was fitted
# on them, to check it. Other ranges again: longest lengths 896-14336, token budgets 20k and 40k, up to 56 sequences
# from 20 tokens, 12, 36, 40 and 56 heads, windows 160-3072. The seed is the first from 20261501 whose draw covers
# what _packed_4_coverage asks.
PACKED_4_SEED = 20261555
# eval-blind-packed-5: drawn after the four packed grids became fit data and a provider without a rate (FlexAttention)
# became predicted on packed calls relative to the others, to check it. Other ranges again: longest lengths
# 960-13312, token budgets 24k and 36k, up to 60 sequences from 28 tokens, 24, 28, 48 and 64 heads, windows
# 224-2560, and a window in two draws of three (two of five before). The seed is the first from 20261601 whose draw
# covers what _packed_5_coverage asks.
PACKED_5_SEED = 20262572
# eval-blind-packed-6: drawn after grid 5 became fit data and a provider without a rate became read off three packs,
# moved to the call's mean sequence length, to check them. Other ranges again: longest lengths 832-15360, token
# budgets 16k and 28k, up to 64 sequences from 16 tokens, windows 192-2304. The seed is the first from 20261701 whose
# draw covers what _packed_6_coverage asks.
PACKED_6_SEED = 20263339
# eval-blind-packed-7: drawn after every earlier packed grid became fit data, to check the profile they make. Other
# ranges again: longest lengths 704-14848, token budgets 20k and 32k, up to 64 sequences from 20 tokens, windows
# 144-2816. The seed is the first from 20261801 whose draw covers what _packed_7_coverage asks.
PACKED_7_SEED = 20270036
# eval-blind-packed-8: drawn after the earlier packed grids and the dense windowed grid below became data, to check
# them. Other ranges again: longest lengths 768-13824, token budgets 18k and 30k, up to 64 sequences from 18 tokens,
# windows 112-2560. The seed is the first from 20271001 whose draw covers what _packed_7_coverage asks.
PACKED_8_SEED = 20271541
# eval-blind-packed-9: drawn after grid 8 became fit data and FlexAttention lost its rate, to check them. Other ranges
# again: longest lengths 736-16384, token budgets 22k and 34k, up to 64 sequences from 22 tokens, windows 128-3072.
# The seed is the first from 20271601 whose draw covers what _packed_9_coverage asks.
PACKED_9_SEED = 20273629
# eval-blind-packed-10: drawn after grid 9 and the older grids' unmasked packs became fit data, to check them. Other
# ranges again: longest lengths 800-15872, token budgets 19k and 31k, up to 64 sequences from 19 tokens, windows
# 160-2944. The seed is the first from 20271701 whose draw covers what _packed_9_coverage asks.
PACKED_10_SEED = 20283997
# eval-blind-packed-11: drawn after grid 10 became fit data, to check it. Other ranges again: longest lengths
# 672-14336, token budgets 21k and 33k, up to 64 sequences from 21 tokens, windows 176-3200. The seed is the first
# from 20281801 whose draw covers what _packed_11_coverage asks.
PACKED_11_SEED = 20288723
# eval-blind-packed-12: drawn after grid 11 became fit data, to check it. Other ranges again: longest lengths
# 640-15360, token budgets 20k and 32k, up to 64 sequences from 23 tokens, windows 208-3456. The seed is the first
# from 20291201 whose draw covers what _packed_12_coverage asks.
PACKED_12_SEED = 20291462
# eval-blind-packed-13: drawn after grid 12 became fit data and the bench began timing flex's dynamic compile on packs,
# to check them. Other ranges again: longest lengths 704-14848, token budgets 19.5k and 31.5k, up to 64 sequences from
# 17 tokens, windows 192-3328. The seed is the first from 20291501 whose draw covers what _packed_13_coverage asks.
PACKED_13_SEED = 20291626
# eval-blind-packed-14: drawn after grid 13 became fit data, flex's packed times were read from settled runs and the
# packed model took a margin on relative predictions and flash-attn-4's windowed d128 factor, to check them. Other
# ranges again: longest lengths 608-15104, token budgets 20.5k and 32.5k, up to 64 sequences from 19 tokens, windows
# 224-3072. The seed is the first from 20291701 whose draw covers what _packed_14_coverage asks.
PACKED_14_SEED = 20292019
# eval-blind-packed-15: drawn after grid 14 became fit data, to check it. Other ranges again: longest lengths 672-14592,
# token budgets 21.25k and 32.25k, up to 64 sequences from 20 tokens, windows 240-3200. The seed is the first from
# 20292101 whose draw covers what _packed_15_coverage asks.
PACKED_15_SEED = 20292337
# eval-blind-packed-16: drawn after grid 15 became fit data, to check it. Other ranges again: longest lengths 640-15616,
# token budgets 20.5k and 32.75k, up to 64 sequences from 18 tokens, windows 256-3328. The seed is the first from
# 20292901 whose draw covers what _packed_16_coverage asks.
PACKED_16_SEED = 20293463
# eval-blind-packed-17: drawn after grid 16 became fit data, to check it. Other ranges again: longest lengths 704-15360,
# token budgets 21.5k and 32k, up to 64 sequences from 21 tokens, windows 272-3072. The seed is the first from
# 20293501 whose draw covers what _packed_17_coverage asks.
PACKED_17_SEED = 20293655
# eval-blind-packed-18: drawn after grid 17 became fit data, to check it. Other ranges again: longest lengths 736-15104,
# token budgets 21k and 33.25k, up to 64 sequences from 19 tokens, windows 288-3200. The seed is the first from
# 20293701 whose draw covers what _packed_18_coverage asks.
PACKED_18_SEED = 20294315
# eval-blind-packed-19: drawn after grid 18 became fit data, to check it. Other ranges again: longest lengths 672-14848,
# token budgets 21.5k and 32.5k, up to 64 sequences from 22 tokens, windows 304-2944. The seed is the first from
# 20294401 whose draw covers what _packed_19_coverage asks.
PACKED_19_SEED = 20295004
# eval-blind-packed-20: drawn after grid 19 and the dense unmasked fit grid became fit data and an unsplit step of
# 5 ms or more began to give its GPU rate, to check them. Other ranges again: longest lengths 704-15232, token
# budgets 20.75k and 33k, up to 64 sequences from 20 tokens, windows 320-3136. The seed is the first from 20295101
# whose draw covers what _packed_20_coverage asks.
PACKED_20_SEED = 20296482
# eval-blind-packed-21: drawn after grid 20 became fit data, a re-measure of one provider alone joined its call's
# times and flex's relative reading began to follow the work ratio where an engine skips no window tile, to check
# them. Other ranges again: longest lengths 736-14976, token budgets 21.25k and 32.25k, up to 64 sequences from 21
# tokens, windows 336-2880. The seed is the first from 20296501 whose draw covers what _packed_21_coverage asks.
PACKED_21_SEED = 20296539
# eval-blind-packed-22: drawn after grid 21 became fit data and a windowed pack's work began to follow its window
# fill, to check them. Other ranges again: longest lengths 688-15488, token budgets 20.25k and 33.5k, up to 64
# sequences from 18 tokens, windows 368-3008. The seed is the first from 20296601 whose draw covers what
# _packed_22_coverage asks.
PACKED_22_SEED = 20297048


@dataclass(frozen=True)
class PackedFamily:
    """What a packed grid draws from: each pack filled as a data loader fills one, sequences added until a token
    budget is reached (at most max_sequences), their lengths drawn by a pattern."""
    head_dims: tuple[int, ...]
    heads: tuple[int, ...]
    longest: tuple[int, ...]
    budgets: tuple[int, ...]
    max_sequences: int
    shortest: int  # ragged and short lengths are drawn log-uniform from this many tokens
    patterns: tuple[str, ...]
    kinds: tuple[str, ...]  # causal, plain, causal-window, two-sided
    windows: tuple[int, ...]
    prefix: str  # of the labels


FIRST_PACKED = PackedFamily(head_dims=(64, 96, 128, 128, 192, 256), heads=(8, 12, 16, 32),
                            longest=(1000, 2048, 3000, 4096, 6000, 8192), budgets=(8192, 16384, 32768),
                            max_sequences=32, shortest=32,
                            patterns=("ragged", "ragged", "one-long", "uniform", "near"),
                            kinds=("causal", "causal", "causal", "plain", "causal-window", "two-sided"),
                            windows=(128, 512, 1024, 2048), prefix="pk")
SECOND_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 16, 24, 32, 40),
                             longest=(768, 1536, 2500, 3500, 5120, 7168, 12288), budgets=(12288, 24576),
                             max_sequences=48, shortest=16,
                             patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                             kinds=("causal", "causal", "plain", "causal-window", "two-sided"),
                             windows=(64, 256, 768, 1536), prefix="pq")
THIRD_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 16, 20, 28, 32, 48),
                            longest=(640, 1280, 2304, 4608, 6144, 10240, 16384), budgets=(16384, 32768),
                            max_sequences=64, shortest=24,
                            patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                            kinds=("causal", "causal", "plain", "causal-window", "two-sided"),
                            windows=(96, 384, 1024, 2048), prefix="pr")
FOURTH_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 12, 16, 36, 40, 56),
                             longest=(896, 1792, 2816, 3584, 5632, 9216, 14336), budgets=(20480, 40960),
                             max_sequences=56, shortest=20,
                             patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                             kinds=("causal", "causal", "plain", "causal-window", "two-sided"),
                             windows=(160, 448, 1280, 3072), prefix="ps")
FIFTH_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 16, 24, 28, 48, 64),
                            longest=(960, 2560, 3072, 4864, 6656, 8704, 11264, 13312), budgets=(24576, 36864),
                            max_sequences=60, shortest=28,
                            patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                            kinds=("causal", "plain", "causal-window", "causal-window", "two-sided", "two-sided"),
                            windows=(224, 640, 960, 1792, 2560), prefix="pt")
SIXTH_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 12, 24, 32, 40, 64),
                            longest=(832, 1152, 2176, 3328, 5376, 7680, 9728, 15360), budgets=(16384, 28672),
                            max_sequences=64, shortest=16,
                            patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                            kinds=("causal", "plain", "causal-window", "two-sided", "causal", "plain"),
                            windows=(192, 320, 576, 1152, 2304), prefix="pu")
SEVENTH_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 16, 20, 32, 48, 56),
                              longest=(704, 1408, 2432, 3840, 4352, 6912, 10752, 14848), budgets=(20480, 32768),
                              max_sequences=64, shortest=20,
                              patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                              kinds=("causal", "plain", "causal-window", "two-sided", "causal", "plain"),
                              windows=(144, 272, 704, 1344, 2816), prefix="pv")
EIGHTH_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 12, 24, 28, 40, 64),
                             longest=(768, 1664, 2688, 3200, 4864, 7424, 11776, 13824), budgets=(18432, 30720),
                             max_sequences=64, shortest=18,
                             patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                             kinds=("causal", "plain", "causal-window", "two-sided", "causal", "plain"),
                             windows=(112, 240, 480, 1216, 2560), prefix="pw")
NINTH_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 16, 20, 32, 36, 48),
                            longest=(736, 1920, 2944, 4096, 5888, 8192, 12800, 16384), budgets=(22528, 34816),
                            max_sequences=64, shortest=22,
                            patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                            kinds=("causal", "plain", "causal-window", "two-sided", "causal", "plain"),
                            windows=(128, 352, 896, 1536, 3072), prefix="px")
TENTH_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 12, 16, 24, 40, 56),
                            longest=(800, 1600, 2720, 3456, 5120, 7936, 11008, 15872), budgets=(19456, 31744),
                            max_sequences=64, shortest=19,
                            patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                            kinds=("causal", "plain", "causal-window", "two-sided", "causal", "plain"),
                            windows=(160, 416, 800, 1408, 2944), prefix="py")
ELEVENTH_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 16, 20, 28, 32, 48),
                               longest=(672, 1536, 2560, 3712, 5376, 7168, 10240, 14336), budgets=(21504, 33792),
                               max_sequences=64, shortest=21,
                               patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                               kinds=("causal", "plain", "causal-window", "two-sided", "causal", "plain"),
                               windows=(176, 448, 864, 1664, 3200), prefix="pz")
TWELFTH_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 12, 24, 32, 40, 64),
                              longest=(640, 1472, 2304, 3968, 5632, 7680, 9728, 15360), budgets=(20992, 33280),
                              max_sequences=64, shortest=23,
                              patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                              kinds=("causal", "plain", "causal-window", "two-sided", "causal", "plain"),
                              windows=(208, 384, 960, 1792, 3456), prefix="pa")
THIRTEENTH_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 16, 20, 28, 36, 56),
                                 longest=(704, 1344, 2432, 3584, 5248, 7424, 10496, 14848), budgets=(19968, 32256),
                                 max_sequences=64, shortest=17,
                                 patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                                 kinds=("causal", "plain", "causal-window", "two-sided", "causal", "plain"),
                                 windows=(192, 352, 832, 1600, 3328), prefix="pb")
FOURTEENTH_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 12, 24, 32, 40, 48),
                                 longest=(608, 1216, 2176, 3840, 5504, 7936, 11520, 15104), budgets=(20480, 32512),
                                 max_sequences=64, shortest=19,
                                 patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                                 kinds=("causal", "plain", "causal-window", "two-sided", "causal", "plain"),
                                 windows=(224, 416, 896, 1536, 3072), prefix="pc")
FIFTEENTH_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 16, 24, 28, 40, 56),
                                longest=(672, 1280, 2304, 3712, 5760, 8192, 11008, 14592), budgets=(21760, 33024),
                                max_sequences=64, shortest=20,
                                patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                                kinds=("causal", "plain", "causal-window", "two-sided", "causal", "plain"),
                                windows=(240, 448, 928, 1664, 3200), prefix="pd")
SIXTEENTH_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 12, 20, 32, 44, 48),
                                longest=(640, 1248, 2240, 3776, 5632, 8064, 11264, 15616), budgets=(20992, 33536),
                                max_sequences=64, shortest=18,
                                patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                                kinds=("causal", "plain", "causal-window", "two-sided", "causal", "plain"),
                                windows=(256, 480, 992, 1728, 3328), prefix="pe")
SEVENTEENTH_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 16, 24, 32, 36, 64),
                                  longest=(704, 1344, 2176, 3904, 5376, 7808, 10752, 15360), budgets=(22016, 32768),
                                  max_sequences=64, shortest=21,
                                  patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                                  kinds=("causal", "plain", "causal-window", "two-sided", "causal", "plain"),
                                  windows=(272, 512, 1024, 1856, 3072), prefix="pf")
EIGHTEENTH_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 12, 16, 28, 40, 48),
                                 longest=(736, 1408, 2304, 3648, 5504, 7680, 11136, 15104), budgets=(20992, 33280),
                                 max_sequences=64, shortest=19,
                                 patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                                 kinds=("causal", "plain", "causal-window", "two-sided", "causal", "plain"),
                                 windows=(288, 544, 1056, 1920, 3200), prefix="pg")
NINETEENTH_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 16, 20, 24, 36, 56),
                                 longest=(672, 1472, 2368, 3584, 5632, 7552, 10880, 14848), budgets=(21504, 32512),
                                 max_sequences=64, shortest=22,
                                 patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                                 kinds=("causal", "plain", "causal-window", "two-sided", "causal", "plain"),
                                 windows=(304, 576, 1120, 1984, 2944), prefix="ph")
TWENTIETH_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 12, 20, 28, 32, 40),
                                longest=(704, 1344, 2432, 3840, 5504, 7936, 11392, 15232), budgets=(21248, 33792),
                                max_sequences=64, shortest=20,
                                patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                                kinds=("causal", "plain", "causal-window", "two-sided", "causal", "plain"),
                                windows=(320, 608, 1152, 2048, 3136), prefix="pi")
TWENTY_FIRST_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 16, 24, 32, 36, 48),
                                   longest=(736, 1408, 2496, 3968, 5376, 7680, 11264, 14976), budgets=(21760, 33024),
                                   max_sequences=64, shortest=21,
                                   patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                                   kinds=("causal", "plain", "causal-window", "two-sided", "causal", "plain"),
                                   windows=(336, 640, 1216, 1984, 2880), prefix="pj")
TWENTY_SECOND_PACKED = PackedFamily(head_dims=(64, 96, 128, 192, 256), heads=(8, 12, 20, 28, 40, 56),
                                    longest=(688, 1472, 2368, 4032, 5632, 7808, 11136, 15488), budgets=(20736, 34304),
                                    max_sequences=64, shortest=18,
                                    patterns=("ragged", "one-long", "bimodal", "uniform", "near"),
                                    kinds=("causal", "plain", "causal-window", "two-sided", "causal", "plain"),
                                    windows=(368, 704, 1248, 2112, 3008), prefix="pl")


def _draw_packed(seed: int, count: int, family: PackedFamily = FIRST_PACKED) -> list[Case]:
    """count packed shapes of the family: head dims 64-256 (192 with v 128), GQA, padding and padding_causal,
    causal and two-sided windows; lengths by pattern: ragged (log-uniform up to the longest), one long among short
    ones (up to 1/8 of it), bimodal (each short, up to 256, or in [s/2, s], evenly), uniform, or the harness's own
    [s/2, s]."""
    import random

    rng = random.Random(seed)
    pick = rng.choice
    low = family.shortest

    def log_uniform(lo: int, hi: int) -> int:
        return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))

    draws = {"ragged": lambda s: log_uniform(low, s), "one-long": lambda s: log_uniform(low, max(low + 1, s // 8)),
             "uniform": lambda s: s, "near": lambda s: rng.randint(s // 2, s),
             "bimodal": lambda s: log_uniform(low, 256) if rng.random() < 0.5 else rng.randint(s // 2, s)}
    shapes = []
    for i in range(count):
        d = pick(family.head_dims)
        h = pick(family.heads)
        hkv = pick([g for g in (1, 2, 4, 8, h) if h % g == 0])
        s = pick(family.longest)
        budget = max(pick(family.budgets), 2 * s)
        pattern = pick(family.patterns)
        lens = [s]
        while len(lens) < family.max_sequences and sum(lens) < budget:
            lens.append(min(draws[pattern](s), budget - sum(lens)))
        rng.shuffle(lens)
        kind = pick(family.kinds)
        mask = "padding_causal" if kind.startswith("causal") else "padding"
        window = None
        if kind in ("causal-window", "two-sided"):
            w = pick([x for x in family.windows if x < s])
            window = (w, 0) if kind == "causal-window" else (w, w)
        shapes.append(Case(b=len(lens), s=s, h=h, hkv=hkv, d=d, dv=128 if d == 192 else 0, mask=mask, window=window,
                           fmt="thd", seqlens=tuple(lens), name=f"{family.prefix}{i}-{pattern}"))
    return shapes


def _packed_coverage(shapes: list[Case]) -> bool:
    patterns = [c.name.split("-", 1)[1] for c in shapes]
    long_ragged = sum(p in ("ragged", "one-long") and c.s >= 4096 and c.mask == "padding_causal"
                      for p, c in zip(patterns, shapes))
    return ({64, 256} <= {c.d for c in shapes} and {"ragged", "one-long", "uniform", "near"} <= set(patterns)
            and {c.window[1] == 0 for c in shapes if c.window} == {True, False}
            and any(c.hkv != c.h for c in shapes) and {c.mask for c in shapes} == {"padding", "padding_causal"}
            and long_ragged >= 2)


def _packed_2_coverage(shapes: list[Case]) -> bool:
    """Every head dim and pattern, both kinds of window, GQA and MHA, causal and unmasked packs without a window,
    two long ragged causal packs, a d128 causal GQA pack without a window (an LLM's training call), at most two d192
    shapes (only cuDNN trains those: no choice to check)."""
    patterns = [c.name.split("-", 1)[1] for c in shapes]
    long_ragged = sum(p in ("ragged", "one-long", "bimodal") and c.s >= 3500 and c.mask == "padding_causal"
                      for p, c in zip(patterns, shapes))
    return ({c.d for c in shapes} == {64, 96, 128, 192, 256} and set(patterns) == set(SECOND_PACKED.patterns)
            and {c.window[1] == 0 for c in shapes if c.window} == {True, False}
            and {c.hkv != c.h for c in shapes} == {True, False}
            and {c.mask for c in shapes if not c.window} == {"padding", "padding_causal"}
            and long_ragged >= 2 and sum(c.d == 192 for c in shapes) <= 2
            and any(c.d == 128 and c.hkv != c.h and c.mask == "padding_causal" and not c.window for c in shapes))


def _packed_3_coverage(shapes: list[Case]) -> bool:
    """The second grid's coverage, and a d256 causal GQA pack without a window (the kind the second grid's worst
    row was) and one of 40 sequences or more."""
    return (_packed_2_coverage(shapes) and max(c.b for c in shapes) >= 40
            and any(c.d == 256 and c.hkv != c.h and c.mask == "padding_causal" and not c.window for c in shapes))


def _packed_4_coverage(shapes: list[Case]) -> bool:
    """The third grid's coverage, and the kinds its misses were: a causal-window GQA pack with a window of at most
    512, and a d64 pack of 32 sequences or more whose longest is at most 1024."""
    return (_packed_3_coverage(shapes)
            and any(c.window and c.window[1] == 0 and c.window[0] <= 512 and c.hkv != c.h for c in shapes)
            and any(c.d == 64 and c.b >= 32 and c.s <= 1024 for c in shapes))


def _packed_5_coverage(shapes: list[Case]) -> bool:
    """The fourth grid's coverage, and the kind its miss was, windowed long packs: a d128 causal-window pack whose
    longest is 8192 or more under a window of 640 or more (where flex_attention:torch's forward beat FA2's), and a
    windowed pack as long at another head dim (where it lost)."""
    return (_packed_4_coverage(shapes)
            and any(c.d == 128 and c.window and c.window[1] == 0 and c.window[0] >= 640 and c.s >= 8192
                    for c in shapes)
            and any(c.d != 128 and c.window and c.s >= 8192 for c in shapes))


def _packed_6_coverage(shapes: list[Case]) -> bool:
    """The fifth grid's coverage, and the kinds of its misses and of the picks its fit moved: a pack of 32 sequences
    or more whose mean length is under 128 tokens (flash-attn-4's and cuDNN's forwards ran 1.5-1.8x their predicted
    time on the two such packs measured, FA2's did not), a d128 causal pack without a window, of near or uniform
    lengths, whose longest is 6144 or more (where stock torch now picks flex_attention:torch over FA2), and a d192
    pack without a mask or window (pt0's kind: cuDNN picked, flash-attn-4 faster)."""
    return (_packed_5_coverage(shapes)
            and any(c.b >= 32 and sum(c.seqlens) < 128 * c.b for c in shapes)
            and any(c.d == 128 and c.mask == "padding_causal" and not c.window and c.s >= 6144
                    and c.name.split("-", 1)[1] in ("uniform", "near") for c in shapes)
            and any(c.d == 192 and c.mask == "padding" and not c.window for c in shapes))


def _packed_7_coverage(shapes: list[Case]) -> bool:
    """_packed_3_coverage, and the kinds of call the packed profile last missed: a d256 causal-window pack under a
    window of at most 320 (its dense twin's span is shorter than most measured windows), a d128 pack of near or
    uniform lengths without a mask or window whose longest is 3072 or more, and a pack of 32 sequences or more whose
    mean length is under 128 tokens. (_packed_4_coverage to _packed_6_coverage compounded: no seed of 36k drawn met
    them here.)"""
    return (_packed_3_coverage(shapes)
            and any(c.d == 256 and c.window and c.window[1] == 0 and c.window[0] <= 320 for c in shapes)
            and any(c.d == 128 and c.mask == "padding" and not c.window and c.s >= 3072
                    and c.name.split("-", 1)[1] in ("uniform", "near") for c in shapes)
            and any(c.b >= 32 and sum(c.seqlens) < 128 * c.b for c in shapes))


def _packed_9_coverage(shapes: list[Case]) -> bool:
    """_packed_7_coverage, with its long d128 unmasked pack of near or uniform lengths at least 6144 long: where the
    profile now picks FlexAttention on flash-attn-4 over flash-attn-4 by a slope read off shorter packs."""
    return _packed_7_coverage(shapes) and any(
        c.d == 128 and c.mask == "padding" and not c.window and c.s >= 6144
        and c.name.split("-", 1)[1] in ("uniform", "near") for c in shapes)


def _packed_11_coverage(shapes: list[Case]) -> bool:
    """_packed_9_coverage, and the kinds grid 10's misses and the packed fit's own misses were: a d128 causal pack
    without a window with one key/value head (stock: FA2 picked, flex faster in training), and a pack under a window
    of at most 256 at a head dim other than 256 (the fit's largest misses are such packs)."""
    return (_packed_9_coverage(shapes)
            and any(c.d == 128 and c.mask == "padding_causal" and not c.window and c.hkv == 1 for c in shapes)
            and any(c.window and c.window[0] <= 256 and c.d != 256 for c in shapes))


def _packed_12_coverage(shapes: list[Case]) -> bool:
    """_packed_3_coverage, and the kinds grid 11's misses were: a d128 causal-window pack under a window of at most
    256 (full stack: flash-attn-4 picked, cuDNN's forward 1.25x faster), a d128 causal pack without a window of 32
    sequences or more (stock: FA2 picked, flex's forward 1.09x faster); and a pack of 32 sequences or more whose mean
    length is under 128 tokens. (_packed_11_coverage with these: no seed of 200k drawn met it.)"""
    return (_packed_3_coverage(shapes)
            and any(c.d == 128 and c.window and c.window[1] == 0 and c.window[0] <= 256 for c in shapes)
            and any(c.d == 128 and c.mask == "padding_causal" and not c.window and c.b >= 32 for c in shapes)
            and any(c.b >= 32 and sum(c.seqlens) < 128 * c.b for c in shapes))


def _packed_13_coverage(shapes: list[Case]) -> bool:
    """_packed_3_coverage, and the kinds grid 12's misses were: a d128 causal-window pack under a window of at most
    256 (full stack: flash-attn-4 picked, cuDNN's forward faster), and a d64 pack without a mask or window (stock: FA2
    picked, flex 1.06-1.20x faster)."""
    return (_packed_3_coverage(shapes)
            and any(c.d == 128 and c.window and c.window[1] == 0 and c.window[0] <= 256 for c in shapes)
            and any(c.d == 64 and c.mask == "padding" and not c.window for c in shapes))


def _packed_14_coverage(shapes: list[Case]) -> bool:
    """_packed_3_coverage, and the kinds grid 13's misses were and the packed model last changed on: a d128
    causal-window pack under a window of at most 256 (flash-attn-4's windowed d128 forward factor), a d64 two-sided
    pack (stock: FA2 picked, flex 1.23x faster), and a d128 causal pack without a window (stock: flex picked in
    training, FA2 faster)."""
    return (_packed_3_coverage(shapes)
            and any(c.d == 128 and c.window and c.window[1] == 0 and c.window[0] <= 256 for c in shapes)
            and any(c.d == 64 and c.window and c.window[1] > 0 for c in shapes)
            and any(c.d == 128 and c.mask == "padding_causal" and not c.window for c in shapes))


def _packed_15_coverage(shapes: list[Case]) -> bool:
    """_packed_3_coverage, and the kinds grid 14's misses were: a d192 causal pack (full stack: cuDNN picked,
    flash-attn-4's forward 1.13x faster), a d64 causal-window pack under a window of at most 1024 (stock: FA2 picked,
    flex's forward 1.16x faster), and a d256 causal-window pack (full stack: cuDNN picked in training, FA2 1.10x
    faster)."""
    return (_packed_3_coverage(shapes)
            and any(c.d == 192 and c.mask == "padding_causal" for c in shapes)
            and any(c.d == 64 and c.window and c.window[1] == 0 and c.window[0] <= 1024 for c in shapes)
            and any(c.d == 256 and c.window and c.window[1] == 0 for c in shapes))


def _packed_16_coverage(shapes: list[Case]) -> bool:
    """_packed_3_coverage, and the kind grid 15's miss was: a d128 causal pack without a window of 32 sequences or
    more (stock: FA2 picked, flex's forward faster); and the kind the worst row was with each packed grid left out
    in turn: a d64 causal-window pack under a window of at most 1024 (stock: flex picked, FA2 1.51x faster)."""
    return (_packed_3_coverage(shapes)
            and any(c.d == 128 and c.mask == "padding_causal" and not c.window and c.b >= 32 for c in shapes)
            and any(c.d == 64 and c.window and c.window[1] == 0 and c.window[0] <= 1024 for c in shapes))


def _packed_17_coverage(shapes: list[Case]) -> bool:
    """_packed_3_coverage, and the kinds grid 16's full-stack misses were: a d256 causal pack of 48 sequences or more
    (cuDNN and flash-attn-4 picked, FA2 faster where the host ran slow) and a d256 two-sided-window pack
    (flash-attn-4 picked, FA2's forward faster)."""
    return (_packed_3_coverage(shapes)
            and any(c.d == 256 and c.mask == "padding_causal" and not c.window and c.b >= 48 for c in shapes)
            and any(c.d == 256 and c.window and c.window[1] > 0 for c in shapes))


def _packed_18_coverage(shapes: list[Case]) -> bool:
    """_packed_3_coverage, and the kinds grid 17's full-stack misses were: a d96 pack without a mask or window of 32
    sequences or more (cuDNN picked, flash-attn-4's forward 1.32x faster) and a d64 causal-window pack under a window
    of at most 640 (flash-attn-4 picked, cuDNN's forward 1.26x faster)."""
    return (_packed_3_coverage(shapes)
            and any(c.d == 96 and c.mask == "padding" and not c.window and c.b >= 32 for c in shapes)
            and any(c.d == 64 and c.window and c.window[1] == 0 and c.window[0] <= 640 for c in shapes))


def _packed_19_coverage(shapes: list[Case]) -> bool:
    """_packed_3_coverage, and the kind grid 18's stock miss was: a d128 two-sided-window pack with 4 or more query
    heads a key-value head (FA2 picked, flex's forward 1.25x faster); and the kind its full-stack worst row was: a
    d64 causal-window pack under a window of at most 640 (flash-attn-4 picked, cuDNN's forward 1.04x faster)."""
    return (_packed_3_coverage(shapes)
            and any(c.d == 128 and c.window and c.window[1] > 0 and c.h >= 4 * c.hkv for c in shapes)
            and any(c.d == 64 and c.window and c.window[1] == 0 and c.window[0] <= 640 for c in shapes))


def _packed_20_coverage(shapes: list[Case]) -> bool:
    """_packed_3_coverage, and the kinds grid 19's misses were: a d96 pack without a mask or window of 16 sequences
    or more, the longest at least 2048 (cuDNN picked, flash-attn-4's training step 1.42x faster); a d192 causal pack
    (cuDNN picked, flash-attn-4's forward 1.13x faster); and a d128 causal pack of 16 sequences or more, the longest
    at least 4096 (stock: FA2 picked, flex's forward 1.20x faster)."""
    return (_packed_3_coverage(shapes)
            and any(c.d == 96 and c.mask == "padding" and not c.window and c.b >= 16 and c.s >= 2048 for c in shapes)
            and any(c.d == 192 and c.mask == "padding_causal" and not c.window for c in shapes)
            and any(c.d == 128 and c.mask == "padding_causal" and not c.window and c.b >= 16 and c.s >= 4096
                    for c in shapes))


def _packed_21_coverage(shapes: list[Case]) -> bool:
    """_packed_3_coverage, and the kind grid 20's miss was: a d192 pack under a two-sided window a quarter of its
    longest or less (cuDNN's backward computes every tile there, flex's skips the band's outside: flex's training
    step 1.40x faster)."""
    return (_packed_3_coverage(shapes)
            and any(c.d == 192 and c.window and c.window[1] > 0 and 4 * c.window[0] <= c.s for c in shapes))


def _packed_22_coverage(shapes: list[Case]) -> bool:
    """_packed_3_coverage, and the kind grid 21's miss was: a causal-window pack of 48 sequences or more whose
    longest is at least twice the window (one long among short ones: flash-attn-4 picked, FA2's forward 2.3x
    faster, its GPU time read off the token fill's bound)."""
    return (_packed_3_coverage(shapes)
            and any(c.window and c.window[1] == 0 and c.b >= 48 and c.s >= 2 * c.window[0] for c in shapes))


def eval_packed_cases(seed: int = PACKED_SEEDS[0]) -> list[Case]:
    """12 packed shapes of fixed lengths, each in training and inference (24 rows)."""
    return _both(_draw_packed(seed, 12))


# The packed grids after the first: (seed, family) each; each grid is 12 packed shapes of its family, each in training
# and inference (24 rows).
PACKED_GRIDS = {f"eval-blind-packed-{n}": (seed, family) for n, seed, family in (
    (2, PACKED_2_SEED, SECOND_PACKED), (3, PACKED_3_SEED, THIRD_PACKED), (4, PACKED_4_SEED, FOURTH_PACKED),
    (5, PACKED_5_SEED, FIFTH_PACKED), (6, PACKED_6_SEED, SIXTH_PACKED), (7, PACKED_7_SEED, SEVENTH_PACKED),
    (8, PACKED_8_SEED, EIGHTH_PACKED), (9, PACKED_9_SEED, NINTH_PACKED), (10, PACKED_10_SEED, TENTH_PACKED),
    (11, PACKED_11_SEED, ELEVENTH_PACKED), (12, PACKED_12_SEED, TWELFTH_PACKED),
    (13, PACKED_13_SEED, THIRTEENTH_PACKED), (14, PACKED_14_SEED, FOURTEENTH_PACKED),
    (15, PACKED_15_SEED, FIFTEENTH_PACKED), (16, PACKED_16_SEED, SIXTEENTH_PACKED),
    (17, PACKED_17_SEED, SEVENTEENTH_PACKED), (18, PACKED_18_SEED, EIGHTEENTH_PACKED),
    (19, PACKED_19_SEED, NINETEENTH_PACKED), (20, PACKED_20_SEED, TWENTIETH_PACKED),
    (21, PACKED_21_SEED, TWENTY_FIRST_PACKED), (22, PACKED_22_SEED, TWENTY_SECOND_PACKED))}


def smoke_cases() -> list[Case]:
    return [Case(b=2, s=256, h=4, d=64), Case(b=2, s=256, h=4, d=64, train=False),
            Case(b=2, s=256, h=4, d=64, fmt="sbhd"), Case(b=2, s=256, h=4, d=64, mask="padding_causal", fmt="thd")]


CASE_GRIDS = {"fit": fit_cases, "eval": eval_cases, "smoke": smoke_cases, "fit-extra": fit_extra_cases,
              "fit-gqa": fit_gqa_cases, "eval-fresh": eval_fresh_cases,
              "eval-blind": eval_blind_cases,
              **{f"eval-blind{i + 1}": (lambda s=seed: eval_blind_cases(s)) for i, seed in enumerate(BLIND_SEEDS) if i},
              "fit-thd": fit_thd_cases,
              **{name: (lambda n=name: fit_drawn_cases(n)) for name in FIT_DRAWN_SEEDS}, "fit-dense": fit_dense_cases,
              "eval-blind-packed": eval_packed_cases, "fit-windows": fit_windows_cases,
              "fit-unmasked": fit_unmasked_cases,
              **{name: (lambda s=seed, f=family: _both(_draw_packed(s, 12, f)))
                 for name, (seed, family) in PACKED_GRIDS.items()},
              "eval-windows": lambda: fit_windows_cases(EVAL_WINDOWS_SEED, "ew")}
