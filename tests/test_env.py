import os
import sys

import pytest

from attn_dispatch.env import EnvFlags


def test_defaults_allow_everything():
    f = EnvFlags.from_environ({})
    assert f.flash_attn and f.fused_attn and f.unfused_attn and f.allow_nondeterministic
    assert f.forced_backend is None and f.policy == "auto" and f.debug_level == 0


def test_transformer_engine_meanings():
    f = EnvFlags.from_environ({"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN_BACKEND": "1",
                               "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "NVTE_DEBUG": "1", "NVTE_DEBUG_LEVEL": "2"})
    assert not f.flash_attn and f.fused_attn
    assert f.fused_sub_backend_name == "F16_arbitrary_seqlen"
    assert not f.allow_nondeterministic and f.debug and f.debug_level == 2


def test_forced_backend_family_and_provider():
    f = EnvFlags.from_environ({"ATTN_DISPATCH_BACKEND": "flash_attn_2:torch"})
    assert (f.forced_family, f.forced_provider) == ("flash_attn_2", "torch")
    assert EnvFlags.from_environ({"ATTN_DISPATCH_BACKEND": "auto"}).forced_backend is None


@pytest.mark.parametrize("name, value, accepted", [
    ("NVTE_FLASH_ATTN", "yes", "0 or 1"),
    ("NVTE_FUSED_ATTN_BACKEND", "3", "F16_arbitrary_seqlen"),
    ("NVTE_DEBUG_LEVEL", "5", "0, 1 or 2"),
    ("ATTN_DISPATCH_BACKEND", "flash", "cudnn_fused"),
    ("ATTN_DISPATCH_POLICY", "fastest", "measured"),
])
def test_bad_values_name_variable_value_and_accepted(name, value, accepted):
    with pytest.raises(ValueError) as info:
        EnvFlags.from_environ({name: value})
    message = str(info.value)
    assert name in message and repr(value) in message and accepted in message


def test_watched_environment_follows_os_environ_and_keeps_identity_while_unchanged(monkeypatch):
    """The audit-hook mirror: one tuple object while nothing changes (what a cached call compares by identity),
    a new one with the new value after os.environ changes, and the parsed flags follow."""
    from attn_dispatch import env

    if env._WATCHED[0] is None:
        pytest.skip("this Python has no audit hooks: the environment is read on every call instead")
    monkeypatch.delenv("NVTE_DEBUG", raising=False)
    before = env.current_raw()
    assert env.current_raw() is before
    monkeypatch.setenv("NVTE_DEBUG", "1")
    after = env.current_raw()
    assert after is not before and after[env.ENV_VARS.index("NVTE_DEBUG")] == "1"
    assert EnvFlags.from_environ().debug is True
    monkeypatch.delenv("NVTE_DEBUG")
    assert env.current_raw()[env.ENV_VARS.index("NVTE_DEBUG")] is None and EnvFlags.from_environ().debug is False
    os.environ["NVTE_FUSED_ATTN"] = "0"
    try:
        assert EnvFlags.from_environ().fused_attn is False
    finally:
        del os.environ["NVTE_FUSED_ATTN"]
    assert EnvFlags.from_environ().fused_attn is True
    assert tuple(env.current_raw()) == tuple(
        os.environ.get(name) for name in env.ENV_VARS)  # the mirror agrees with os.environ


def test_unwatched_environment_is_read_each_time(monkeypatch):
    from attn_dispatch import env

    monkeypatch.setattr(env, "_WATCHED", [None])
    monkeypatch.setenv("NVTE_DEBUG_LEVEL", "2")
    assert env.current_raw()[env.ENV_VARS.index("NVTE_DEBUG_LEVEL")] in ("2", b"2")
    assert EnvFlags.from_environ().debug_level == 2


def test_watched_environment_keeps_every_change_from_concurrent_threads():
    import threading

    from attn_dispatch import env

    if env._WATCHED[0] is None:
        pytest.skip("this Python has no audit hooks")
    names = ["NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN", "NVTE_DEBUG"]
    saved = {n: os.environ.get(n) for n in names}
    barrier = threading.Barrier(len(names))

    def flip(name: str) -> None:
        barrier.wait()
        for i in range(1000):
            os.environ[name] = str(i % 2)
        os.environ[name] = "1"

    threads = [threading.Thread(target=flip, args=(n,)) for n in names]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, inside the hook too
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        raw = env.current_raw()
        assert [raw[env.ENV_VARS.index(n)] for n in names] == ["1"] * len(names)
    finally:
        sys.setswitchinterval(interval)
        for n, v in saved.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v
