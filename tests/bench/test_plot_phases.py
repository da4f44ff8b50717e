"""bench/gpu/plot_phases.py: the series behind #29's plots (no matplotlib needed)."""

import json
from pathlib import Path

import pytest

from .conftest import load_bench


def load():
    return load_bench("plot_phases")


def test_step_phases_put_tree_attention_with_attention(tmp_path):
    m = load()
    kernels = {"nvjet_sm90_tst_192x72_64x6_2x1_v_bz_TNT": [36, 2000.0],
               "_tree_attn_kernel": [36, 800.0], "_combine": [36, 150.0],
               "void cutlass::device_kernel<flash::FlashAttnFwdSm90<x>>": [5, 50.0],
               "_build_kernel": [1, 80.0], "_commit_kernel": [1, 40.0],
               "void vllm::rms_norm_kernel<c10::BFloat16>": [82, 200.0],
               "aten::fill_": [6, 2.0]}
    (tmp_path / "kernels_ddtree63chainasync_N2.json").write_text(
        json.dumps({"steps": 31, "kernels": kernels}))
    (tmp_path / "notes.json").write_text("{}")  # not a kernels file: skipped
    got = load().step_phases(tmp_path)
    assert list(got) == [("ddtree63chainasync", 2)]
    ms = got[("ddtree63chainasync", 2)]
    assert list(ms) == m.PHASES
    assert ms["GEMMs"] == pytest.approx(2.0)
    assert ms["attention (FA3 / tree)"] == pytest.approx(1.0)  # 800 + 150 + 50 us
    assert ms["tree build, select, walk, commit"] == pytest.approx(0.12)
    assert ms["norm, activation, rotary"] == pytest.approx(0.2)
    assert ms["other"] == pytest.approx(0.002)


def test_throughput_is_each_call_against_its_own_chain(tmp_path):
    def write(folder: Path, rnd, cfg, tok_s):
        folder.mkdir(exist_ok=True)
        (folder / f"e2e_r{rnd}_{cfg}.txt").write_text(
            f"22:18:24 {cfg} e2e p60 N 2 {json.dumps({'tok_per_s': tok_s})}\n"
            f"22:18:25 {cfg} N 2 step ms 9.0 gpu {{}} cpu {{}}\n")

    a, b = tmp_path / "a", tmp_path / "b"
    for r, (ch, t) in enumerate([(100, 120), (100, 130), (200, 250)], 1):
        write(a, r, "chain15async", ch)
        write(a, r, "tree", t)
    write(b, 1, "chain15async", 50)
    write(b, 1, "tree", 100)      # the first folder's tree is kept
    write(b, 1, "tree63", 60)     # b's own config, against b's chain
    got = load().throughput([a, b])
    assert got == {"p60": {"tree": {2: 1.25}, "tree63": {2: 1.2}}}


def test_nothing_to_plot_says_so(tmp_path, capsys):
    assert load().main(["--kprof", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "no kernels_" in capsys.readouterr().err
