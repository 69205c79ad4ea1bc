"""A module's plan cache: one module called from several threads with different shapes stays correct, and a plan
is made once per key however many threads miss together."""
from __future__ import annotations

import threading

import torch

from attn_dispatch import DotProductAttention, selection


def _reference(q, k, v):
    k, v = k.repeat_interleave(q.shape[2] // k.shape[2], 2), v.repeat_interleave(q.shape[2] // v.shape[2], 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).flatten(-2)


def test_one_module_called_from_several_threads_stays_correct(monkeypatch):
    module = DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="causal")
    decided = []
    real_select = selection.select

    def counting_select(params, *args, **kwargs):
        decided.append(params.max_seqlen_q)
        return real_select(params, *args, **kwargs)

    monkeypatch.setattr(selection, "select", counting_select)
    errors = []
    barrier = threading.Barrier(6)

    def worker(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        s = 3 + seed % 3  # three shapes over six threads
        try:
            barrier.wait()
            for _ in range(20):
                q = torch.randn(2, s, 4, 8, generator=g, dtype=torch.float64)
                k, v = (torch.randn(2, s, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
                torch.testing.assert_close(module(q, k, v), _reference(q, k, v))
        except Exception as exc:  # noqa: BLE001 - reported below with the thread's seed
            errors.append((seed, exc))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert sorted(set(decided)) == [3, 4, 5] and len(decided) == 3, decided  # one plan per shape


def test_the_private_switch_turns_every_private_shortcut_off():
    """ATTN_DISPATCH_PRIVATE_TORCH=0 (read at import): no C++ tensor guard, no raw autograd apply, no raw CUDA
    stream, no nn.Module.__call__ shortcut, no flash-attn-4 launch replay, the public environment read."""
    import os
    import subprocess
    import sys

    probe = ("import os; from attn_dispatch import inputs, module, freshness, env; "
             "from attn_dispatch.backends import base, cudnn_fused, _fa4_replay; "
             "print(inputs._TensorGuards is None, base._RAW_APPLY is None, cudnn_fused._RAW_STREAM is None, "
             "module._SHORTCUT is False, freshness.environ_now.__name__ == 'public', "
             "_fa4_replay.replay_enabled() is False)")
    probes = {value: subprocess.Popen([sys.executable, "-c", probe], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env={**os.environ, "ATTN_DISPATCH_PRIVATE_TORCH": value})
              for value in ("0", "1")}  # both at once: each is mostly torch's import
    for value, expected in (("0", "True True True True True True"), ("1", None)):
        stdout, stderr = probes[value].communicate(timeout=120)
        assert probes[value].returncode == 0, stderr[-2000:]
        if expected:
            assert stdout.split("\n")[0] == expected, stdout
        else:  # on: the CPU has no raw stream and no replay, but the guard, raw apply and shortcut are in use
            assert stdout.startswith("False False"), stdout
