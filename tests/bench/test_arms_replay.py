"""bench/gpu/arms_replay.py on a hand-made step trace (sched/arms.py's ArmLookup.trace)."""

import json

from .conftest import load_bench


def load():
    return load_bench("arms_replay")


# [batch size, drafts, tree arm?, ms, tokens, expected tree, expected chain]
TRACE = [[1, 64, True, 10.5, 4, None, None], [1, 64, True, 10.7, 6, 4.0, 3.0],
         [1, 15, False, 9.1, 2, 4.0, 3.0], [1, 15, False, 9.3, 3, 5.0, 2.0],
         [2, 32, True, 11.0, 8, 4.5, 3.5]]


def test_each_arm_against_its_own_estimate():
    r = load().replay(TRACE)
    assert r[(1, 64)] == {"steps": 2, "realized": 5.0, "expected": 4.0, "ratio": 0.8,
                          "ms": 10.6}
    assert r[(1, 15)] == {"steps": 2, "realized": 2.5, "expected": 2.5, "ratio": 1.0,
                          "ms": 9.2}
    assert r[(2, 32)]["realized"] == 4.0 and r[(2, 32)]["ratio"] == 1.125


def test_the_table_and_files_without_a_trace(tmp_path, capsys):
    m = load()
    good, old = tmp_path / "a.json", tmp_path / "b.json"
    good.write_text(json.dumps({"ddtree64autoasync": {"e2e": {"p60_N1": {"arms_trace": TRACE}}}}))
    old.write_text(json.dumps({"chain15async": {"e2e": {"p60_N1": {"tok_per_s": 1.0}}}}))
    assert m.main([str(good)]) == 0
    out = capsys.readouterr().out
    assert "| ddtree64autoasync | p60_N1 | 1 | 64 | 2 | 5.000 | 4.0 | 0.8 | 10.6 |" in out
    assert m.main([str(old)]) == 2 and "no arms_trace" in capsys.readouterr().err
    assert m.main([str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
