"""Issues #14 and #30 (and #28's incomplete installs): the patcher used the way a
hostile user, a bad day or a hardened server would, on real vLLM trees.  Each test
names the item it covers."""

import hashlib
import json
import os
import py_compile
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ddtree_patcher import engine
from ddtree_patcher.errors import CODES, PatchError
from ddtree_patcher.target import find_target, record_mismatches
from wheels import upgrade_in_place

RUNNER = "vllm/v1/worker/gpu_model_runner.py"
ALGOS = "vllm/transformers_utils/configs/speculators/algos.py"
ONLY = ("--only", "dflash-layer-offset")
NV = "--no-verify"


def sp(site):
    return ("--site-packages", site)


def hashes(site):
    return {str(p.relative_to(site)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(site.rglob("*")) if p.is_file()}


def failed(r, code):
    """A documented exit code, a next: line, no traceback."""
    assert r.code == code, r
    assert code in CODES and "next: " in r.err and "Traceback" not in r.err + r.out, r


def points(cli, site, tmp_path, *args):
    log = tmp_path / "points.log"
    log.unlink(missing_ok=True)
    cli(*args, *sp(site), env={"DDTREE_PATCH_FAULT_LOG": str(log)}, check=0)
    return [line.split(" ", 1)[1] for line in log.read_text().splitlines()]


def state_files(state_dir):
    return sorted(p.name for p in state_dir.rglob("*") if p.is_file()) \
        if state_dir.exists() else []


# ------------------------------------------------- 1. state bound to the exact install


def test_upgraded_install_never_gets_the_old_files(tree, cli):
    """0.20.2 patched, then upgraded in place to 0.33.0 (what pip does): revert --force,
    revert, apply and --dry-run refuse and write nothing; status says why and what to
    do; forget leaves exactly the pristine 0.33.0 release."""
    site = tree("vllm", "0.20.2", slim=True)
    cli("apply", NV, *sp(site), check=0)
    upgrade_in_place(site, "vllm", "0.33.0", slim=True)
    before = hashes(site)
    for args in (("revert", "--force"), ("revert",), ("apply", NV), ("apply", "--dry-run")):
        r = cli(*args, *sp(site))
        failed(r, 4)
        assert "belongs to vllm 0.20.2" in r.err and "`ddtree-patch forget`" in r.err
    assert hashes(site) == before
    st = cli("status", "--json", *sp(site), check=4).json
    assert st["status"] == "stale-state" and "forget" in st["next"]
    assert "version: saved 0.20.2, now 0.33.0" in st["details"]
    out = cli("forget", "--json", *sp(site), check=0).json
    assert "vllm/v1/spec_decode/ddtree/v1/proposer.py" in out["removed"]
    assert hashes(site) == hashes(tree("vllm", "0.33.0", slim=True))
    assert record_mismatches(find_target(site_packages=str(site))) == []
    cli("apply", NV, *sp(site), check=0)  # a fresh start on 0.33.0


def test_recover_after_a_crash_then_upgrade_writes_nothing(tree, cli):
    site = tree("vllm", "0.20.2", slim=True)
    cli("apply", *ONLY, NV, *sp(site), env={"DDTREE_PATCH_FAULT": "crash-after:1"},
        check=70)
    upgrade_in_place(site, "vllm", "0.33.0", slim=True)
    before = hashes(site)
    failed(cli("recover", *sp(site)), 4)
    assert cli("recover", "--json", *sp(site), check=4).json["error"]["hint"]
    assert hashes(site) == before
    cli("forget", *sp(site), check=0)
    assert hashes(site) == hashes(tree("vllm", "0.33.0", slim=True))


def test_a_changed_record_unbinds_the_state(tree, cli):
    """Same version, but RECORD is not the one the state was taken with (reinstalled by
    another installer): refuse rather than guess."""
    site = tree("vllm", "0.20.2", slim=True)
    cli("apply", *ONLY, NV, *sp(site), check=0)
    record = next(site.glob("*.dist-info")) / "RECORD"
    record.write_text("".join(reversed(record.read_text().splitlines(True))))
    before = hashes(site)
    r = cli("revert", "--json", "--force", *sp(site), check=4)
    assert any("record_sha256" in d for d in r.json["error"]["details"])
    assert hashes(site) == before


def test_forget_refuses_state_that_still_belongs(tree, cli):
    site = tree("vllm", "0.20.2", slim=True)
    cli("apply", *ONLY, NV, *sp(site), check=0)
    failed(cli("forget", *sp(site)), 2)
    assert cli("status", "--json", *sp(site), check=0).json["status"] == "patched"


# ------------------------------------------------- 2. recover restores only its own writes


def test_recover_leaves_later_edits_alone(tree, cli, pristine):
    site = tree("vllm", "0.20.2", slim=True)
    cli("apply", *ONLY, NV, *sp(site), env={"DDTREE_PATCH_FAULT": "crash-after:1"},
        check=70)  # wrote ALGOS, not RUNNER
    runner = site / RUNNER
    runner.write_text(runner.read_text() + "\n# a hand edit after the crash\n")
    r = cli("recover", "--json", *sp(site), check=4)
    assert [d["path"] for d in r.json["error"]["details"]] == [RUNNER]
    assert "# a hand edit after the crash" in runner.read_text()
    assert (site / ALGOS).read_bytes() == (pristine("vllm", "0.20.2") / ALGOS).read_bytes()
    st = cli("status", "--json", *sp(site), check=4).json
    assert st["status"] == "drifted" and not st["interrupted"]


# ------------------------------------------------- 3. temp files, added folders, RECORD


def test_kill_inside_a_write_leaves_nothing_after_recover(tree, cli, tmp_path):
    site = tree("vllm", "0.20.2", slim=True)
    for _ in range(2):  # the second run counts: the first also removes stale bytecode
        labels = points(cli, site, tmp_path, "apply", NV, "--only", "ddtree-proposer")
        cli("revert", *sp(site), check=0)
    t = find_target(site_packages=str(site))
    for want in (f"temp written {site}/vllm/", f"mkdir {site}/vllm/v1/spec_decode/ddtree"):
        n = next(i for i, lab in enumerate(labels, 1) if lab.startswith(want))
        r = cli("apply", NV, "--only", "ddtree-proposer", *sp(site),
                env={"DDTREE_PATCH_FAULT": f"kill-at:{n}"})
        assert r.code == -signal.SIGKILL
        left = {d["path"] for d in record_mismatches(t)}
        if want.startswith("temp"):
            assert any(p.endswith(".ddtree-tmp") for p in left), left
        else:
            assert "vllm/v1/spec_decode/ddtree/" in left, left
        st = cli("status", "--json", *sp(site), check=4).json
        assert st["status"] == "interrupted" and "recover" in st["next"]
        cli("recover", *sp(site), check=0)
        assert record_mismatches(t) == []
        assert not list(site.rglob("*.ddtree-tmp"))
        assert not (site / "vllm/v1/spec_decode/ddtree").exists()


def test_record_check_reports_unlisted_files_and_folders(tree, cli):
    site = tree("vllm", "0.20.2", slim=True)
    cli("apply", *ONLY, NV, *sp(site), check=0)
    (site / "vllm/v1/.x.py.1234.ddtree-tmp").write_text("x")
    (site / "vllm/v1/left_behind").mkdir()
    r = cli("revert", "--json", *sp(site), check=4)
    problems = {d["path"]: d["problem"] for d in r.json["error"]["details"]}
    assert problems == {"vllm/v1/.x.py.1234.ddtree-tmp": "not listed in RECORD",
                        "vllm/v1/left_behind/": "empty folder RECORD does not know"}


# ------------------------------------------------- 4. failures, never tracebacks


def _fake_tree(root, version="0.19.1"):
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    di = root / f"vllm-{version}.dist-info"
    di.mkdir()
    (di / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (di / "RECORD").write_text("")
    return root


def _patched(tree, cli):
    site = tree("vllm", "0.20.2", slim=True)
    cli("apply", *ONLY, NV, *sp(site), check=0)
    return site


def _state(site):
    return find_target(site_packages=str(site)).key


CASES = {
    # name: setup(tmp_path, tree, cli, state_dir) -> (args, env, exit code)
    "state dir is a file": lambda tmp, tree, cli, sd: (
        ("apply", NV, *ONLY, *sp(tree("vllm", "0.20.2", slim=True))),
        {"DDTREE_PATCH_STATE_DIR": str(_touch(tmp / "a-file"))}, 3),
    "state dir not writable": lambda tmp, tree, cli, sd: (
        ("apply", NV, *ONLY, *sp(tree("vllm", "0.20.2", slim=True))),
        {"DDTREE_PATCH_STATE_DIR": str(_readonly(tmp / "ro") / "state")}, 3),
    "HOME missing": lambda tmp, tree, cli, sd: (
        ("apply", NV, *ONLY, *sp(tree("vllm", "0.20.2", slim=True))),
        {"DDTREE_PATCH_STATE_DIR": None, "XDG_STATE_HOME": None,
         "HOME": str(tmp / "no-such-home")}, 3),
    "--python /bin/true": lambda tmp, tree, cli, sd: (("status", "--python", "/bin/true"),
                                                       {}, 2),
    "--python /bin/echo": lambda tmp, tree, cli, sd: (("status", "--python", "/bin/echo"),
                                                       {}, 2),
    "--python a folder": lambda tmp, tree, cli, sd: (("status", "--python", str(tmp)), {}, 2),
    "--python not executable": lambda tmp, tree, cli, sd: (
        ("status", "--python", str(_touch(tmp / "python"))), {}, 2),
    "--site-packages ''": lambda tmp, tree, cli, sd: (("status", "--site-packages", ""), {}, 2),
    "RECORD deleted": lambda tmp, tree, cli, sd: (
        ("revert", *sp(_lose_record(_patched(tree, cli)))), {}, 3),
    "RECORD not UTF-8": lambda tmp, tree, cli, sd: (
        ("revert", *sp(_spoil_record(_patched(tree, cli)))), {}, 3),
    "manifest.json corrupt": lambda tmp, tree, cli, sd: (
        ("revert", *sp(_spoil(_patched(tree, cli), sd, "manifest.json", b"{not json"))), {},
        4),
    "manifest.json wrong shape": lambda tmp, tree, cli, sd: (
        ("apply", NV, *sp(_spoil(_patched(tree, cli), sd, "manifest.json",
                                 b'{"schema": 2, "applied": "all"}'))), {}, 4),
    "journal.json empty": lambda tmp, tree, cli, sd: (
        ("recover", *sp(_spoil(_patched(tree, cli), sd, "journal/journal.json", b""))), {},
        4),
    "RECORD with a NUL byte": lambda tmp, tree, cli, sd: (
        ("revert", *sp(_record_row(_patched(tree, cli), b"vllm/x\x00.py,,\n"))), {}, 3),
    "RECORD with an unknown hash": lambda tmp, tree, cli, sd: (
        ("revert", *sp(_record_row(_patched(tree, cli), b"vllm/envs.py,md7=abc,12\n"))),
        {}, 3),
    "RECORD row without a path": lambda tmp, tree, cli, sd: (
        ("revert", *sp(_record_row(_patched(tree, cli), b",sha256=abc,12\n"))), {}, 3),
    "RECORD size not a number": lambda tmp, tree, cli, sd: (
        ("revert", *sp(_record_row(_patched(tree, cli), b"vllm/envs.py,,twelve\n"))), {},
        3),
    "status on an unsupported version": lambda tmp, tree, cli, sd: (
        ("status", *sp(_fake_tree(tmp / "old"))), {}, 2),
    "--only X --skip X": lambda tmp, tree, cli, sd: (
        ("apply", *ONLY, "--skip", "dflash-layer-offset"), {}, 2),
    "--skip what another needs": lambda tmp, tree, cli, sd: (
        ("apply", "--skip", "ddtree-proposer", *sp(tree("vllm", "0.20.2", slim=True))), {},
        2),
    "usage: unknown option": lambda tmp, tree, cli, sd: (("apply", "--bogus"), {}, 2),
    "usage: missing value": lambda tmp, tree, cli, sd: (("status", "--python"), {}, 2),
    "usage: unknown command": lambda tmp, tree, cli, sd: (("frobnicate",), {}, 2),
}


def _touch(p, data=b"#!/bin/false\n"):
    p.write_bytes(data)
    p.chmod(0o644)
    return p


def _readonly(d):
    d.mkdir()
    d.chmod(0o555)
    return d


def _lose_record(site):
    (next(site.glob("*.dist-info")) / "RECORD").unlink()
    return site


def _spoil_record(site):
    record = next(site.glob("*.dist-info")) / "RECORD"
    record.write_bytes(record.read_bytes() + b"vllm/\xff\xfe.py,,\n")
    return site


def _spoil(site, state_dir, rel, data):
    p = state_dir / _state(site) / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return site


@pytest.mark.parametrize("name", list(CASES))
def test_failure_paths_exit_documented_with_next_and_json(name, tmp_path, tree, cli,
                                                          state_dir):
    args, env, code = CASES[name](tmp_path, tree, cli, state_dir)
    before = {p: hashes(p) for p in tmp_path.glob("site*")}
    try:
        failed(cli(*args, env=env), code)
        j = cli(args[0], "--json", *args[1:], env=env, check=code).json
    finally:
        if (tmp_path / "ro").exists():
            (tmp_path / "ro").chmod(0o755)
    assert j["exit_code"] == code and not j["ok"] and j["error"]["hint"], j
    assert {p: hashes(p) for p in tmp_path.glob("site*")} == before  # nothing written


def test_record_lost_during_revert(tree, monkeypatch):
    """RECORD vanishes after the files were restored: a clear error, not a traceback."""
    site = tree("vllm", "0.20.2", slim=True)
    t = find_target(site_packages=str(site))
    engine.apply(t, ["dflash-layer-offset"], verify=None)
    real = engine.execute

    def execute_then_lose_record(*a, **k):
        out = real(*a, **k)
        (t.dist_info / "RECORD").unlink()
        return out

    monkeypatch.setattr(engine, "execute", execute_then_lose_record)
    with pytest.raises(PatchError) as err:
        engine.revert(t)
    assert err.value.code == 3 and "2 files restored, but" in err.value.message
    assert "--force-reinstall" in err.value.hint


def _full_disk_env(limit):
    def pre():  # writes beyond `limit` bytes fail (EFBIG) instead of killing us
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return pre


def test_state_writes_failing_roll_back(tree, cli, state_dir):
    """Every write of the run fails past 64 KiB (the backup of the model runner does):
    exit 7, nothing in vLLM changed, nothing left in the state folder."""
    site = tree("vllm", "0.20.2", slim=True)
    before = hashes(site)
    r = cli("apply", *ONLY, NV, *sp(site), preexec_fn=_full_disk_env(64 << 10))
    failed(r, 7)
    assert "rolled back" in r.err
    assert hashes(site) == before and state_files(state_dir) == []


def test_state_dir_on_a_full_disk(tree, cli, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        site = tree("vllm", "0.20.2", slim=True)
        before = hashes(site)
        env = {"DDTREE_PATCH_STATE_DIR": str(mnt / "state")}
        r = cli("apply", "--json", *ONLY, NV, *sp(site), env=env, check=7)
        assert "No space left" in r.json["error"]["message"] and r.json["error"]["hint"]
        assert hashes(site) == before and state_files(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)])


# ------------------------------------------------- 6. auto-revert keeps earlier transforms


def test_auto_revert_keeps_what_was_applied_before(tree, cli, state_dir):
    site = tree("vllm", "0.20.2", slim=True)
    cli("apply", *ONLY, *sp(site), check=0)  # verify --quick passes
    envs = site / "vllm" / "envs.py"  # a vLLM file no transform touches: verify fails
    envs.write_text(envs.read_text() + "\n# breaks verify's RECORD check\n")
    r = cli("apply", "--json", "--only", "dflash-swa", *sp(site), check=8)
    assert "what was applied before stays: dflash-layer-offset" in r.json["error"]["message"]
    st = cli("status", "--json", *sp(site)).json
    rows = {row["transform"]: row["status"] for row in st["transforms"]}
    assert rows["dflash-layer-offset"] == "patched" and rows["dflash-swa"] == "clean"
    assert st["applied"] == ["dflash-layer-offset"]
    backups = {str(p).split("/backups/")[1] for p in state_dir.rglob("*")
               if p.is_file() and "/backups/" in str(p)}
    assert backups == {ALGOS, RUNNER}  # dflash-swa's backups went with it


# ------------------------------------------------- 7. skipped is not passed


def test_apply_says_what_verify_did_not_check(tree, cli):
    site = tree("vllm", "0.20.2", slim=True)
    out = cli("apply", *ONLY, *sp(site), check=0).out
    assert "verify: passed integrity; NOT checked: imports, kernels, engine" in out
    assert "all checks passed" not in out
    out = cli("revert", *sp(site), check=0).out
    out = cli("apply", *ONLY, NV, *sp(site), check=0).out
    assert "not verified (--no-verify)" in out


# ------------------------------------------------- 8. no silent no-ops


def test_sampler_alone_says_it_brings_the_proposer(tree, cli):
    site = tree("vllm", "0.33.0", slim=True)
    r = cli("apply", NV, "--only", "ddtree-sampler", *sp(site), check=0)
    assert "ddtree-proposer: apply (needed by ddtree-sampler)" in r.out


def test_second_apply_does_not_rewrite_the_manifest(tree, cli, state_dir):
    site = tree("vllm", "0.20.2", slim=True)
    cli("apply", *ONLY, NV, *sp(site), check=0)
    manifest = next(state_dir.rglob("manifest.json"))
    st = os.stat(manifest)
    r = cli("apply", *ONLY, NV, *sp(site), check=0)
    assert "nothing written" in r.out
    st2 = os.stat(manifest)
    assert (st.st_ino, st.st_mtime_ns) == (st2.st_ino, st2.st_mtime_ns)


def test_rolled_back_apply_leaves_no_backups(tree, cli, state_dir):
    site = tree("vllm", "0.20.2", slim=True)
    failed(cli("apply", *ONLY, NV, *sp(site), env={"DDTREE_PATCH_FAULT": "fail-at:1"}), 7)
    assert state_files(state_dir) == []


def test_symlinked_target_file_is_refused(tree, cli, tmp_path):
    """A file that is a symbolic link (uv --link-mode=symlink) is neither written
    through (that changes the shared file) nor replaced: refused, nothing written."""
    site = tree("vllm", "0.20.2", slim=True)
    shared = tmp_path / "shared_runner.py"
    shared.write_bytes((site / RUNNER).read_bytes())
    (site / RUNNER).unlink()
    (site / RUNNER).symlink_to(shared)
    before = hashes(site)
    r = cli("apply", "--json", *ONLY, NV, *sp(site), check=3)
    assert "symbolic link" in r.json["error"]["message"]
    assert str(site / RUNNER) in json.dumps(r.json["error"]["details"])
    assert (site / RUNNER).is_symlink() and hashes(site) == before
    assert shared.read_bytes() == (site / RUNNER).read_bytes()


def test_unexpected_errors_are_reported_not_traced(capsys):
    from ddtree_patcher import cli as cli_mod

    with pytest.raises(SystemExit) as end:
        cli_mod.run("status", False, lambda: 1 / 0)
    err = capsys.readouterr().err
    assert end.value.code == 9 and "internal error: ZeroDivisionError" in err
    assert "next: " in err and "Traceback" not in err


# ================================================= issue #30: how real servers are set up

PROPOSER = ("--only", "ddtree-proposer")  # edits that import the files it adds


def sources(site):
    """hashes() without bytecode (apply removes that of the modules it touches)."""
    return {k: v for k, v in hashes(site).items() if "__pycache__" not in k}


def _bind_mount(site, at):
    at.mkdir()
    if subprocess.run(["mount", "--bind", str(site), str(at)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount here (needs root)")
    return str(at)


ALIASES = {
    # kind: (tmp_path, site) -> (another name for site, the folder the commands run in)
    "symlink": lambda tmp, site: (str(_link(tmp / "link", site)), tmp),
    "symlinked parent": lambda tmp, site: (str(_link(tmp / "parent", site.parent)
                                               / site.name), tmp),
    "relative, with ..": lambda tmp, site: (f"../{site.name}", _mkdir(tmp / "cwd")),
    "trailing slash": lambda tmp, site: (f"{site}/", tmp),
    "bind mount": lambda tmp, site: (_bind_mount(site, tmp / "bind"), tmp),
}


def _link(link, to):
    link.symlink_to(to)
    return link


def _mkdir(d):
    d.mkdir()
    return d


@pytest.mark.parametrize("version", ["0.20.2", "0.33.0"])
@pytest.mark.parametrize("kind", list(ALIASES))
def test_one_install_under_two_names(kind, version, tree, cli, tmp_path):
    """Applied under one name, everything else under the other (and the reverse): the
    same install, never 'stale state' (whose advice, forget, broke vLLM)."""
    site = tree("vllm", version, slim=True)
    alias, cwd = ALIASES[kind](tmp_path, site)
    before = sources(site)
    try:
        for first, then in ((site, alias), (alias, site)):
            cli("apply", NV, *PROPOSER, *sp(first), cwd=cwd, check=0)
            st = cli("status", "--json", *sp(then), cwd=cwd, check=0).json
            assert st["status"] == "patched" and st["applied"] == ["ddtree-proposer"]
            failed(cli("forget", *sp(then), cwd=cwd), 2)  # it belongs: revert, not forget
            cli("revert", *sp(then), cwd=cwd, check=0)
            assert sources(site) == before
    finally:
        if kind == "bind mount":
            subprocess.run(["umount", str(tmp_path / "bind")])
    assert record_mismatches(find_target(site_packages=str(site))) == []


def _record_rewritten(site, state_dir):
    record = next(site.glob("*.dist-info")) / "RECORD"
    record.write_text("".join(reversed(record.read_text().splitlines(True))))


def _manifest_unreadable(site, state_dir):
    next(state_dir.rglob("manifest.json")).write_bytes(b"{not json")


@pytest.mark.parametrize("unbind", [_record_rewritten, _manifest_unreadable])
def test_forget_refuses_while_vllm_files_hold_the_patch(unbind, tree, cli, state_dir):
    """Saved state that does not bind (or cannot be read) while vLLM's edited files
    still import what ddtree-patch added: forget removes nothing and says to reinstall
    first; following that ends at the pristine release."""
    site = tree("vllm", "0.20.2", slim=True)
    cli("apply", NV, *PROPOSER, *sp(site), check=0)
    unbind(site, state_dir)
    before = hashes(site)
    r = cli("forget", *sp(site))
    failed(r, 4)
    assert "still hold ddtree-patch's edits" in r.err and RUNNER in r.err
    assert "--force-reinstall" in r.err.split("next: ")[1]
    assert hashes(site) == before
    st = cli("status", "--json", *sp(site), check=4).json
    assert "--force-reinstall" in st["next"].split("forget")[0]  # reinstall comes first
    upgrade_in_place(site, "vllm", "0.20.2", slim=True)  # the reinstall it asks for
    st = cli("status", "--json", *sp(site), check=4).json  # then what status says
    step = re.search(r"`ddtree-patch (\w+)", st["next"]).group(1)
    cli(step, *sp(site), check=0)
    assert sources(site) == sources(tree("vllm", "0.20.2", slim=True))
    assert record_mismatches(find_target(site_packages=str(site))) == []


def test_state_folder_on_another_file_system(tree, cli, tmp_path):
    shm = "/dev/shm"
    if not (os.path.isdir(shm) and os.access(shm, os.W_OK)):
        pytest.skip("no writable /dev/shm")
    site = tree("vllm", "0.20.2", slim=True)
    if os.stat(shm).st_dev == os.stat(site).st_dev:
        pytest.skip("/dev/shm and the test folder are one file system here")
    state = tempfile.mkdtemp(prefix="ddtree-state-", dir=shm)
    env = {"DDTREE_PATCH_STATE_DIR": state}
    try:
        before = sources(site)
        cli("apply", NV, *PROPOSER, *sp(site), env={**env, "DDTREE_PATCH_FAULT":
                                                    "crash-after:3"}, check=70)
        cli("recover", *sp(site), env=env, check=0)
        assert sources(site) == before
        cli("apply", NV, *PROPOSER, *sp(site), env=env, check=0)
        cli("revert", *sp(site), env=env, check=0)
        assert sources(site) == before and state_files(Path(state)) == []
    finally:
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.parametrize("parent_mode", [0o755, 0o2775], ids=["0755", "2775"])
def test_new_folders_take_the_parents_permissions_not_the_umask(parent_mode, tree, cli,
                                                                state_dir):
    """Under umask 077 (a hardened root) the folders apply creates are as open as the
    folder they are made in, so the service user that runs vLLM can import them."""
    site = tree("vllm", "0.20.2", slim=True)
    parent = site / "vllm/v1/spec_decode"
    parent.chmod(parent_mode)
    cli("apply", NV, *PROPOSER, *sp(site), preexec_fn=lambda: os.umask(0o077), check=0)
    made = [parent / "ddtree"] + [p for p in (parent / "ddtree").rglob("*") if p.is_dir()]
    assert len(made) >= 2
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in made} == {
        p.name: oct(parent_mode) for p in made}
    added = [p for p in (parent / "ddtree").rglob("*.py")]
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in added} == {"0o644"}
    # the state folder is not vLLM's: the umask applies (0700 here), never its parent's
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in state_dir.rglob("*")
            if p.is_dir()} == {"0o700"}


# ------------------------------------------------- state files are input


def _journal_after_a_crash(tree, cli, state_dir):
    """A 0.20.2 tree with a killed apply: its journal (2 entries, the first written)."""
    site = tree("vllm", "0.20.2", slim=True)
    cli("apply", *ONLY, NV, *sp(site), env={"DDTREE_PATCH_FAULT": "crash-after:1"},
        check=70)
    path = next(state_dir.rglob("journal.json"))
    return site, path, json.loads(path.read_text())


def _sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _outside_entry(j, rel, victim):
    """An added-file entry whose file (outside the tree) holds the 'written' bytes: a
    rollback removes it."""
    j["entries"].append({"path": rel, "before": None, "before_sha": None,
                         "after_sha": _sha(victim), "tmp": f".x.{j['token']}.ddtree-tmp"})


def _link_inside_tree(site, victim, j):
    (site / "vllm/v1/escape").symlink_to(victim.parent)
    _outside_entry(j, f"vllm/v1/escape/{victim.name}", victim)


JOURNALS = {
    # name: (site, journal folder, journal dict, victim file outside the tree) -> None
    "temp name leads outside": lambda site, jd, j, v: j["entries"][0].update(
        tmp=os.path.relpath(v, (site / j["entries"][0]["path"]).parent)),
    "path with ..": lambda site, jd, j, v: _outside_entry(j, f"vllm/../../{v.name}", v),
    "absolute path": lambda site, jd, j, v: _outside_entry(j, str(v), v),
    "path through a link in the tree": lambda site, jd, j, v: _link_inside_tree(site, v, j),
    "saved copy read from outside": lambda site, jd, j, v: j["entries"][0].update(
        before=os.path.relpath(v, jd), before_sha=_sha(v)),
    "new folder outside": lambda site, jd, j, v: j["new_dirs"].append(
        f"vllm/../../{v.parent.name}/empty"),
    "NUL in a path": lambda site, jd, j, v: _outside_entry(j, "vllm/a\x00b.py", v),
}


@pytest.mark.parametrize("name", list(JOURNALS))
def test_hostile_journal_is_refused_not_followed(name, tree, cli, state_dir, tmp_path):
    site, path, j = _journal_after_a_crash(tree, cli, state_dir)
    outside = _mkdir(tmp_path / "outside")
    victim = outside / "victim.py"
    victim.write_text("# not ddtree-patch's\n")
    _mkdir(outside / "empty")
    JOURNALS[name](site, path.parent, j, victim)
    path.write_text(json.dumps(j))
    before, around = hashes(site), sorted(os.listdir(outside))
    for args in (("recover",), ("apply", NV, *ONLY), ("revert",)):
        r = cli(*args, *sp(site))
        failed(r, 4)
        assert "journal" in r.err
    assert cli("status", "--json", *sp(site), check=4).json["status"] != "clean"
    assert victim.read_text() == "# not ddtree-patch's\n"
    assert sorted(os.listdir(outside)) == around
    assert hashes(site) == before


MANIFESTS = {
    # name: a files row of manifest.json whose path leads outside the tree
    "added file with ..": "vllm/../../outside/victim.py",
    "added file, absolute path": None,  # the victim's absolute path
}


@pytest.mark.parametrize("name", list(MANIFESTS))
def test_hostile_manifest_is_refused_not_followed(name, tree, cli, state_dir, tmp_path):
    site = tree("vllm", "0.20.2", slim=True)
    cli("apply", *ONLY, NV, *sp(site), check=0)
    victim = _mkdir(tmp_path / "outside") / "victim.py"
    victim.write_text("# not ddtree-patch's\n")
    path = next(state_dir.rglob("manifest.json"))
    m = json.loads(path.read_text())
    m["files"][MANIFESTS[name] or str(victim)] = {
        "kind": "add", "pre_sha": None, "post_sha": _sha(victim),
        "transforms": ["dflash-layer-offset"]}
    path.write_text(json.dumps(m))
    before = hashes(site)
    for args in (("revert",), ("revert", "--force"), ("apply", NV)):
        r = cli(*args, *sp(site))
        failed(r, 4)
        assert "manifest" in r.err
    failed(cli("forget", *sp(site)), 4)  # unreadable, but vLLM's files hold the patch
    assert victim.read_text() == "# not ddtree-patch's\n" and hashes(site) == before


def test_backups_folder_leading_outside_is_refused(tree, cli, state_dir, tmp_path):
    """A link in the state folder is not written through (a second apply would save
    its backups wherever the link points)."""
    site = tree("vllm", "0.20.2", slim=True)
    cli("apply", *ONLY, NV, *sp(site), check=0)
    backups = next(state_dir.rglob("backups"))
    outside = tmp_path / "outside"
    shutil.move(backups / "vllm", outside)
    (backups / "vllm").symlink_to(outside)
    around, before = hashes(outside), hashes(site)
    r = cli("apply", NV, "--only", "dflash-swa", *sp(site))
    failed(r, 4)
    assert "leads outside the state folder" in r.err
    assert hashes(outside) == around and hashes(site) == before


# ------------------------------------------------- RECORD as pip writes it, and worse


RECORDS = {
    "a blank line": lambda b: b.replace(b"\n", b"\n\n", 1),
    "blank lines at the end": lambda b: b + b"\n \n\n",
    "CR CR LF endings": lambda b: b.replace(b"\n", b"\r\r\n"),
    "CR LF endings": lambda b: b.replace(b"\n", b"\r\n"),
    "CR endings": lambda b: b.replace(b"\n", b"\r"),
    "no newline at the end": lambda b: b.rstrip(b"\n"),
}


@pytest.mark.parametrize("version", ["0.20.2", "0.33.0"])
@pytest.mark.parametrize("name", list(RECORDS))
def test_record_with_odd_lines_is_read(name, version, tree, cli):
    site = tree("vllm", version, slim=True)
    record = next(site.glob("*.dist-info")) / "RECORD"
    record.write_bytes(RECORDS[name](record.read_bytes()))
    before = sources(site)
    cli("apply", *PROPOSER, *sp(site), check=0)  # verify --quick: the RECORD check
    out = cli("revert", "--json", *sp(site), check=0).json
    assert out["record_mismatches"] == [] and sources(site) == before


def _record_row(site, row):
    record = next(site.glob("*.dist-info")) / "RECORD"
    record.write_bytes(record.read_bytes() + row)
    return site


# ------------------------------------------------- bytecode


def _no_compile(site):
    """What `pip install --no-compile` leaves: no bytecode, RECORD lists none."""
    for d in list(site.rglob("__pycache__")):
        shutil.rmtree(d)
    record = next(site.glob("*.dist-info")) / "RECORD"
    record.write_text("".join(line for line in record.read_text().splitlines(True)
                              if ".pyc," not in line))


def test_bytecode_cache_apply_empties_goes_and_only_that(tree, cli):
    """A module vLLM byte-compiled at run time, alone in its __pycache__: apply removes
    the stale .pyc and the folder it empties (verify's RECORD check passed only then);
    a cache that holds another module's bytecode stays."""
    site = tree("vllm", "0.20.2", slim=True)
    _no_compile(site)
    other = "vllm/v1/worker/gpu_input_batch.py"
    for rel in (ALGOS, RUNNER, other):
        py_compile.compile(str(site / rel), doraise=True)
    r = cli("apply", "--json", *ONLY, *sp(site), check=0)
    assert r.json["verify"]["ok"]
    assert not (site / ALGOS).parent.joinpath("__pycache__").exists()
    left = [p.name for p in (site / RUNNER).parent.joinpath("__pycache__").iterdir()]
    assert [n.split(".")[0] for n in left] == ["gpu_input_batch"]
    cli("revert", *sp(site), check=0)


# ------------------------------------------------- signals and streams


def _write_points(cli, site, tmp_path):
    for _ in range(2):  # the second run counts: the first also removes stale bytecode
        labels = points(cli, site, tmp_path, "apply", NV, *PROPOSER)
        cli("revert", *sp(site), check=0)
    return labels


@pytest.mark.parametrize("sig,code", [("INT", 130), ("TERM", 143)])
def test_signal_while_writing_rolls_back_then_exits_128_plus_signal(sig, code, tree, cli,
                                                                   tmp_path, state_dir):
    site = tree("vllm", "0.20.2", slim=True)
    labels = _write_points(cli, site, tmp_path)
    before = sources(site)
    vllm_writes = [i for i, lab in enumerate(labels, 1)
                   if lab.startswith(f"replaced {site}/vllm/")]
    for n in (vllm_writes[0], vllm_writes[len(vllm_writes) // 2]):
        r = cli("apply", NV, *PROPOSER, *sp(site),
                env={"DDTREE_PATCH_FAULT": f"signal-at:{n}:{sig}"})
        failed(r, code)
        assert "rolled back" in r.err
        assert sources(site) == before and state_files(state_dir) == []
    commit = next(i for i, lab in enumerate(labels, 1) if lab.endswith("manifest.json"))
    r = cli("apply", NV, *PROPOSER, *sp(site),
            env={"DDTREE_PATCH_FAULT": f"signal-at:{commit}:{sig}"})
    failed(r, code)  # after the commit point: the patch is complete, and kept
    assert "complete" in r.err
    assert cli("status", "--json", *sp(site), check=0).json["status"] == "patched"


def _closed(fd):
    return {"preexec_fn": lambda: os.close(fd)}


def _broken_pipe(fd):
    r, w = os.pipe()
    os.close(r)
    return {"stdout" if fd == 1 else "stderr": w}


STREAMS = {"stderr closed": lambda: _closed(2), "stderr a broken pipe": lambda: _broken_pipe(2),
           "stdout closed": lambda: _closed(1), "stdout a broken pipe": lambda: _broken_pipe(1)}


@pytest.mark.parametrize("stream", list(STREAMS))
def test_exit_code_does_not_depend_on_the_streams(stream, tree, cli):
    site = tree("vllm", "0.20.2", slim=True)
    clean = ("status", *sp(site))
    cli(*clean, check=0)
    runner = site / RUNNER
    drifted = ("apply", NV, *ONLY, *sp(site))
    for args, code in ((clean, 0), (drifted, 4), (("apply", "--json", *drifted[1:]), 4),
                       (("apply", "--bogus"), 2)):
        if args is drifted:
            runner.write_text(runner.read_text() + "\n# a local edit\n")
        how = STREAMS[stream]()
        for k in ("stdout", "stderr"):
            how.setdefault(k, subprocess.DEVNULL)
        p = subprocess.run([sys.executable, "-m", "ddtree_patcher.cli", *map(str, args)],
                           **how)
        for k in ("stdout", "stderr"):
            if isinstance(how[k], int) and how[k] > 2:
                os.close(how[k])
        assert p.returncode == code, (args, p.returncode)


# ================================================= issue #28: installs that lack files


SLIM_IMAGE = (".so", ".h", ".hpp", ".cuh", ".cu")


def _slim_image(site):
    """What slim production images do: delete the kernels and headers they do not use
    (their RECORD still lists them)."""
    gone = sorted(str(p.relative_to(site)) for p in (site / "vllm").rglob("*")
                  if p.is_file() and p.name.endswith(SLIM_IMAGE))
    for rel in gone:
        (site / rel).unlink()
    return gone


def _edited(version, name="ddtree-proposer"):
    from ddtree_patcher.plan import registry
    return [e.path for e in registry()[1][name].family(version).edits]


@pytest.mark.parametrize("version", ["0.20.2", "0.33.0"])
def test_install_lacking_files_it_does_not_touch_is_patched(version, tree, cli, tmp_path):
    site = tree("vllm", version)
    gone = _slim_image(site)
    assert len(gone) > 500
    before = sources(site)
    r = cli("apply", *PROPOSER, *sp(site), check=0)  # verify --quick: integrity
    assert f"lacks {len(gone)} files its RECORD lists" in r.out and gone[0] in r.out
    assert "the install, not ddtree-patch, is incomplete" in r.out
    assert "verify: passed integrity" in r.out
    doc = cli("verify", "--json", *sp(site), check=0).json
    assert doc["ok"] and str(len(gone)) in json.dumps(doc["checks"][0])
    # a file that goes missing after the apply is still caught
    envs, away = site / "vllm" / "envs.py", tmp_path / "envs.py"
    envs.rename(away)
    doc = cli("verify", "--json", *sp(site), check=1).json
    assert "vllm/envs.py: listed in RECORD but missing" in doc["failed"][0]["message"]
    assert gone[0] not in doc["failed"][0]["message"]
    r = cli("revert", "--json", *sp(site), check=4)
    assert [d["path"] for d in r.json["error"]["details"]] == ["vllm/envs.py"]
    away.rename(envs)
    cli("apply", *PROPOSER, NV, *sp(site), check=0)
    r = cli("revert", *sp(site), check=0)
    assert f"{len(gone)} files RECORD lists are missing, as they were before" in r.out
    assert sources(site) == before


@pytest.mark.parametrize("version", ["0.20.2", "0.33.0"])
def test_install_lacking_a_file_it_must_edit_is_refused(version, tree, cli):
    site = tree("vllm", version)
    gone = _slim_image(site)
    edited = _edited(version)[-1]
    (site / edited).unlink()
    before = hashes(site)
    for args in (("apply", *PROPOSER), ("apply", "--dry-run", *PROPOSER)):
        r = cli(*args, *sp(site))
        failed(r, 3)
        assert f"lacks {len(gone) + 1} files its RECORD lists" in r.err
        assert edited in r.err and "--force-reinstall" in r.err.split("next: ")[1]
    assert hashes(site) == before
