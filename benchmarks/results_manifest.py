"""benchmarks/results/manifest.json: every committed result file, its sha256, the machine, software stack and date it
was measured on, and its role. build_profile.py builds the shipped profile from the `profile-source` entries alone,
so a renamed, edited or missing file is an error, never a silently different profile.

    python3 benchmarks/results_manifest.py check                                   # hashes; no file left unlisted
    python3 benchmarks/results_manifest.py add results/kv/kv_h200.json --role evidence --what "KV decode, H200"

`add` reads the machine, stack and date from the file's own record (a bench_user_step.py `environment`, a `meta`
or `machine` block); where a script records none of them, pass --machine, --stack KEY=VERSION and --date.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attn_dispatch.benchmarking.results import read_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MANIFEST = RESULTS / "manifest.json"
ROLES = {
    "profile-source": "bench_user_step.py runs the shipped profile (attn_dispatch/policy/profiles/sm90.json) is built "
                      "from, and bench_masks.py runs that rank the providers of calls with modifiers (its masked "
                      "entries): build_profile.py --shipped reads exactly these",
    "held-out": "bench_user_step.py runs of grids drawn and committed before they were measured, timed with the "
                "profile of their day: what the README's accuracy numbers are computed from (evaluate_profile.py, "
                "static_bound.py)",
    "packed-fit": "bench_user_step.py runs of held-out packed grids once scored blind (the README keeps those "
                  "scores), fit data from then on: build_profile.py --shipped makes the profile's packed entries of "
                  "them (what a provider without a rate is predicted relative to on a packed call), and "
                  "fit_packed.py fits the machine varlen factors on the full-stack ones",
    "evidence": "a measurement the README, the user guide or a cited constraint quotes",
}
NOT_RESULTS = frozenset({"README.md", "manifest.json"})
STACK_KEYS = ("torch", "cudnn", "cudnn_frontend", "flash_attn_4")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load(manifest: Path = MANIFEST) -> dict:
    data = json.loads(manifest.read_text())
    for entry in data["files"]:
        if entry.get("role") not in ROLES:
            raise ValueError(f"{manifest.name}: {entry.get('file')} has role {entry.get('role')!r}; "
                             f"expected one of {sorted(ROLES)}")
    return data


def entries(role: str | None = None, manifest: Path = MANIFEST) -> list[dict]:
    """The manifest's entries (of one role, if given), in the manifest's order."""
    if role is not None and role not in ROLES:
        raise ValueError(f"role={role!r}; expected one of {sorted(ROLES)}")
    return [e for e in load(manifest)["files"] if role is None or e["role"] == role]


def verified_path(entry: dict, manifest: Path = MANIFEST) -> Path:
    """The entry's file (relative to the manifest's folder), after checking it is there with the recorded bytes."""
    path = manifest.parent / entry["file"]
    if not path.is_file():
        raise FileNotFoundError(f"{manifest.name} names {entry['file']}, which is not in {manifest.parent}")
    digest = sha256(path)
    if digest != entry["sha256"]:
        raise ValueError(f"{entry['file']} has sha256 {digest}, not the {entry['sha256']} {manifest.name} records: "
                         "restore the file, or record it again (and rebuild the profile if it is a source)")
    return path


def unlisted(manifest: Path = MANIFEST) -> list[str]:
    """Files under the manifest's folder that no entry names (README.md and the manifest itself aside)."""
    listed = {e["file"] for e in load(manifest)["files"]}
    found = (p.relative_to(manifest.parent).as_posix() for p in manifest.parent.rglob("*") if p.is_file())
    return sorted(f for f in found if f not in listed and f not in NOT_RESULTS)


def recorded_environment(path: Path) -> dict:
    """machine, stack and date as the result file records them (bench_user_step.py's `environment`; the `meta` or
    `machine` block other scripts write), plus the grid for bench_user_step.py runs. Missing fields are left out."""
    data = read_results(path)
    if not isinstance(data, dict):
        return {}
    env = next((data[k] for k in ("environment", "meta", "machine") if isinstance(data.get(k), dict)), {})
    found: dict = {}
    machine = env.get("device") or env.get("machine") or env.get("gpu") or data.get("device")
    if machine:
        found["machine"] = machine
    stack = {k: env.get(k, data.get(k)) for k in STACK_KEYS if env.get(k, data.get(k)) is not None}
    if stack:
        found["stack"] = stack
    date = DATE.search(str(env.get("date") or data.get("date") or ""))
    if date:
        found["date"] = date.group(0)
    if "rows" in data and "grid" in data:
        found["grid"] = data["grid"]
    return found


def entry_for(path: Path, role: str, what: str, manifest: Path = MANIFEST, **given) -> dict:
    """A manifest entry for one result file: its recorded environment, overridden by what is given."""
    if role not in ROLES:
        raise ValueError(f"role={role!r}; expected one of {sorted(ROLES)}")
    found = {**recorded_environment(path), **{k: v for k, v in given.items() if v}}
    missing = [k for k in ("machine", "stack", "date") if not found.get(k)]
    if missing:
        raise ValueError(f"{path}: the file records no {', '.join(missing)}; pass them (--machine, --stack, --date)")
    if not path.resolve().is_relative_to(manifest.parent.resolve()):
        raise ValueError(f"{path} is not under {manifest.parent}: result files live there, beside the manifest")
    return {"file": path.resolve().relative_to(manifest.parent.resolve()).as_posix(), "sha256": sha256(path),
            "role": role, "what": what, **found}


def record(new: list[dict], manifest: Path = MANIFEST, *, replace_role: str | None = None) -> None:
    """Write the manifest with these entries added (an entry for the same file is replaced); with replace_role,
    that role's entries are exactly the new ones."""
    data = load(manifest) if manifest.exists() else {"what": "", "roles": ROLES, "files": []}
    names = {e["file"] for e in new}
    kept = [e for e in data["files"] if e["file"] not in names and e["role"] != replace_role]
    data["files"] = sorted(kept + new, key=lambda e: (list(ROLES).index(e["role"]), e["file"]))
    data["roles"] = ROLES
    manifest.write_text(json.dumps(data, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="every entry's sha256, and every file under results/ listed")
    add = sub.add_parser("add", help="record result files (their sha256 and recorded environment)")
    add.add_argument("files", nargs="+")
    add.add_argument("--role", required=True, choices=sorted(ROLES))
    add.add_argument("--what", required=True, help="one line: what the file shows")
    add.add_argument("--machine")
    add.add_argument("--stack", action="append", default=[], metavar="KEY=VERSION")
    add.add_argument("--date", help="YYYY-MM-DD")
    args = ap.parse_args(argv)
    if args.command == "check":
        problems = []
        for entry in entries():
            try:
                verified_path(entry)
            except (FileNotFoundError, ValueError) as err:
                problems.append(str(err))
        problems += [f"{f} is not in {MANIFEST.name}: record it (add) or remove it" for f in unlisted()]
        print("\n".join(problems) or f"{len(entries())} files, every sha256 as recorded, none unlisted")
        return 1 if problems else 0
    stack = {}
    for item in args.stack:
        key, _, value = item.partition("=")
        if not value:
            ap.error(f"--stack {item!r}: expected KEY=VERSION (e.g. torch=2.11.0+cu130)")
        stack[key] = value
    if args.date and not DATE.fullmatch(args.date):
        ap.error(f"--date {args.date!r}: expected YYYY-MM-DD")
    record([entry_for(Path(f), args.role, args.what, machine=args.machine, stack=stack, date=args.date)
            for f in args.files])
    return 0


if __name__ == "__main__":
    sys.exit(main())
