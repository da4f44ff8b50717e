"""Greedy DDTree == no-spec on a Gated DeltaNet hybrid target on CUDA (vLLM 0.32/0.33,
patched), tiny random models.

    python3 bench/gpu/equality_gdn.py OUTDIR [--graphs] [--dtype float32|bfloat16]
                                      [--rows ddtree,ddtree_n1,...] [--budget 16]

The target is verify/tiny_hybrid.py's dense ``Qwen3_5ForCausalLM`` (3 GDN layers + 1
full-attention layer; the GPU bundle has no MoE kernels for Qwen3-Next), GDN prefill on
Triton/FLA (``additional_config={"gdn_prefill_backend": "triton"}``: the bundle has no
FlashInfer), TRITON_ATTN, prefix caching off.  8 prompts x 48 tokens.  Rows (one engine
each, in this process, one after the other):

  nospec         the reference (logprobs=2: the top-2 gap at a first difference)
  ddtree         V2 runner, B drafts at every batch size (ddtree_chain_budget 0), 8
                 requests at once; prompts 0-3 get the synthetic drafter (the
                 reference continuation at ranks drawn from [0.5, 0.25, 0.1]: deep
                 accepts and accepts through later siblings), the others a random one
  ddtree_n1 / _n2  the same with max_num_seqs 1 / 2 (1 and 2 concurrent requests)
  ddtree_default V2 with DDTree's default schedule (trees at 1-2 requests, chains from
                 3, the tree-vs-chain choice): chain steps through the tree GDN path
  ddtree_swa     V2 with a mixed [S,S,S,S,F] drafter (window 8)
  ddtree_eager   with --graphs: ddtree without graphs (graphs == eager)
  ddtree_v1      the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0)
  dflash         the DFlash chain (control; a bf16 difference the chain shows too is
                 rounding, not the tree)

Every difference is reported with the reference's top-1/top-2 gap at the first
differing token; only differences at gaps >= the tie threshold fail a row (fp32 1e-3;
bf16 0.25: two bf16 steps of a top logit in [16, 32), the tiny target's range: the
tree path computes the recurrence in another order than vLLM's chain kernel, so its
bf16 outputs round differently; the DFlash row is the control).  vLLM's FLA chunk
prefill refuses fp32, so GDN runs are bf16.  ddtree_eager is compared with the graphs
row too: the same kernels must give the same tokens (a stale buffer would not).  The engine must have run the tree GDN path: its GDN layers carry the
runtime's GDNTree, and the tree forward ran (counted).  Writes OUTDIR/equality_gdn.json
and prints a table; exit 0 = every row passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "verify"))
import common as C  # noqa: E402
import equality_v2 as E  # noqa: E402  (prompts, generate, compare, metrics, built)

ROWS = ("ddtree", "ddtree_n1", "ddtree_n2", "ddtree_default", "ddtree_swa", "ddtree_eager",
        "ddtree_v1", "dflash")
VS_GRAPHS = "ddtree_eager_vs_graphs"
N_PROMPTS = E.N_PROMPTS


def models(base: Path, depth: int) -> dict:
    import tiny_hybrid as TH

    t = TH.write_target(base / "target", arch="qwen3_5")
    d = TH.write_drafter(base / "drafter", t, kind="random", block_size=depth + 1)
    s = TH.write_drafter(base / "drafter_swa", t, kind="random", block_size=depth + 1,
                         num_hidden_layers=5, layer_types=E.SWA_TYPES, sliding_window=8)
    with open(t / "tiny_model.json") as f:
        mask = json.load(f)["mask_token_id"]
    return {"target": str(t), "drafter": str(d), "drafter_swa": str(s), "mask": mask}


def engine(a, m, row: str, eager: bool, drafter: str = "", profile: str = ""):
    from vllm import LLM

    seqs = {"ddtree_n1": 1, "ddtree_n2": 2}.get(row, N_PROMPTS)
    kw = dict(model=m["target"], skip_tokenizer_init=True, dtype=a.dtype, seed=0,
              max_model_len=512, max_num_seqs=seqs, attention_backend="TRITON_ATTN",
              enforce_eager=eager, disable_log_stats=False, enable_prefix_caching=False,
              additional_config={"gdn_prefill_backend": "triton"},
              kv_cache_memory_bytes=2 << 30, gpu_memory_utilization=0.5)
    ddtree = row.startswith("ddtree")
    if not eager:
        qs = {1 + a.budget, 1 + min(a.depth, a.budget - 1), 1 + a.budget // 2} if ddtree \
            else {1 + a.depth} if row == "dflash" else {1}
        sizes = sorted({k * q for q in qs for k in range(1, seqs + 1)})
        kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                    "cudagraph_capture_sizes": sizes}
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0" if row == "ddtree_v1" else "1"
    if ddtree:
        spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": a.budget,
                "ddtree_depth": a.depth}
        if profile:
            spec["ddtree_synthetic"] = profile
        if row != "ddtree_default":
            spec["ddtree_chain_budget"] = 0
        kw["speculative_config"] = spec
    elif row == "dflash":
        kw["speculative_config"] = {"method": "dflash", "model": drafter,
                                    "num_speculative_tokens": a.depth}
    return LLM(**kw)


def gdn_info(llm) -> dict:
    """Did the engine's GDN layers get the tree path, and how much state per request?"""
    try:
        r = C.runner_of(llm)
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)}
    ctx = r.compilation_config.static_forward_context
    layers = {n: l for n, l in ctx.items() if type(l).__name__.endswith("GatedDeltaNetAttention")}
    info = {"gdn_layers": len(layers)}
    if layers:
        one = next(iter(layers.values()))
        kv = getattr(one, "kv_cache", None)
        if isinstance(kv, (list, tuple)) and len(kv) == 2:
            info["conv_state"] = list(kv[0].shape)
            info["ssm_state"] = list(kv[1].shape)
        gdn = getattr(one, "ddtree_gdn", None)
        info["tree_path"] = gdn is not None
        if gdn is not None:
            info["stash_mib"] = round(gdn.stash_bytes() / 2**20, 2)
        info["num_spec"] = getattr(one, "num_spec", None)
        if isinstance(kv, (list, tuple)) and len(kv) == 2:
            info["state_dtypes"] = [str(kv[0].dtype), str(kv[1].dtype)]
    return info


def count_tree_gdn():
    try:
        import vllm.v1.spec_decode.ddtree.gdn.cuda as g
    except Exception:  # noqa: BLE001
        return {"n": None}, lambda: 0
    orig, box = g.GDNTree.forward, {"n": 0}

    def wrapped(self, *args, **kw):
        box["n"] += 1
        return orig(self, *args, **kw)

    g.GDNTree.forward = wrapped
    return box, lambda: setattr(g.GDNTree, "forward", orig)


def run(name, res, out, a, m, toks, eager, **kw):
    C.log("run", name)
    stats = str(out / f"stats_{name}.json")
    if name.startswith("ddtree"):
        os.environ["VLLM_DDTREE_STATS_FILE"] = stats
    else:
        os.environ.pop("VLLM_DDTREE_STATS_FILE", None)
    try:
        t0 = time.perf_counter()
        llm = engine(a, m, name, eager, **kw)
        r = {"startup_s": time.perf_counter() - t0, "built": E.built(llm)}
        box, undo = count_tree_gdn()
        try:
            r.update(E.generate(llm, toks, logprobs=name == "nospec"))
        finally:
            undo()
        r["gdn"] = gdn_info(llm)  # after the run: V1 attaches at its first step
        r["eager_tree_gdn_calls"] = box["n"]
        try:
            r["metrics"] = E.metrics(llm)
        except Exception as e:  # noqa: BLE001
            r["metrics"] = {"error": repr(e)}
        if os.path.exists(stats):
            r["walk"] = json.loads(Path(stats).read_text())
        C.teardown(llm)
    except Exception:  # noqa: BLE001
        r = {"error": traceback.format_exc()[-4000:]}
        C.log("FAILED", name, r["error"][-1500:])
    res[name] = r
    C.dump(str(out / "equality_gdn.json"), res)


def problems(name: str, r: dict, a) -> list[str]:
    bad = []
    g, b, w = r.get("gdn") or {}, r.get("built") or {}, r.get("walk") or {}
    if not g.get("gdn_layers"):
        bad.append(f"no GDN layers found: {g}")
    if name.startswith("ddtree"):
        if not g.get("tree_path"):
            bad.append("the GDN layers do not carry the tree path")
        if not w.get("trees") and name != "ddtree_default":
            bad.append("no tree was walked")
        v1 = name == "ddtree_v1"
        want = "GPUModelRunner" if v1 else "vllm.v1.worker.gpu.model_runner"
        if want not in str(b.get("runner", "")):
            bad.append(f"runner {b.get('runner')}")
        conv = g.get("conv_state") or [0, 0, 0]
        if min(conv[1:]) != 3:  # W - 1: no per-draft columns
            bad.append(f"conv state {conv} (one slot per request: W - 1 = 3 columns)")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--depth", type=int, default=7)
    ap.add_argument("--rows", default=",".join(r for r in ROWS if r != "dflash"))
    a = ap.parse_args(argv)
    tie = 1e-3 if a.dtype == "float32" else 0.25
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"GDN {a.dtype} TRITON_ATTN {'graphs' if a.graphs else 'eager'}"
    m = models(Path("/tmp/eq_gdn_models"), a.depth)
    toks = E.prompts(m["mask"])
    res: dict = {"config": {**vars(a), "tie_gap": tie, "prompts": toks}}
    run("nospec", res, out, a, m, toks, not a.graphs)
    ref = res["nospec"]
    profile = ""
    if "tokens" in ref:
        profile = str(out / "profile.json")
        Path(profile).write_text(json.dumps({
            "sequences": [p + o for p, o in zip(toks[:4], ref["tokens"][:4])],
            "rank_probs": [0.5, 0.25, 0.1], "seed": 0, "peak": 3.0}))
    wanted = [r for r in a.rows.split(",") if r]
    for name in wanted:
        if name not in ROWS:
            raise SystemExit(f"unknown row {name}: {ROWS}")
        if name == "ddtree_eager" and not a.graphs:
            continue
        drafter = m["drafter_swa"] if name == "ddtree_swa" else m["drafter"]
        run(name, res, out, a, m, toks, a.graphs is False or name == "ddtree_eager",
            drafter=drafter, profile=profile if name.startswith("ddtree") else "")
    rows, ok_all = [], True
    for name in ROWS:
        r = res.get(name)
        if r is None:
            continue
        if "tokens" not in r or "tokens" not in ref:
            rep, bad = None, ["error: " + (r.get("error") or ref.get("error", "?"))
                              .strip().splitlines()[-1][:200]]
        else:
            rep = E.compare(ref, r, tie)
            bad = problems(name, r, a) + [f"{len(rep['diffs'])} prompts differ"] * bool(
                rep["diffs"])
        r["compare"], r["problems"] = rep, bad
        ok_all &= not bad or name == "dflash"
        w = r.get("walk") or {}
        rows.append((f"{tag} {name}", f"{rep['equal'] if rep else '-'}/{N_PROMPTS}",
                     len(rep["ties"]) if rep else "-", len(rep["diffs"]) if rep else "-",
                     w.get("trees", "-"), w.get("accepted", "-"),
                     w.get("accepted_non_first_child", "-"), w.get("chain_steps", "-"),
                     r.get("eager_tree_gdn_calls", "-"),
                     f"{r.get('startup_s', 0):.0f}s",
                     ("PASS" if not bad else "FAIL") if name != "dflash" else "control"))
    g, e = res.get("ddtree"), res.get("ddtree_eager")
    if g and e and "tokens" in g and "tokens" in e:
        same = sum(x == y for x, y in zip(g["tokens"], e["tokens"]))
        ok_all &= same == N_PROMPTS
        rows.append((f"{tag} {VS_GRAPHS}", f"{same}/{N_PROMPTS}", "-", N_PROMPTS - same,
                     "-", "-", "-", "-", "-", "-", "PASS" if same == N_PROMPTS else "FAIL"))
    res["summary"] = {"pass": ok_all, "rows": rows}
    C.dump(str(out / "equality_gdn.json"), res)
    head = ("row", "equal", "ties", "diffs", "trees", "accepted", "non-first",
            "chain-steps", "eager-gdn", "start", "verdict")
    widths = [max(len(str(x[i])) for x in rows + [head]) for i in range(len(head))]
    print("\n" + "  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for row in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    for name in ("nospec",) + ROWS:
        r = res.get(name)
        if not r:
            continue
        print(f"\n[{name}] built: {json.dumps(r.get('built'))} gdn: {json.dumps(r.get('gdn'))}")
        for p in r.get("problems", []):
            print(f"[{name}] PROBLEM: {p}")
        for d in (r.get("compare") or {}).get("diffs", []):
            print(f"[{name}] DIFF prompt {d['prompt']} at token {d['pos']} (ref gap "
                  f"{d['ref_gap']}): ref {d['ref']} got {d['got']}")
        if r.get("error"):
            print(f"[{name}] ERROR:\n{r['error'][-2500:]}")
    print(f"\nRESULT {tag}: {'PASS' if ok_all else 'FAIL'}")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
