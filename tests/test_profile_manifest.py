"""benchmarks/results/manifest.json names every committed result file with its sha256, machine, stack and date;
build_profile.py builds the shipped profile from its profile-source entries alone, refusing a renamed, edited or
missing source (never a silently different profile), and the shipped command rebuilds the shipped file exactly."""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import build_profile  # noqa: E402
import results_manifest  # noqa: E402
from attn_dispatch.benchmarking.results import read_results  # noqa: E402
from attn_dispatch.policy.profile import PROFILE_DIR  # noqa: E402


def test_every_result_file_is_listed_with_the_bytes_it_was_recorded_with(capsys):
    assert results_manifest.main(["check"]) == 0, capsys.readouterr().out
    assert results_manifest.unlisted() == []


def test_every_entry_names_its_machine_stack_date_and_what_it_shows():
    entries = results_manifest.entries()
    assert {e["role"] for e in entries} == set(results_manifest.ROLES)
    for e in entries:
        assert re.match(r"(\dx )?NVIDIA ", e["machine"]), e
        assert re.fullmatch(r"20\d\d-\d\d-\d\d", e["date"]) and e["stack"]["torch"] and e["what"], e
        assert re.fullmatch(r"[0-9a-f]{64}", e["sha256"]), e


def test_every_benchmark_run_entry_names_the_grid_its_file_records():
    for e in results_manifest.entries():
        if e["role"] == "evidence":
            continue
        data = read_results(results_manifest.RESULTS / e["file"])
        if "calls" in data:  # a bench_masks.py run (a profile source of masked calls): it has no grid
            assert e["role"] == "profile-source" and "grid" not in e, e["file"]
        else:
            assert e["grid"] == data["grid"], e["file"]


def test_the_shipped_profile_holds_the_masked_calls_of_its_bench_masks_sources():
    masked = build_profile.shipped_sources(masked=True)
    assert masked and all("masks/" in p for p in masked)
    shipped = json.loads((PROFILE_DIR / "sm90.json").read_text())
    runs, _ = build_profile.load_masked_runs(masked)
    machines = {run["machine"] for run in runs}
    assert {shipped["machines"][e["machine"]] for e in shipped["masked"]} == machines
    assert all(e["modifiers"] and e["times_ms"] for e in shipped["masked"])


def test_the_shipped_command_rebuilds_the_shipped_profile_byte_for_byte(tmp_path, capsys):
    out = tmp_path / "sm90.json"
    assert build_profile.main(["--shipped", "--out", str(out)]) == 0
    assert out.read_bytes() == (PROFILE_DIR / "sm90.json").read_bytes(), (
        "the shipped profile is not what its manifest's sources build: run benchmarks/build_profile.py --shipped")
    assert f"from {len(results_manifest.entries('profile-source'))} runs" in capsys.readouterr().out


@pytest.fixture
def one_source(tmp_path) -> tuple[Path, Path]:
    """A manifest in tmp_path naming one real source file (a bench_user_step.py run), copied beside it."""
    entry = next(e for e in results_manifest.entries("profile-source") if "grid" in e)
    copy = tmp_path / entry["file"]
    copy.parent.mkdir(parents=True)
    shutil.copy(results_manifest.RESULTS / entry["file"], copy)
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"files": [entry]}))
    return manifest, copy


def test_a_source_read_as_recorded_is_used(one_source):
    manifest, copy = one_source
    assert build_profile.shipped_sources(manifest) == [str(copy)]


def test_an_edited_source_is_refused(one_source):
    manifest, copy = one_source
    copy.write_bytes(copy.read_bytes() + b" ")
    with pytest.raises(ValueError, match=f"{copy.name} has sha256"):
        build_profile.shipped_sources(manifest)


def test_a_renamed_source_is_refused_and_the_new_name_is_found_unlisted(one_source):
    manifest, copy = one_source
    copy.rename(copy.with_name("renamed.json.gz"))
    with pytest.raises(FileNotFoundError, match=copy.name):
        build_profile.shipped_sources(manifest)
    assert results_manifest.unlisted(manifest) == [f"{copy.parent.name}/renamed.json.gz"]


def test_recording_sources_takes_machine_stack_date_and_grid_from_each_run_and_keeps_other_roles(tmp_path):
    env = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-12-01T10:00:00+00:00", "torch": "2.13.0",
           "cudnn": 91900, "cudnn_frontend": "absent", "flash_attn_4": "absent", "python": "3.12"}
    run = tmp_path / "profile" / "fit_h100.json"
    run.parent.mkdir()
    run.write_text(json.dumps({"grid": "fit", "environment": env, "rows": []}))
    evidence = {"file": "kv.json", "sha256": "0" * 64, "role": "evidence", "what": "w", "machine": "NVIDIA H200",
                "stack": {"torch": "2.11"}, "date": "2026-11-24"}
    stale = {**evidence, "file": "profile/old.json", "role": "profile-source"}
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"what": "", "files": [evidence, stale]}))

    build_profile.write_manifest([str(run)], manifest)
    sources = results_manifest.entries("profile-source", manifest)
    assert [(e["file"], e["machine"], e["date"], e["grid"]) for e in sources] == [
        ("profile/fit_h100.json", "NVIDIA H100 80GB HBM3", "2026-12-01", "fit")]
    assert sources[0]["stack"] == {"torch": "2.13.0", "cudnn": 91900, "cudnn_frontend": "absent",
                                   "flash_attn_4": "absent"}
    assert results_manifest.entries("evidence", manifest) == [evidence]
    assert build_profile.shipped_sources(manifest) == [str(run)]


def test_a_file_that_records_no_machine_stack_or_date_needs_them_given(tmp_path):
    path = tmp_path / "survey.json"
    path.write_text(json.dumps([{"phase": "fwd", "plans": 3}]))
    with pytest.raises(ValueError, match="records no machine, stack, date"):
        results_manifest.entry_for(path, "evidence", "a survey", tmp_path / "manifest.json")
    entry = results_manifest.entry_for(path, "evidence", "a survey", tmp_path / "manifest.json",
                                       machine="NVIDIA H100 80GB HBM3", stack={"torch": "2.11"}, date="2026-11-24")
    assert entry["file"] == "survey.json" and entry["machine"] == "NVIDIA H100 80GB HBM3"


def test_an_unknown_role_is_refused_with_the_roles_allowed(tmp_path):
    with pytest.raises(ValueError, match="role='source'; expected one of"):
        results_manifest.entries("source")
    with pytest.raises(ValueError, match="role='x'"):
        results_manifest.entry_for(tmp_path / "a.json", "x", "w")
