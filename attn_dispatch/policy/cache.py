"""The measured policy's persistent cache: one JSON file per platform fingerprint.

Where: $ATTN_DISPATCH_CACHE_DIR, else $XDG_CACHE_HOME/attn-dispatch, else ~/.cache/attn-dispatch.
The fingerprint covers the device (name, compute capability), CUDA, cuDNN and torch versions, torch's SDPA
kernels, every engine package's version, attn-dispatch's own version (our engine code) and the file format:
change any of them and the timings start afresh in another file.

Concurrent processes: a writer holds an exclusive fcntl.flock on a side lock file while it re-reads, merges
and writes (so no entry is lost), and writes through a temporary file + os.replace (so no reader ever sees
half a file). A corrupt file is moved aside with a warning and rebuilt; it never stops a run.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterator

try:
    import fcntl
except ImportError:  # Windows: atomic replace still holds; concurrent writers may drop each other's entries
    fcntl = None  # type: ignore[assignment]

from ..platform import Platform
from .._version import __version__

FORMAT = 1
logger = logging.getLogger("attn_dispatch.policy")


class CorruptCacheWarning(UserWarning):
    """The cache file could not be read; it was moved aside and will be rebuilt."""


def cache_dir() -> Path:
    explicit = os.environ.get("ATTN_DISPATCH_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "attn-dispatch"


def platform_key(platform: Platform) -> dict[str, Any]:
    """What the timings depend on besides the shape: the machine, its libraries, the engines' versions."""
    return {
        "format": FORMAT,
        "attn_dispatch": __version__,
        "device_type": platform.device_type,
        "device_name": platform.device_name,
        "compute_capability": list(platform.compute_capability) if platform.compute_capability else None,
        "cuda": platform.cuda_version,
        "cudnn": platform.cudnn_version,
        "torch": platform.torch_version,
        "torch_flash_sdpa": platform.torch_flash_sdpa,
        "torch_cudnn_sdpa": platform.torch_cudnn_sdpa,
        "packages": {p.name: p.version for p in sorted(platform.packages, key=lambda p: p.name) if p.installed},
    }


def fingerprint(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


class TuningCache:
    """Entries (bucket key -> JSON object) for one platform, shared through a file by every process."""

    def __init__(self, platform: Platform, directory: str | os.PathLike | None = None):
        self.key = platform_key(platform)
        self.directory = Path(directory) if directory is not None else cache_dir()
        self.path = self.directory / f"measured-{fingerprint(self.key)}.json"
        self._lock_path = self.path.with_name(self.path.name + ".lock")
        self._entries: dict[str, dict] | None = None
        self._write_failed = False

    # --- reading -------------------------------------------------------------------------------------
    def get(self, bucket: str) -> dict | None:
        """The entry, reading the file again on a miss (another process may have tuned it since)."""
        if self._entries is not None and bucket in self._entries:
            return self._entries[bucket]
        self._entries = self._load()
        return self._entries.get(bucket)

    def entries(self) -> dict[str, dict]:
        self._entries = self._load()
        return dict(self._entries)

    def _load(self) -> dict[str, dict]:
        try:
            return self._parse(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            try:
                with self._locked():  # a writer may be replacing it right now: look again under the lock
                    return self._load_locked()
            except OSError as exc:
                self._warn_unwritable(exc)
                return {}

    def _parse(self, text: str) -> dict[str, dict]:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
            raise ValueError(f"not a format-{FORMAT} measured-policy cache")
        if data.get("platform") != self.key:
            raise ValueError("its platform key does not match the file name's fingerprint")
        entries = data["entries"]
        bad = [k for k, v in entries.items() if not isinstance(v, dict) or not isinstance(v.get("times_ms"), dict)]
        if bad:
            raise ValueError(f"malformed entry {bad[0]!r}")
        return entries

    def _move_aside(self, exc: Exception) -> None:
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        try:
            os.replace(self.path, aside)
            where = f"moved to {aside}"
        except OSError as move_exc:
            where = f"could not be moved aside ({move_exc}); it will be overwritten"
        warnings.warn(f"attn-dispatch measured-policy cache {self.path} is unreadable ({exc}); {where}. "
                      "Tuning starts afresh for this platform.", CorruptCacheWarning, stacklevel=4)

    # --- writing -------------------------------------------------------------------------------------
    def put(self, bucket: str, entry: dict) -> None:
        self.update({bucket: entry})

    def update(self, new_entries: dict[str, dict]) -> None:
        """Merge entries into the file (read-modify-write under the lock). On an unwritable cache directory the
        entries stay in memory for this process, with one warning."""
        merged = dict(self._entries or {})
        merged.update(new_entries)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with self._locked():
                on_disk = self._load_locked()
                on_disk.update(new_entries)
                self._write(on_disk)
                merged = on_disk
        except OSError as exc:
            self._warn_unwritable(exc)
        self._entries = merged

    def _warn_unwritable(self, exc: OSError) -> None:
        if not self._write_failed:
            self._write_failed = True
            logger.warning("attn-dispatch cannot use its measured-policy cache %s (%s); tuning results last only "
                           "for this process. Set ATTN_DISPATCH_CACHE_DIR to a writable directory.", self.path, exc)

    def clear(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            with self._locked():
                self.path.unlink()
        self._entries = {}

    def _load_locked(self) -> dict[str, dict]:
        try:
            return self._parse(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            self._move_aside(exc)
            return {}

    def _write(self, entries: dict[str, dict]) -> None:
        payload = {"format": FORMAT, "platform": self.key, "entries": entries}
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(payload, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if fcntl is None:
            yield
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self._lock_path, "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
