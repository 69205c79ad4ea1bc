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
    ("h100-cudnn9,launch-us=fast", ["launch-us", "microseconds"]),
    ("h100-cudnn9,launch-us=-2", ["launch-us", "positive"]),
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


def test_host_speed_is_platform_data():
    slow, fast = Platform.parse("h100-cudnn9,launch-us=9.5"), Platform.parse("h100-cudnn9,launch-us=4.25")
    assert (slow.launch_us, fast.launch_us) == (9.5, 4.25) and slow != fast and hash(slow) != hash(fast)
    assert "host 9.5 us per launch" in slow.describe() and slow.to_dict()["launch_us"] == 9.5
    assert PROFILES["h100-cudnn9"].launch_us is None and Platform.parse("h100-cudnn9,launch-us=5,cpu").launch_us is None
    assert Platform.detect().launch_us is None  # measured only when a profile has a reference to scale by


def test_host_probe_times_launches_from_python():
    from attn_dispatch.host_probe import launch_us

    found = [launch_us("cpu", calls=16, loops=3) for _ in range(3)]
    assert all(0.05 < t < 1000.0 for t in found)  # microseconds per torch.add call on this CPU
    import torch
    from attn_dispatch.host_probe import measured_launch_us
    if not torch.cuda.is_available():
        assert measured_launch_us() is None
