"""kill -9 at every write point of apply, revert and recover on a real vLLM 0.20.2 tree
(kill_driver.py says how): nothing foreign at the kill, the tool's own advice leads
back to the pristine release (RECORD-clean, no unlisted files or folders, no state
left), and after an in-place upgrade to 0.33.0 no 0.20.2 byte is ever written.  Also
(issue #30) kills around the removal of a __pycache__ apply empties, and SIGINT /
SIGTERM at write points: rolled back before the exit, which is 130 / 143."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

DRIVER = Path(__file__).with_name("kill_driver.py")
KINDS = ("temp written", "replaced", "removed", "mkdir", "rmdir", "bytecode removed",
         "journal cleared")


@pytest.fixture(scope="module")
def harness():
    # tmpfs when there is one: fsync is free there, and the harness runs ~300 commands
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
        else None
    work = Path(tempfile.mkdtemp(prefix="ddtree-kill-", dir=base))
    try:
        p = subprocess.run([sys.executable, str(DRIVER), str(work)], capture_output=True,
                           text=True, timeout=1800,
                           env={k: v for k, v in os.environ.items()
                                if not k.startswith("DDTREE_PATCH_")})
        assert p.returncode == 0, p.stderr[-5000:]
        yield json.loads(p.stdout)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def kinds(points):
    return {k for k in KINDS for p in points if p.startswith(k)}


@pytest.mark.parametrize("scenario", ["apply", "revert", "recover-apply", "recover-revert"])
def test_every_kill_point_recovers_to_pristine(harness, scenario):
    out = harness[scenario]
    assert out["failures"] == [], json.dumps(out["failures"], indent=1)[:6000]
    assert len(out["points"]) >= {"apply": 60, "revert": 60}.get(scenario, 5)


def test_the_points_cover_every_kind_of_write(harness):
    assert kinds(harness["apply"]["points"]) >= {"temp written", "replaced", "mkdir",
                                                "bytecode removed", "journal cleared"}
    assert kinds(harness["revert"]["points"]) >= {"removed", "rmdir", "replaced"}
    # the recovery scenarios start from a crash half-way through the vLLM writes
    assert "/vllm/" in harness["recover-apply"]["crashed_at"]


def test_upgrade_after_a_killed_apply_gets_no_old_bytes(harness):
    out = harness["upgrade"]
    assert out["failures"] == [], json.dumps(out["failures"], indent=1)[:6000]
    assert len(out["tried"]) >= 4
    assert all(t["advice"].count("forget") == 1 for t in out["tried"]), out["tried"]


def test_a_kill_around_bytecode_cleanup_leaves_no_empty_cache(harness):
    out = harness["bytecode"]
    assert out["failures"] == [], json.dumps(out["failures"], indent=1)[:6000]
    assert any(p.startswith("rmdir ") and p.endswith("/__pycache__") for p in out["points"])


def test_signals_roll_back_then_exit_128_plus_the_signal(harness):
    out = harness["signals"]
    assert out["failures"] == [], json.dumps(out["failures"], indent=1)[:6000]
    assert len(out["points"]) >= 60 and out["commit"] < len(out["points"])


def test_tree_ends_record_clean(harness):
    assert harness["record_problems"] == []
