"""Greedy DDTree == no-spec on the H200 with real (patched) vLLM, tiny models.

Runs (one process, engines one after the other; the rows per version are in plan()):
  fp32 (FLEX_ATTENTION on 0.20.x, TRITON_ATTN on 0.32/0.33; FA3 has no fp32): reference
  nospec eager; ddtree with CUDA graphs (FULL_DECODE_ONLY: verify steps of a uniform
  batch replay a FULL graph that holds the tree kernel):
    nospec  vs  ddtree (B=32, L=7): prompts 0-3 with the synthetic drafter (the target's
    own continuation placed at ranks drawn from [0.5, 0.25, 0.1]: deep and sibling
    accepts), prompts 4-7 with the random DFlash drafter.
  bf16, FLASH_ATTN (FA3) (and TRITON_ATTN on 0.32/0.33): nospec graphs, ddtree graphs,
  ddtree eager.
Also counted: eager calls of the tree attention during generation (0 under graphs for
uniform verify steps = the tree ran inside the FULL graph), and the walk statistics.

    python bench/gpu/equality.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

B, L = 32, 7
N_PROMPTS, MAX_TOKENS = 8, 48
TINY = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            max_position_embeddings=4096)


def engine(base, dtype, backend, mode, profile=None, eager=False, stats=None, **llm_kw):
    """llm_kw: more LLM arguments (tp_equality.py: tensor parallelism)."""
    from vllm import LLM

    kw = dict(model=f"{base}/target", skip_tokenizer_init=True, dtype=dtype, seed=0,
              max_model_len=512, max_num_seqs=N_PROMPTS, gpu_memory_utilization=0.08,
              attention_backend=backend, enforce_eager=eager, **llm_kw)
    if not eager:
        k_spec = {"ddtree": B, "dflash": L}.get(mode, 0)
        sizes = [k * (1 + k_spec) for k in range(1, N_PROMPTS + 1)]
        kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                    "cudagraph_capture_sizes": sizes}
    if mode == "ddtree":
        spec = {"method": "ddtree", "model": f"{base}/drafter",
                "num_speculative_tokens": B, "ddtree_depth": L}
        if profile:
            spec["ddtree_synthetic"] = profile
        kw["speculative_config"] = spec
    elif mode == "dflash":  # the chain: a control for bf16 rounding differences
        kw["speculative_config"] = {"method": "dflash", "model": f"{base}/drafter",
                                    "num_speculative_tokens": L}
    if stats:
        os.environ["VLLM_DDTREE_STATS_FILE"] = stats
    else:
        os.environ.pop("VLLM_DDTREE_STATS_FILE", None)
    return LLM(**kw)


def count_tree_calls():
    import vllm.v1.spec_decode.ddtree.attention.triton_tree as ca

    orig = ca.tree_attention
    box = {"n": 0}

    def wrapped(*a, **k):
        box["n"] += 1
        return orig(*a, **k)

    ca.tree_attention = wrapped
    return box, lambda: setattr(ca, "tree_attention", orig)


def run(name, res, out_dir, base, toks, dtype, backend, mode, **kw):
    C.log("run", name)
    try:
        stats = os.path.join(out_dir, f"stats_{name}.json") if mode == "ddtree" else None
        llm = engine(base, dtype, backend, mode, stats=stats, **kw)
        box, undo = count_tree_calls()
        margins = mode == "nospec"
        got = C.generate(llm, toks, MAX_TOKENS, margins=margins)
        undo()
        res[name] = {"tokens": got[0], "seconds": got[1],
                     "eager_tree_attention_calls": box["n"]}
        if margins:
            res[name]["top2_gaps"] = got[2]
        if stats and os.path.exists(stats):
            with open(stats) as f:
                res[name]["walk"] = json.load(f)
        C.teardown(llm)
    except Exception:
        res[name] = {"error": traceback.format_exc()[-3000:]}
        C.log("FAILED", name, res[name]["error"][-800:])
    C.dump(os.path.join(out_dir, "equality.json"), res)


def write_profile(out_dir, tag, toks, ref) -> str:
    """The synthetic drafter's profile: the no-spec continuations of prompts 0-3 (the
    other prompts keep the real, random drafter)."""
    profile = os.path.join(out_dir, f"profile_{tag}.json")
    with open(profile, "w") as f:
        json.dump({"sequences": [p + o for p, o in zip(toks[:4], ref[:4])],
                   "rank_probs": [0.5, 0.25, 0.1], "seed": 0, "peak": 3.0}, f)
    return profile


def first_diffs(ref, got, gaps):
    """[prompt, first differing step, the no-spec top-1/top-2 logprob gap there]"""
    out = []
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            gap = gaps[i][j] if gaps and j < len(gaps[i]) else None
            out.append([i, j, None if gap is None else round(gap, 5)])
    return out


def tiny_setup(base="/tmp/eq_models"):
    """Write the tiny target + random DFlash drafter; return (base, the 8 prompts)."""
    cfg = C.qwen3_config(**TINY)
    C.write_target(f"{base}/target", cfg, random_weights=True, std=0.08)
    C.write_drafter(f"{base}/drafter", cfg, layers=1, target_layer_ids=[1, 2],
                    block_size=L + 1, mask_token_id=TINY["vocab_size"] - 1)
    return base, [C.prompts(1, 8 + 7 * i, 2, 1000, seed=i)[0] for i in range(N_PROMPTS)]


def plan(version: str) -> list[tuple]:
    """(tag, dtype, backend, reference runs eager, also run ddtree eager) per version.
    FA3 has no fp32: the fp32 rows use FLEX_ATTENTION (0.20.x) or TRITON_ATTN
    (0.32/0.33, whose V1 FA/Triton hooks are what is tested there)."""
    if version.startswith("0.20"):
        return [("fp32", "float32", "FLEX_ATTENTION", True, False),
                ("bf16", "bfloat16", "FLASH_ATTN", False, True)]
    return [("fp32_triton", "float32", "TRITON_ATTN", True, True),
            ("bf16_fa", "bfloat16", "FLASH_ATTN", False, True),
            ("bf16_triton", "bfloat16", "TRITON_ATTN", False, False)]


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    import vllm

    base, toks = tiny_setup()
    res = {"config": {"B": B, "L": L, "prompts": N_PROMPTS, "max_tokens": MAX_TOKENS,
                      "tiny": TINY, "vllm": vllm.__version__,
                      "runner_env": os.environ.get("VLLM_USE_V2_MODEL_RUNNER")}}
    rows = plan(vllm.__version__)
    tags = os.environ.get("EQ_TAGS", ",".join(r[0] for r in rows)).split(",")
    summary = {}
    for tag, dtype, backend, ref_eager, with_eager in rows:
        if tag not in tags:
            continue
        ref_name = f"{tag}_nospec_" + ("eager" if ref_eager else "graphs")
        run(ref_name, res, out_dir, base, toks, dtype, backend, "nospec", eager=ref_eager)
        ref = res[ref_name].get("tokens")
        profile = write_profile(out_dir, tag, toks, ref) if ref else None
        kinds = ["graphs"] + (["eager"] if with_eager else [])
        for kind in kinds:
            run(f"{tag}_ddtree_{kind}", res, out_dir, base, toks, dtype, backend, "ddtree",
                profile=profile, eager=kind == "eager")
        if dtype != "float32":  # is a difference bf16 rounding? the chain is the control
            run(f"{tag}_dflash_graphs", res, out_dir, base, toks, dtype, backend, "dflash")
        gaps = res[ref_name].get("top2_gaps")
        for name in [f"{tag}_ddtree_{k}" for k in kinds] + [f"{tag}_dflash_graphs"]:
            got = res.get(name, {}).get("tokens")
            if ref is None or got is None:
                continue
            same = [a == b for a, b in zip(ref, got)]
            summary[f"{name}_equals_nospec"] = all(same)
            summary[f"{name}_equal_prompts"] = sum(same)
            summary[f"{name}_first_diffs"] = first_diffs(ref, got, gaps)
        g = res.get(f"{tag}_ddtree_graphs", {}).get("tokens")
        e = res.get(f"{tag}_ddtree_eager", {}).get("tokens")
        if g and e:
            summary[f"{tag}_ddtree_graphs_equals_eager"] = g == e
    res["summary"] = summary
    C.dump(os.path.join(out_dir, "equality.json"), res)
    C.log("SUMMARY", json.dumps(summary))
    for k in res:
        if isinstance(res[k], dict) and "walk" in res[k]:
            C.log(k, "walk", json.dumps(res[k]["walk"]))
        if isinstance(res[k], dict) and "eager_tree_attention_calls" in res[k]:
            C.log(k, "eager tree-attention calls", res[k]["eager_tree_attention_calls"])


if __name__ == "__main__":
    main()
