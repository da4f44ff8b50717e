"""bench/gpu/kernel_prof.py (a decode step's device time by kernel) and gemm_by_m.py's
table, on hand-made profiles."""

import json

from .conftest import load_bench


def test_categories_name_our_kernels_cublas_and_vllm_attention():
    m = load_bench("kernel_prof")
    assert m.category("_tree_attn_kernel") == "tree kernels (ours)"
    assert m.category("_paired_kernel") == "tree kernels (ours)"
    assert m.category("nvjet_tst_64x8_64x16_4x1_v_bz_TNT") == "GEMM (cuBLAS / CUTLASS)"
    assert m.category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64") \
        == "GEMM (cuBLAS / CUTLASS)"
    assert m.category("void flash::flash_fwd_splitkv_kernel<...>") == "attention (vLLM)"
    assert m.category("void cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>") \
        == "attention (vLLM)"
    assert m.category("void vllm::rms_norm_kernel<c10::BFloat16>") == "norm"
    assert m.category("at::native::sbtopk::gatherTopK<float>") == "top-k / sort"
    assert m.category("something_new") == "other"


def test_per_step_subtracts_the_prefill_and_divides_by_steps(tmp_path):
    m = load_bench("kernel_prof")
    pre = {"kernels": {"gemm_a": [10, 100.0], "_tree_kernel": [1, 5.0]}, "cpu": {"op": 50.0}}
    full = {"kernels": {"gemm_a": [50, 500.0], "_tree_kernel": [9, 45.0], "fill": [4, 8.0]},
            "cpu": {"op": 450.0, "new": 40.0}}
    s = m.per_step(full, pre, 4)
    assert s["kernels"] == {"gemm_a": [10.0, 100.0], "_tree_kernel": [2.0, 10.0],
                            "fill": [1.0, 2.0]}
    assert s["cpu"] == {"op": 100.0, "new": 10.0}
    # a kernel that ran less in the longer run (noise) is left out, not negative
    pre["kernels"]["fill"] = [9, 90.0]
    assert "fill" not in m.per_step(full, pre, 4)["kernels"]

    a = {"requests": 1, "steps": 4, **s}
    b = {"requests": 1, "steps": 5, "kernels": {"gemm_a": [10.0, 130.0],
                                                "_tree_attn_kernel": [36.0, 400.0]},
         "cpu": {"op": 90.0}}
    fa, fb = tmp_path / "kernels_chain_N1.json", tmp_path / "kernels_tree_N1.json"
    fa.write_text(json.dumps(a))
    fb.write_text(json.dumps(b))
    t = m.table([str(fa), str(fb)])
    assert "| GEMM (cuBLAS / CUTLASS) | 0.100 (10) | 0.130 (10) |" in t
    assert "| tree kernels (ours) | 0.010 (2) | 0.400 (36) |" in t
    assert "**0.112** (13)" in t and "**0.530** (46)" in t
    # the largest difference first
    diffs = t.split("kernels by |difference|")[1].splitlines()[1:]
    assert "_tree_attn_kernel" in diffs[0] and "+400.0" in diffs[0]


def test_gemm_table_reads_rows_against_m16():
    m = load_bench("gemm_by_m")
    per = {t: {"kernels": [f"k_{t}"], "us": 10.0} for t in
           ["qkv", "o", "gate_up", "down", "lm_head"]}
    res = {"device": "dev", "torch": "t", "rounds": 3,
           "rows": {"16": {"step_ms": [4.0, 4.2, 4.1], "per_type": per},
                    "65": {"step_ms": [5.0, 5.2, 5.1], "per_type": per}}}
    t = m.table(res)
    assert "| 16 | 4.100 (4.000-4.200) | 1.000 |" in t
    assert "| 65 | 5.100 (5.000-5.200) | 1.244 |" in t
    assert "M   65 lm_head  k_lm_head" in t
