import pytest

from attn_dispatch.platform import PROFILES, Platform, cudnn_version_string


def test_parse_tokens_describe_a_machine():
    p = Platform.parse("sm80,cudnn=8.9.7,flash-attn=2.4.2")
    assert p.device_type == "cuda" and p.sm == 80
    assert str(p.cudnn) == "8.9.7"
    assert str(p.package_version("flash-attn")) == "2.4.2"
    assert not p.package("flash-attn-4").installed
    assert p.torch_flash_sdpa and not p.torch_cudnn_sdpa  # cuDNN 8: torch's cuDNN SDPA path needs 9


def test_profile_with_overrides():
    p = Platform.parse("h100-cudnn9,cudnn=9.1.0,no-flash-attn-4")
    assert p.sm == 90 and p.cudnn_version == "9.1.0"
    assert not p.package("flash-attn-4").installed
    assert p.package("cudnn-frontend").installed


def test_cpu_profile_and_token():
    assert Platform.parse("cpu").device_type == "cpu"
    assert Platform.parse("h100-cudnn9,cpu").compute_capability is None


@pytest.mark.parametrize("spec, words", [
    ("", ["empty"]),
    ("sm80,cudnn=latest", ["cudnn=latest", "not a version"]),
    ("sm80,flashattn=2.1", ["flashattn", "known keys"]),
    ("gpu9000", ["gpu9000", "profile"]),
])
def test_bad_specs_say_what_is_accepted(spec, words):
    with pytest.raises(ValueError) as info:
        Platform.parse(spec)
    for word in words:
        assert word in str(info.value)


def test_profiles_are_hashable_values():
    assert len({hash(p) for p in PROFILES.values()}) == len(PROFILES)
    assert Platform.parse("a100-cudnn8") == PROFILES["a100-cudnn8"].__class__(**{
        **{f: getattr(PROFILES["a100-cudnn8"], f) for f in ("device_type", "compute_capability", "device_name",
                                                           "cuda_version", "cudnn_version", "torch_version",
                                                           "packages", "torch_flash_sdpa", "torch_cudnn_sdpa")},
        "name": "other"})  # equality ignores nothing but the hash field


def test_cudnn_version_numbers():
    assert cudnn_version_string(8907) == "8.9.7"
    assert cudnn_version_string(91900) == "9.19.0"
    assert cudnn_version_string(90100) == "9.1.0"


def test_detect_on_this_machine_is_consistent():
    import torch

    p = Platform.detect()
    assert p is Platform.detect()  # probed once
    assert p.device_type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert p.torch_version == torch.__version__
