"""bench/gpu/report.py's tables from repeated rounds (the v2repeat stage): per config the
rounds, each round's ratio to the same round's chain, and the medians."""

from types import SimpleNamespace

import pytest

from .conftest import load_bench


def _report():
    return load_bench("report")


def _round(chain_ms, tree_ms, chain_tps, tree_tps):
    return {"chain15async": {"steps": {"4": {"step_ms": chain_ms}},
                             "e2e": {"p80_N4": {"tok_per_s": chain_tps}}},
            "ddtree64chainasync": {"steps": {"4": {"step_ms": tree_ms}},
                                   "e2e": {"p80_N4": {"tok_per_s": tree_tps}}}}


def test_repeat_tables_take_ratios_per_round_and_medians():
    r = _report()
    runs = [_round(7.0, 7.7, 2000, 1800), _round(8.0, 8.0, 2000, 2200),
            _round(7.5, 7.5, 1000, 1000)]
    steps = r.repeat_table(runs).splitlines()
    row = next(x for x in steps if x.startswith("| ddtree64chainasync | 4 |"))
    assert "7.70 (1.10)" in row and row.endswith("| 7.70 | 1.00 |")  # medians of 3
    e2e = r.e2e_repeat_table(runs).splitlines()
    row = next(x for x in e2e if x.startswith("| ddtree64chainasync | p80_N4 |"))
    assert "1800 (0.90)" in row and "2200 (1.10)" in row
    assert row.endswith("| 1800 | 1.00 |")
    # V1 rounds name their chain chain15
    v1 = [{"chain15": {"steps": {"1": {"step_ms": 2.0}}},
           "ddtree64": {"steps": {"1": {"step_ms": 3.0}}}}]
    assert "3.00 (1.50)" in r.repeat_table(v1)


def test_the_choice_table_lists_both_arms_and_the_smaller_trees():
    r = _report()
    arm = {"tree 64": {"tok_per_s": 500.0, "ms": 8.4, "expected": 3.4, "steps": 56,
                       "chosen": 16},
           "chain 15": {"tok_per_s": 520.0, "ms": 7.3, "expected": 2.3, "steps": 7,
                        "chosen": 2},
           "edge": 3.2, "switches": 5, "switch_ms": 1.25, "subtrees": {"32": 3.2, "16": 2.9}}
    idle = {"tree 64": dict(arm["tree 64"], steps=0), "chain 15": dict(arm["chain 15"],
                                                                         steps=0)}
    run = {"ddtree64autoasync": {"e2e": {"p60_N1": {"arms": {"1": arm, "2": idle}}}}}
    rows = [x for x in r.arms_table([run]).splitlines() if x.startswith("| 1 |")]
    assert rows == ["| 1 | ddtree64autoasync | p60_N1 | 1 | 56 / 7 | 8.40 / 7.30 | "
                    "3.40 / 2.30 | 3.20 | 1.25 (5) | 32: 3.2, 16: 2.9 |"]
    del arm["edge"], arm["switches"]  # before the error bar, before a measured switch
    assert "| 3.40 / 2.30 | - | - | 32" in r.arms_table([run])


def test_the_timeline_shows_what_switches_and_first_steps_cost():
    r = _report()
    sb = load_bench("step_bench")
    so = SimpleNamespace(num_scheduled_tokens={"a": 16, "b": 16},
                         scheduled_spec_decode_tokens={"a": [1] * 15, "b": [2] * 15})
    assert sb.decode_width(so) == 15
    so.num_scheduled_tokens["b"] = 40  # a prefill chunk in the step
    assert sb.decode_width(so) is None
    assert sb.decode_width(SimpleNamespace()) is None
    # one request: prefill (11 tokens), tree steps (65 tokens), chain steps (16 tokens)
    tl = [[1, 11, None, 30.0], [1, 65, 64, 12.0], [1, 65, 64, 8.0], [1, 65, 64, 8.0],
          [1, 16, 15, 9.0], [1, 16, 15, 7.0], [1, 16, 15, 7.0], [1, 65, 64, 10.0],
          [1, 65, 64, 8.0], [1, 16, 15, None]]
    st = r.timeline_stats(tl)
    assert st["widths"] == [15, 64] and st["tree"] == 64
    assert st["steps"] == {15: 3, 64: 5}  # the prefill and the last step (no wall) out
    assert st["steady_ms"] == {15: 7.0, 64: 8.0}
    assert st["after_switch_ms"] == {15: (9.0, 1), 64: (10.0, 1)}
    assert st["first_tree_ms"] == round((12 + 8 + 8) / 3, 3)
    assert st["excess_ms"] == 4 + 2 + 2  # 12 vs 8, 9 vs 7, 10 vs 8
    assert st["excess_pct"] == round(100 * 8 / 69, 2)  # of 69 ms of decode steps
    run = {"ddtree64autoasync": {"e2e": {"p80_N1": {"timeline": tl}}},
           "chain15async": {"e2e": {"p80_N1": {"timeline": [
               [1, 16, 15, 7.1], [1, 16, 15, 6.9], [1, 16, 15, 7.2], [1, 16, 15, None]]}}}}
    rows = [x for x in r.timeline_table([run]).splitlines() if x.startswith("| 1 |")]
    # one width (the chain config): no row of its own, its steady step in the choice's
    assert rows == ["| 1 | ddtree64autoasync | p80_N1 | 5 / 3 | 8.00 / 7.00 | 7.20 | "
                    "10.00 / 9.00 (1 / 1) | 9.33 | 8.0 (11.6) |"]
    assert r.timeline_stats([[1, 11, None, 3.0]]) is None


def test_the_steady_table_leaves_each_cells_first_step_out():
    """tokens after the first step over the time after it, per round and engine: a slow
    first step (prefill) that decides a short cell's ratio drops out."""
    r = _report()

    def cell(seconds, first_ms, tokens=128):
        return {"tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
                "timeline": [[1, 512, None, first_ms], [1, 16, 15, 30.0]]}

    def rnd(chain, tree):
        return {"chain15async": {"e2e": {"p90_N1": chain}},
                "ddtree16autoasync": {"e2e": {"p90_N1": tree}}}

    # same steady time (0.6 s after the first step), the tree's first step 60 ms slower
    runs = [rnd(cell(0.74, 140.0), cell(0.80, 200.0)) for _ in range(3)]
    assert r.e2e_repeat_table(runs).splitlines()[-1].endswith("| 0.93 |")
    row = r.e2e_steady_table(runs).splitlines()[-1]
    assert row == "| ddtree16autoasync | p90_N1 | 1.000 | 1.000 | 1.000 | 1.000 |"
    assert r.after_first_step(cell(0.74, 140.0), 1) == pytest.approx((128 - 1) / 0.6)
    assert r.after_first_step({"tokens": 1, "seconds": 0.1, "timeline": []}, 1) is None
