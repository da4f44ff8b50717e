"""bench/gpu/topk_bench.py: the table it prints (a broken table costs a device call)."""

import json
import os

from .conftest import load_bench


def test_table_medians_spread_and_ratio():
    tb = load_bench("topk_bench")
    res = [dict(rows=15, us={"fused": [70.0, 69.0, 71.5], "split": [20.0, 21.0, 19.0],
                             "torch": [90.0, 91.0, 92.0]}),
           dict(rows=960, us={"fused": [400.0], "split": [], "torch": [500.0]})]
    lines = tb.table(res).splitlines()
    assert lines[0] == "| rows | fused us | split us | torch us | split / fused |"
    assert lines[2] == ("| 15 | 70.0 (69.0-71.5) | 20.0 (19.0-21.0) | 91.0 (90.0-92.0) "
                        "| 0.286 |")
    assert lines[3] == "| 960 | 400.0 (400.0-400.0) | - | 500.0 (500.0-500.0) | - |"


def test_table_of_the_argmax():
    tb = load_bench("topk_bench")
    res = [dict(rows=64, us={"torch": [34.0, 35.0, 33.0], "triton": [9.0, 10.0, 11.0]})]
    lines = tb.table(res, tb.ARGMAX_IMPLS, new="triton", old="torch").splitlines()
    assert lines[0] == "| rows | torch us | triton us | triton / torch |"
    assert lines[2] == "| 64 | 34.0 (33.0-35.0) | 10.0 (9.0-11.0) | 0.294 |"


def test_the_script_runs_and_checks_every_impl(tmp_path, monkeypatch):
    """The whole script on the CPU under the Triton interpreter (tiny shapes, no timing
    worth the name): what the device runs, checked here first."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TOPK_FROM_CHECKOUT", "1")
    tb = load_bench("topk_bench")
    rc = tb.main([str(tmp_path), "--device", "cpu", "--rows", "2", "--argmax-rows", "3",
                  "--vocab", "700", "--rounds", "1", "--reps", "1"])
    assert rc == 0
    meta = json.loads((tmp_path / "topk_bench.json").read_text())
    assert [r["rows"] for r in meta["results"]] == [2]
    assert set(meta["results"][0]["us"]) == {"fused", "split", "torch"}
    assert set(meta["argmax"][0]["us"]) == {"torch", "triton"}
    assert os.environ["TRITON_INTERPRET"] == "1"
