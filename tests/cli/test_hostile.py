"""Issue #14: the patcher used the way a hostile user (or a bad day) would, on real
vLLM trees.  Each test names the item it covers."""

import hashlib
import json
import os
import resource
import signal
import subprocess

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
