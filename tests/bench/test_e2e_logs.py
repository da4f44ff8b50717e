"""bench/gpu/e2e_logs.py: ratios per cell and round from gdn_device.sh's e2e logs."""

import json
from pathlib import Path

from .conftest import load_bench


def load():
    return load_bench("e2e_logs")


def write(folder: Path, rnd: int, cfg: str, tok_s: float, step_ms: float):
    cell = json.dumps({"tokens": 256, "tok_per_s": tok_s, "timeline": [[1, 16, 15, 9.0]]})
    (folder / f"e2e_r{rnd}_{cfg}.txt").write_text(
        "INFO noise line\n"
        f"22:18:23 {cfg} N 1 step ms {step_ms} gpu {{}} cpu {{}}\n"
        f"22:18:24 {cfg} e2e p60 N 1 {cell}\n"
        # another config's line in this file is not this config's
        f"22:18:25 other e2e p60 N 1 {cell}\n")


def test_ratios_per_round_and_against_the_fixed_tree(tmp_path):
    m = load()
    for r, (c, a, f) in enumerate([(100, 120, 130), (100, 126, 126), (200, 250, 240)], 1):
        write(tmp_path, r, "chain15async", c, 8.0)
        write(tmp_path, r, "auto", a, 9.0)
        if r != 3:  # a round the fixed tree did not run: left out of its ratios
            write(tmp_path, r, "fixed", f, 10.0)
    data = m.read(tmp_path)
    assert data[("p60", 1)]["auto"] == {1: 120, 2: 126, 3: 250}
    assert "other" not in data[("p60", 1)]
    assert m.ratios(data[("p60", 1)]["auto"], data[("p60", 1)]["chain15async"]) == [1.2, 1.26, 1.25]
    out = m.table(data, "chain15async", "fixed")
    assert "| p60 N 1 | 100.00 | 1.250 (1.200-1.260, 3) | 1.280 (1.260-1.300, 2) |" \
           " 0.962 (0.923-1.000, 2) |" in out
    assert "| step N 1 | 8.00 | 1.125 (1.125-1.125, 3) |" in out


def test_an_empty_folder_says_so(tmp_path, capsys):
    assert load().main([str(tmp_path)]) == 2
    assert "no e2e_r" in capsys.readouterr().err


def test_estimates_against_what_each_arm_realized(tmp_path, capsys):
    """--estimates: the tree's last estimate / its realized tokens, the chain arm's
    paired estimate / the chain config's tau in the same cell and round."""
    m = load()

    def line(cfg, doc):
        return f"22:18:24 {cfg} e2e p80 N 2 {json.dumps(doc)}\n"

    for r, (tau, est) in enumerate([(4.0, 3.6), (5.0, 5.5)], 1):
        (tmp_path / f"e2e_r{r}_chain15async.txt").write_text(
            line("chain15async", {"tok_per_s": 100.0, "tau": tau}))
        arms = {"2": {"tree 32": {"expected": 6.0, "measured": 5.0, "steps": 40},
                      "chain 15": {"expected": est, "measured": 4.1, "steps": 7}},
                "1": {"tree 64": {"expected": 9.0, "measured": 9.0, "steps": 0}}}
        (tmp_path / f"e2e_r{r}_auto.txt").write_text(
            line("auto", {"tok_per_s": 90.0, "tau": 5.0, "arms": arms}) +
            line("fixed", {"tok_per_s": 80.0, "tau": 5.0}))  # not this file's config
    est = m.estimates(tmp_path, "chain15async")
    assert list(est) == [("auto", "p80", 2)]  # batch size 1 is not this cell's
    r = est[("auto", "p80", 2)]
    assert r["tree"] == [1.2, 1.2] and r["steps"] == [40, 40]
    assert [round(x, 6) for x in r["chain"]] == [0.9, 1.1]
    assert m.main([str(tmp_path), "--estimates"]) == 0
    out = capsys.readouterr().out
    assert "| auto | p80 N 2 | 1.200 (1.200-1.200, 2); 40 steps | 1.000 (0.900-1.100, 2) |" \
        in out
    # logs without the choice's arms: said so, rc 2
    for f in tmp_path.glob("e2e_r*_auto.txt"):
        f.unlink()
    assert m.main([str(tmp_path), "--estimates"]) == 2
    assert "logs the choice's arms" in capsys.readouterr().err


def test_decode_rates_leave_the_prefill_step_out():
    m = load()
    # 2 requests: the prefill (no drafts, 40 ms) emits one token each; 3 decode steps
    # of 10 ms, the last untimed (the median of the others stands in)
    doc = {"tokens": 2 + 60, "timeline": [[2, 1024, None, 40.0], [2, 32, 15, 10.0],
                                          [2, 32, 15, 10.0], [2, 32, 15, None]]}
    assert m.decode_rate(doc) == 60 / 30e-3
    # a timeline that does not start with the prefill, or misses a middle step's time
    assert m.decode_rate({**doc, "timeline": doc["timeline"][1:]}) is None
    broken = [list(t) for t in doc["timeline"]]
    broken[1][3] = None
    assert m.decode_rate({**doc, "timeline": broken}) is None
    assert m.decode_rate({"tokens": 5, "tok_per_s": 9.0}) is None


def test_decode_table_reads_the_timelines(tmp_path, capsys):
    m = load()
    for cfg, ms in (("chain15async", 10.0), ("tree", 8.0)):
        doc = {"tokens": 1 + 40, "tok_per_s": 1.0,
               "timeline": [[1, 512, None, 99.0]] + [[1, 16, 15, ms]] * 4}
        (tmp_path / f"e2e_r1_{cfg}.txt").write_text(
            f"22:18:24 {cfg} e2e p60 N 1 {json.dumps(doc)}\n")
    assert m.main([str(tmp_path), "--decode"]) == 0
    assert "| p60 N 1 | 1000.00 | 1.250 (1.250-1.250, 1) |" in capsys.readouterr().out


def test_stalls_count_long_steps_and_the_collectors_time(tmp_path, capsys):
    """--stalls: decode steps over 2x their cell's median (the prefill step left out),
    the ms beyond that median, and the GC time where a cell logs it."""
    m = load()
    tl = [[1, 16, None, 40.0]] + [[1, 16, 15, 9.0]] * 8 + [[1, 16, 15, 30.0], [1, 16, 15, None]]
    doc = {"tok_per_s": 100.0, "timeline": tl, "gc": {"count": [5, 1, 1], "ms": [0.5, 1.0, 20.0]}}
    (tmp_path / "e2e_r1_auto.txt").write_text(f"22:18:24 auto e2e p60 N 1 {json.dumps(doc)}\n")
    del doc["gc"]
    (tmp_path / "e2e_r1_chain15async.txt").write_text(
        f"22:18:24 chain15async e2e p60 N 1 {json.dumps(doc)}\n")
    st = m.stalls(tmp_path)
    assert st["auto"] == {"cells": 1, "steps": 9, "stalls": 1, "stall_ms": 21.0,
                          "gc_ms": 21.5, "gc2": 1}
    assert st["chain15async"]["gc_ms"] is None and st["chain15async"]["stalls"] == 1
    assert m.main([str(tmp_path), "--stalls"]) == 0
    out = capsys.readouterr().out
    assert "| auto | 1 | 9 | 1 | 21.0 | 21.5 (1) |" in out
    assert "| chain15async | 1 | 9 | 1 | 21.0 | - |" in out
