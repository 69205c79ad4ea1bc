"""The shipped profile's sources are named in benchmarks/results/profile/MANIFEST.json with their sha256: a renamed,
edited or missing source file is an error (never a silently different profile)."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import build_profile  # noqa: E402


def test_every_manifest_entry_names_its_machine_stack_and_date():
    manifest = json.loads(build_profile.MANIFEST.read_text())
    assert manifest["sources"]
    for source in manifest["sources"]:
        assert source["machine"].startswith("NVIDIA") and source["date"][:4] == "2026" and source["stack"]["torch"]
        assert len(source["sha256"]) == 64


@pytest.fixture
def copied(tmp_path, monkeypatch):
    manifest = json.loads(build_profile.MANIFEST.read_text())
    first = manifest["sources"][0]["file"]
    shutil.copy(build_profile.RESULTS / first, tmp_path / first)
    (tmp_path / "MANIFEST.json").write_text(json.dumps({**manifest, "sources": manifest["sources"][:1]}))
    monkeypatch.setattr(build_profile, "RESULTS", tmp_path)
    monkeypatch.setattr(build_profile, "MANIFEST", tmp_path / "MANIFEST.json")
    return tmp_path / first


def test_a_source_read_as_recorded_is_used(copied):
    assert build_profile.shipped_sources() == [str(copied)]


def test_an_edited_source_is_refused(copied):
    copied.write_bytes(copied.read_bytes() + b" ")
    with pytest.raises(ValueError, match=f"{copied.name} has sha256"):
        build_profile.shipped_sources()


def test_a_missing_source_is_refused(copied):
    copied.rename(copied.with_name("renamed.json.gz"))
    with pytest.raises(FileNotFoundError, match=copied.name):
        build_profile.shipped_sources()
