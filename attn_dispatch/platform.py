"""Platform: the machine a decision is made for, as a value.

`Platform.detect()` probes the live machine once; `Platform.parse(spec)` describes any other one
("sm80,cudnn=8.9.7,flash-attn=2.4.2", or a named profile such as "h100-cudnn9"), so that every
question can be asked on a laptop with no GPU.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
from dataclasses import dataclass, field, replace
from typing import Any

from packaging.version import InvalidVersion, Version

from . import runtime_facts
from .runtime_facts import RuntimeFacts

# Engine packages we know how to use: spec key -> (distribution name, import name).
ENGINE_PACKAGES: dict[str, tuple[str, str]] = {
    # flash-attn 2.x is probed by its compiled extension: with only flash-attn-4 installed,
    # `flash_attn` is a namespace package holding nothing but `flash_attn.cute`.
    "flash-attn": ("flash-attn", "flash_attn_2_cuda"),
    "flash-attn-3": ("flash-attn-3", "flash_attn_interface"),
    "flash-attn-4": ("flash-attn-4", "flash_attn.cute"),
    "cudnn-frontend": ("nvidia-cudnn-frontend", "cudnn"),
}


_LIVE: list = [None, None]  # (the runtime facts, the live platform carrying them)

@dataclass(frozen=True)
class PackageStatus:
    name: str
    version: str | None = None
    error: str | None = None  # why it is unavailable, when version is None

    @property
    def installed(self) -> bool:
        return self.version is not None

    def describe(self) -> str:
        return self.version if self.installed else f"unavailable ({self.error or 'not installed'})"


@dataclass(frozen=True)
class Platform:
    device_type: str = "cpu"
    compute_capability: tuple[int, int] | None = None
    device_name: str = "cpu"
    cuda_version: str | None = None
    cudnn_version: str | None = None
    torch_version: str = "2.11.0"
    packages: tuple[PackageStatus, ...] = ()
    torch_flash_sdpa: bool = False  # torch built with its vendored FlashAttention-2 kernels
    torch_cudnn_sdpa: bool = False  # torch built with its cuDNN SDPA path
    # triton importable: torch.compile's GPU code generator, which builds FlexAttention's kernels. torch's CUDA wheels
    # depend on it, so a described platform has it unless its spec says 'no-triton'
    triton: bool = True
    # what this process learned while running (the live machine only; compared by identity)
    facts: RuntimeFacts = runtime_facts.NONE
    name: str = field(default="custom", compare=False)
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.device_type, self.compute_capability, self.device_name,
                                                self.cuda_version, self.cudnn_version, self.torch_version,
                                                self.packages, self.torch_flash_sdpa, self.torch_cudnn_sdpa,
                                                self.triton, self.facts)))
        # Answers the tables ask for on every fresh decision, computed once.
        cc = self.compute_capability
        object.__setattr__(self, "_sm", cc[0] * 10 + cc[1] if cc else 0)
        object.__setattr__(self, "_packages", {p.name: p for p in self.packages})

    def __hash__(self) -> int:
        return self._hash

    # --- questions the constraint tables ask ---------------------------------------------------
    @property
    def sm(self) -> int:
        """Compute capability as one number (sm90 -> 90); 0 off the GPU."""
        return self._sm  # type: ignore[attr-defined]

    def package(self, key: str) -> PackageStatus:
        status = self._packages.get(key)  # type: ignore[attr-defined]
        return status if status is not None else PackageStatus(key, None, "not installed")

    def package_version(self, key: str) -> Version | None:
        return parse_version(self.package(key).version)

    @property
    def cudnn(self) -> Version | None:
        return parse_version(self.cudnn_version)

    @property
    def torch(self) -> Version:
        return parse_version(self.torch_version) or Version("0")

    def with_packages(self, **versions: str | None) -> "Platform":
        """A copy with some packages set ('flash_attn_4'='4.0.0b36') or removed (None)."""
        updated = {p.name: p for p in self.packages}
        for key, version in versions.items():
            key = key.replace("_", "-")
            _check_package_key(key)
            updated[key] = PackageStatus(key, version, None if version else "not installed")
        return replace(self, packages=tuple(sorted(updated.values(), key=lambda p: p.name)))

    def describe(self) -> str:
        if self.device_type == "cpu":
            head = f"cpu, torch {self.torch_version}"
        else:
            head = (f"{self.device_name} (sm{self.sm}), CUDA {self.cuda_version or '?'}, "
                    f"cuDNN {self.cudnn_version or 'none'}, torch {self.torch_version}")
        pkgs = ", ".join(f"{p.name} {p.version}" for p in self.packages if p.installed)
        return head + (f"; {pkgs}" if pkgs else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "device_type": self.device_type, "device_name": self.device_name,
            "compute_capability": list(self.compute_capability) if self.compute_capability else None,
            "cuda_version": self.cuda_version, "cudnn_version": self.cudnn_version,
            "torch_version": self.torch_version, "torch_flash_sdpa": self.torch_flash_sdpa,
            "torch_cudnn_sdpa": self.torch_cudnn_sdpa, "triton": self.triton,
            "packages": {p.name: (p.version if p.installed else None) for p in self.packages},
            "package_errors": {p.name: p.error for p in self.packages if not p.installed},
        }

    # --- constructors -----------------------------------------------------------------------
    @staticmethod
    def detect() -> "Platform":
        """The live machine, probed once per process (see `refresh_detected`), with what this process learned
        about it while running (runtime_facts)."""
        facts = runtime_facts.current()
        known, platform = _LIVE
        if known is not facts:
            platform = replace(_detect_cached(), facts=facts)
            _LIVE[:] = [facts, platform]
        return platform

    @staticmethod
    def parse(spec: str) -> "Platform":
        return parse_platform(spec)

    @staticmethod
    def profile(name: str) -> "Platform":
        if name not in PROFILES:
            raise ValueError(f"platform profile {name!r} is unknown; known profiles: {', '.join(PROFILES)}")
        return PROFILES[name]


@functools.lru_cache(maxsize=512)
def parse_version(text: str | None) -> Version | None:
    if text is None:
        return None
    try:
        return Version(text)
    except InvalidVersion:
        # e.g. '2.11.0+cu130' parses, 'unknown' does not: treat as absent rather than guess
        return None


def cudnn_version_string(number: int) -> str:
    """torch.backends.cudnn.version() as text: 8907 -> '8.9.7', 91900 -> '9.19.0'."""
    if number >= 90000:
        return f"{number // 10000}.{number // 100 % 100}.{number % 100}"
    return f"{number // 1000}.{number // 100 % 10}.{number % 100}"


def _check_package_key(key: str) -> None:
    if key not in ENGINE_PACKAGES:
        raise ValueError(f"package {key!r} is unknown; known engine packages: {', '.join(ENGINE_PACKAGES)}")


def _probe_package(key: str) -> PackageStatus:
    distribution, module = ENGINE_PACKAGES[key]
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        version = None
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError) as exc:  # a parent package that fails to import
        return PackageStatus(key, None, f"import {module} fails: {exc}")
    if not found:
        return PackageStatus(key, None, f"not installed (no module {module!r}; pip install {distribution})")
    if key == "flash-attn" and version and Version(version).major >= 3:
        return PackageStatus(key, None, f"flash-attn {version} is not a 2.x release")
    if version is None:
        version = _module_version(module)
    return PackageStatus(key, version or "unknown")


def _module_version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", None)
    except Exception:  # noqa: BLE001 - a broken install reports as unknown version, the import check says why
        return None


@functools.lru_cache(maxsize=1)
def _detect_cached() -> Platform:
    import torch

    packages = tuple(_probe_package(key) for key in sorted(ENGINE_PACKAGES))
    torch_version = torch.__version__
    triton = importlib.util.find_spec("triton") is not None
    if not torch.cuda.is_available():
        return Platform(device_type="cpu", torch_version=torch_version, packages=packages, triton=triton, name="live")
    major, minor = torch.cuda.get_device_capability()
    cudnn_number = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    flash = bool(getattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)())
    return Platform(
        device_type="cuda",
        compute_capability=(major, minor),
        device_name=torch.cuda.get_device_name(),
        cuda_version=torch.version.cuda,
        cudnn_version=cudnn_version_string(cudnn_number) if cudnn_number else None,
        torch_version=torch_version,
        packages=packages,
        torch_flash_sdpa=flash,
        torch_cudnn_sdpa=cudnn_number is not None and cudnn_number >= 90000,
        triton=triton,
        name="live",
    )


def refresh_detected() -> Platform:
    """Probe again (after installing a package in a running process, say)."""
    _detect_cached.cache_clear()
    _LIVE[:] = [None, None]
    return Platform.detect()


def _gpu(name: str, cc: tuple[int, int], device_name: str, cuda: str, cudnn: str, torch_version: str,
         **packages: str) -> Platform:
    return Platform(
        device_type="cuda", compute_capability=cc, device_name=device_name, cuda_version=cuda,
        cudnn_version=cudnn, torch_version=torch_version,
        packages=tuple(PackageStatus(k.replace("_", "-"), v) for k, v in sorted(packages.items())),
        torch_flash_sdpa=cc >= (8, 0), torch_cudnn_sdpa=Version(cudnn).major >= 9, name=name,
    )


# Machines people ask about. h100-cudnn9 is the H100 of our device machine (../shared/device/README.md).
PROFILES: dict[str, Platform] = {
    "cpu": Platform(name="cpu"),
    "v100-cudnn8": _gpu("v100-cudnn8", (7, 0), "Tesla V100-SXM2-32GB", "12.1", "8.9.7", "2.1.2"),
    "a100-cudnn8": _gpu("a100-cudnn8", (8, 0), "NVIDIA A100-SXM4-80GB", "12.1", "8.9.7", "2.1.2",
                        flash_attn="2.4.2"),
    "a100-cudnn9": _gpu("a100-cudnn9", (8, 0), "NVIDIA A100-SXM4-80GB", "12.8", "9.10.2", "2.7.1",
                        flash_attn="2.7.4", cudnn_frontend="1.12.0"),
    "rtx4090-cudnn9": _gpu("rtx4090-cudnn9", (8, 9), "NVIDIA GeForce RTX 4090", "12.8", "9.10.2", "2.7.1",
                           flash_attn="2.7.4"),
    "h100-cudnn9": _gpu("h100-cudnn9", (9, 0), "NVIDIA H100 80GB HBM3", "13.0", "9.19.0", "2.11.0+cu130",
                        cudnn_frontend="1.32.0", flash_attn_4="4.0.0b36"),
    "h100-fa3": _gpu("h100-fa3", (9, 0), "NVIDIA H100 80GB HBM3", "12.8", "9.10.2", "2.7.1",
                     flash_attn="2.8.1", flash_attn_3="3.0.0b1", cudnn_frontend="1.12.0"),
    "h200-cudnn9": _gpu("h200-cudnn9", (9, 0), "NVIDIA H200", "13.0", "9.19.0", "2.11.0+cu130",
                        cudnn_frontend="1.32.0", flash_attn_4="4.0.0b36"),
    "b200-cudnn9": _gpu("b200-cudnn9", (10, 0), "NVIDIA B200", "13.0", "9.19.0", "2.11.0+cu130",
                        cudnn_frontend="1.32.0", flash_attn_4="4.0.0b36"),
}


def parse_platform(spec: str) -> Platform:
    """'h100-cudnn9', 'sm80,cudnn=8.9.7,flash-attn=2.4.2', 'a100-cudnn8,no-flash-attn', 'cpu', 'live'."""
    tokens = [t.strip() for t in spec.split(",") if t.strip()]
    if not tokens:
        raise ValueError("platform spec is empty; give a profile name "
                         f"({', '.join(PROFILES)}) or tokens such as 'sm80,cudnn=8.9.7,flash-attn=2.4.2'")
    base: Platform
    if tokens[0] == "live":
        base, tokens = Platform.detect(), tokens[1:]
    elif tokens[0] in PROFILES:
        base, tokens = PROFILES[tokens[0]], tokens[1:]
    else:
        base = Platform(device_type="cuda", compute_capability=(8, 0), device_name="GPU", cuda_version="12.8",
                        torch_version="2.11.0", name=spec)
    changes: dict[str, Any] = {"name": spec}
    packages = {p.name: p for p in base.packages}
    for token in tokens:
        key, _, value = token.partition("=")
        key = key.strip().lower()
        value = value.strip()
        if not value:
            if key == "cpu":
                changes.update(device_type="cpu", compute_capability=None, device_name="cpu", cuda_version=None,
                               cudnn_version=None, torch_flash_sdpa=False, torch_cudnn_sdpa=False)
            elif key.startswith("sm") and key[2:].isdigit() and len(key) >= 4:
                digits = key[2:]
                changes.update(device_type="cuda", compute_capability=(int(digits[:-1]), int(digits[-1])))
            elif key.startswith("no-") and key[3:] in ENGINE_PACKAGES:
                packages[key[3:]] = PackageStatus(key[3:], None, "not installed")
            elif key == "no-cudnn":
                changes.update(cudnn_version=None, torch_cudnn_sdpa=False)
            elif key == "no-triton":
                changes["triton"] = False
            else:
                raise ValueError(f"platform token {token!r} is not understood; expected a profile "
                                 f"({', '.join(PROFILES)}), 'cpu', 'smXY', 'no-<package>', 'no-cudnn', "
                                 "'no-triton' or key=value")
            continue
        if key in ENGINE_PACKAGES:
            _require_version(token, value)
            packages[key] = PackageStatus(key, value)
        elif key == "cudnn":
            _require_version(token, value)
            changes["cudnn_version"] = value
        elif key in ("cuda", "torch"):
            _require_version(token, value)
            changes[f"{key}_version"] = value
        elif key == "name":
            changes["device_name"] = value
        elif key in ("torch-flash", "torch-cudnn"):
            if value not in ("0", "1"):
                raise ValueError(f"platform token {token!r}: {key} takes 0 or 1")
            changes["torch_flash_sdpa" if key == "torch-flash" else "torch_cudnn_sdpa"] = value == "1"
        else:
            raise ValueError(f"platform key {key!r} in {token!r} is unknown; known keys: cudnn, cuda, torch, name, "
                             f"torch-flash, torch-cudnn, {', '.join(ENGINE_PACKAGES)}")
    platform = replace(base, packages=tuple(sorted(packages.values(), key=lambda p: p.name)), **changes)
    if platform.device_type == "cuda":
        implied = {}
        if "torch_flash_sdpa" not in changes:  # torch ships FA2 kernels for sm80 and newer
            implied["torch_flash_sdpa"] = platform.sm >= 80
        if "torch_cudnn_sdpa" not in changes:
            implied["torch_cudnn_sdpa"] = bool(platform.cudnn and platform.cudnn.major >= 9)
        platform = replace(platform, **implied)
    return platform


def _require_version(token: str, value: str) -> None:
    if parse_version(value) is None:
        raise ValueError(f"platform token {token!r}: {value!r} is not a version number")
