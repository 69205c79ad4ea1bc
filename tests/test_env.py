import os
import sys
from pathlib import Path

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


def test_fp8_dpa_bwd_defaults_to_an_fp8_backward_and_zero_asks_for_a_high_precision_one():
    assert EnvFlags.from_environ({}).fp8_dpa_bwd and EnvFlags.from_environ({"NVTE_FP8_DPA_BWD": "1"}).fp8_dpa_bwd
    off = EnvFlags.from_environ({"NVTE_FP8_DPA_BWD": "0"})
    assert not off.fp8_dpa_bwd and off != EnvFlags.from_environ({}) and hash(off) != hash(EnvFlags.from_environ({}))


def test_fp8_dpa_bwd_is_part_of_what_a_plan_is_stamped_with(monkeypatch):
    """A plan made under one value is stale under the other (freshness reads the decision's variables)."""
    from attn_dispatch import freshness
    from attn_dispatch.env import DECISION_ENV_VARS

    assert "NVTE_FP8_DPA_BWD" in DECISION_ENV_VARS
    monkeypatch.delenv("NVTE_FP8_DPA_BWD", raising=False)
    before = freshness.current_stamp()
    monkeypatch.setenv("NVTE_FP8_DPA_BWD", "0")
    assert freshness.current_stamp() != before
    monkeypatch.delenv("NVTE_FP8_DPA_BWD")
    assert freshness.current_stamp() == before


def test_forced_backend_family_and_provider():
    f = EnvFlags.from_environ({"ATTN_DISPATCH_BACKEND": "flash_attn_2:torch"})
    assert (f.forced_family, f.forced_provider) == ("flash_attn_2", "torch")
    assert EnvFlags.from_environ({"ATTN_DISPATCH_BACKEND": "auto"}).forced_backend is None


@pytest.mark.parametrize("name, value, accepted", [
    ("NVTE_FLASH_ATTN", "yes", "0 or 1"),
    ("NVTE_FUSED_ATTN_BACKEND", "3", "F16_arbitrary_seqlen"),
    ("NVTE_DEBUG_LEVEL", "5", "0, 1 or 2"),
    ("NVTE_FP8_DPA_BWD", "2", "0 or 1"),
    ("ATTN_DISPATCH_BACKEND", "flash", "cudnn_fused"),
    ("ATTN_DISPATCH_POLICY", "fastest", "measured"),
])
def test_bad_values_name_variable_value_and_accepted(name, value, accepted):
    with pytest.raises(ValueError) as info:
        EnvFlags.from_environ({name: value})
    message = str(info.value)
    assert name in message and repr(value) in message and accepted in message


def test_environment_is_read_through_os_environ_when_asked(monkeypatch):
    from attn_dispatch import env

    monkeypatch.delenv("NVTE_DEBUG", raising=False)
    assert env.current_raw()[env.ENV_VARS.index("NVTE_DEBUG")] is None and EnvFlags.from_environ().debug is False
    monkeypatch.setenv("NVTE_DEBUG", "1")
    assert env.current_raw()[env.ENV_VARS.index("NVTE_DEBUG")] == "1" and EnvFlags.from_environ().debug is True
    assert tuple(env.current_raw()) == tuple(os.environ.get(name) for name in env.ENV_VARS)


def test_importing_the_package_installs_no_process_wide_hook():
    """Issue 17: an audit hook taxed every audited event of the process (sys._getframe 12x slower)."""
    import subprocess

    code = ("import sys, time\n"
            "hooks = []\n"
            "real = sys.addaudithook\n"
            "sys.addaudithook = lambda h: (hooks.append(h), real(h))\n"
            "import attn_dispatch, attn_dispatch.module, attn_dispatch.selection\n"
            "print(len(hooks))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0"
    import attn_dispatch.env as env_module

    source = Path(env_module.__file__).read_text()
    assert "addaudithook" not in source and "_data" not in source
