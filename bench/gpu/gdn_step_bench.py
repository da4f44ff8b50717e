"""Step time and state memory of DDTree vs the DFlash chain on the Qwen3.6-27B shape (a
Gated DeltaNet hybrid) on the H200, patched vLLM 0.32 / 0.33, V2 runner.

Target: dense ``Qwen3_5ForCausalLM`` with Qwen3.6-27B's sizes (64 layers: 48 GDN + 16
full attention, hidden 5120, 48 value / 16 key heads of 128, vocab 248320),
``load_format="dummy"``, bf16, TRITON_ATTN, GDN prefill on Triton/FLA (the bundle has
no FlashInfer), prefix caching off, FULL decode graphs (mode 0, capture sizes = the
verify shapes).  Drafter: Qwen3.6-27B-DFlash's layout (5 layers [S, S, S, S, F],
window 2048, block 16, target layers [1, 16, 31, 46, 61]) with random weights, so
acceptance is ~0 and every step verifies its full budget: a step's cost, not its gain.

    python3 bench/gpu/gdn_step_bench.py OUT_DIR [CONFIG ...] [--batches 1,2,4]
    CONFIG: nospec | dflash (chain k = 15) | ddtree<B> (a tree of B at every batch size) |
            ddtreechain (DDTree's chain step: 15 drafts at every batch size)

Per config and batch N (one engine per config, N random 512-token prompts): the step
time = (wall of max_tokens = 1 + S) - (wall of max_tokens = 1), over S steps, median of
--rounds; the engine's KV blocks and the GDN state it keeps per request (one slot under
DDTree, 1 + k under the chain).  Prints a table and writes OUT_DIR/gdn_step_bench.json.
No timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "verify"))
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
import common as C  # noqa: E402

BASE = "/tmp/gdn27b_models"
PROMPT, STEPS, L = 512, 48, 15
QWEN36_27B = dict(arch="qwen3_5", vocab_size=248320, hidden_size=5120,
                  intermediate_size=17408,
                  layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16,
                  num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                  linear_num_key_heads=16, linear_num_value_heads=48,
                  linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, max_position_embeddings=262144,
                  rope_theta=10_000_000.0, bos_token_id=0, eos_token_id=1)
DRAFTER = dict(layers=5, target_layer_ids=[1, 16, 31, 46, 61], block_size=16,
               mask_token_id=248077, window=2048, heads=32, kv_heads=8, head_dim=128)


def make_models() -> None:
    import tiny_hybrid as TH

    os.makedirs(f"{BASE}/target", exist_ok=True)
    cfg = TH.hybrid_config({**TH.HYBRID_DEFAULTS, **QWEN36_27B}).to_dict()
    cfg["torch_dtype"] = "bfloat16"
    with open(f"{BASE}/target/config.json", "w") as f:
        json.dump(cfg, f, indent=1)
    if os.path.exists(f"{BASE}/drafter/model.safetensors"):
        return
    d = DRAFTER
    q3 = C.qwen3_config(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                        intermediate_size=cfg["intermediate_size"],
                        num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
                        num_key_value_heads=d["kv_heads"], head_dim=d["head_dim"],
                        max_position_embeddings=262144)
    C.write_drafter(f"{BASE}/drafter", q3, d["layers"], d["target_layer_ids"],
                    d["block_size"], d["mask_token_id"], std=0.02)
    path = f"{BASE}/drafter/config.json"
    dc = json.loads(Path(path).read_text())
    dc.update(layer_types=["sliding_attention"] * 4 + ["full_attention"],
              use_sliding_window=True, sliding_window=d["window"], max_window_layers=5)
    Path(path).write_text(json.dumps(dc, indent=1))


def parse(cfg: str) -> dict:
    if cfg == "nospec":
        return {"kind": "nospec", "q": 1}
    if cfg == "dflash":
        return {"kind": "dflash", "q": 1 + L}
    if cfg.startswith("ddtree") and cfg[6:].isdigit():
        b = int(cfg[6:])
        return {"kind": "ddtree", "b": b, "q": 1 + b}
    if cfg == "ddtreechain":  # DDTree's chain step: L drafts, ddtree_chain_budget = L
        return {"kind": "ddtree", "b": L + 1, "q": 1 + L, "chain": L}
    raise SystemExit(f"unknown config {cfg!r}: nospec | dflash | ddtree<B> | ddtreechain")


def engine(spec: dict, batches: list[int]):
    from vllm import LLM
    from vllm.config import LoadConfig

    qs = {spec["q"]}
    if spec["kind"] == "ddtree":
        qs.add(1 + min(L, spec["b"]))  # the drafter's graphs: 1 + L per request
    sizes = sorted({n * q for q in qs for n in range(1, max(batches) + 1)})
    kw = dict(model=f"{BASE}/target", load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", seed=0, max_model_len=2048, max_num_seqs=max(batches),
              max_num_batched_tokens=max(batches) * PROMPT + 512,
              gpu_memory_utilization=0.8, attention_backend="TRITON_ATTN",
              enable_prefix_caching=False,
              additional_config={"gdn_prefill_backend": "triton"},
              compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                  "cudagraph_capture_sizes": sizes})
    if spec["kind"] != "nospec":
        sc = {"model": f"{BASE}/drafter",
              "draft_load_config": LoadConfig(load_format="safetensors")}
        if spec["kind"] == "dflash":
            sc.update(method="dflash", num_speculative_tokens=L)
        else:
            sc.update(method="ddtree", num_speculative_tokens=spec["b"], ddtree_depth=L,
                      ddtree_chain_budget=spec.get("chain", 0))
            if spec.get("chain"):  # every batch size verifies a chain of L
                sc["num_speculative_tokens_per_batch_size"] = [[1, 1024, spec["chain"]]]
        kw["speculative_config"] = sc
    return LLM(**kw)


def memory(llm) -> dict:
    """KV blocks of the engine and the recurrent state one GDN layer keeps."""
    out = {}
    try:
        out["num_gpu_blocks"] = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    except Exception as e:  # noqa: BLE001
        out["num_gpu_blocks"] = repr(e)
    try:
        r = C.runner_of(llm)
        ctx = r.compilation_config.static_forward_context
        layers = [x for x in ctx.values()
                  if type(x).__name__.endswith("GatedDeltaNetAttention")]
        out["gdn_layers"] = len(layers)
        kv = layers[0].kv_cache
        out["conv_state"], out["ssm_state"] = list(kv[0].shape), list(kv[1].shape)
        per_slot = sum(t[0].numel() * t.element_size() for t in kv)
        out["state_mib_per_slot_all_layers"] = round(per_slot * len(layers) / 2**20, 1)
        gdn = getattr(layers[0], "ddtree_gdn", None)
        if gdn is not None:
            out["tree_path"] = True
            out["stash_mib"] = round(gdn.stash_bytes() / 2**20, 1)
    except Exception as e:  # noqa: BLE001
        out["error"] = repr(e)
    return out


def step_ms(llm, n: int, rounds: int) -> dict:
    toks = C.prompts(n, PROMPT, 2, 248000, seed=n)
    C.generate(llm, toks, 1 + STEPS)  # warm-up
    walls = []
    for _ in range(rounds):
        _, t1 = C.generate(llm, toks, 1)
        _, t2 = C.generate(llm, toks, 1 + STEPS)
        walls.append((t2 - t1) / STEPS * 1000)
    return {"median_ms": round(statistics.median(walls), 3),
            "min_ms": round(min(walls), 3), "max_ms": round(max(walls), 3),
            "rounds": rounds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("configs", nargs="*", default=["nospec", "dflash", "ddtree32",
                                                   "ddtree64"])
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    batches = [int(x) for x in a.batches.split(",")]
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    make_models()
    res: dict = {"config": {**vars(a), "prompt": PROMPT, "steps": STEPS}}
    for name in a.configs:
        spec = parse(name)
        C.log("engine", name)
        r: dict = {}
        try:
            t0 = time.perf_counter()
            llm = engine(spec, batches)
            r["startup_s"] = round(time.perf_counter() - t0, 1)
            r["memory"] = memory(llm)
            for n in batches:
                r[f"n{n}"] = step_ms(llm, n, a.rounds)
                C.log(name, n, r[f"n{n}"])
            C.teardown(llm)
        except Exception:  # noqa: BLE001
            r["error"] = traceback.format_exc()[-3000:]
            C.log("FAILED", name, r["error"][-1500:])
        res[name] = r
        C.dump(str(out / "gdn_step_bench.json"), res)
    chain = res.get("dflash", {})
    print("\nconfig     batch  step ms (min-max)       vs dflash  start  KV blocks  "
          "GDN state MiB per slot")
    for name in a.configs:
        r = res.get(name, {})
        for n in batches:
            s = r.get(f"n{n}")
            if not s:
                continue
            c = chain.get(f"n{n}", {}).get("median_ms")
            ratio = f"{s['median_ms'] / c:.3f}" if c else "-"
            m = r.get("memory", {})
            print(f"{name:<10} {n:>5}  {s['median_ms']:7.2f} ({s['min_ms']:.2f}-"
                  f"{s['max_ms']:.2f})  {ratio:>9}  {r.get('startup_s', 0):5.0f}s  "
                  f"{m.get('num_gpu_blocks', '-'):>9}  "
                  f"{m.get('state_mib_per_slot_all_layers', '-')} (conv {m.get('conv_state')})")
        if r.get("error"):
            print(f"[{name}] ERROR: {r['error'].strip().splitlines()[-1][:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
