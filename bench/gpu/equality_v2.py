"""Greedy DDTree == no-spec on vLLM 0.32/0.33's V2 model runner (patched), tiny models.

    python3 bench/gpu/equality_v2.py OUTDIR [--attn TRITON_ATTN|FLASH_ATTN] [--graphs]
                                     [--dtype float32|bfloat16] [--budget 32] [--depth 7]

One configuration per call (attention backend x eager / FULL CUDA graphs).  Engines run
in this process one after the other (VLLM_ENABLE_V1_MULTIPROCESSING=0), all on the V2
runner (VLLM_USE_V2_MODEL_RUNNER=1):

  nospec        the reference (logprobs=2: the top-2 gap tells a near tie from a bug)
  ddtree        B=32, L=7, a random DFlash drafter; prompts 0-3 get the synthetic
                drafter (the reference continuation placed at ranks drawn from
                [0.5, 0.25, 0.1]: deep accepts and accepts through later siblings)
  ddtree_swa    the same with a mixed [S,S,S,S,F] drafter (window 8: several KV-cache
                groups, which forces V2 in stock vLLM)
  ddtree_eager  with --graphs only: the same as ddtree without graphs (sanity row:
                graphs == eager)
  ddtree_sync   with --sync-row: the same as ddtree with synchronous scheduling
                (async_scheduling=False); the other rows run DDTree's V2 default, async
                scheduling (run 6 proved it with the former --async-row)
  ddtree_per_batch  with --per-batch-row: the budget per batch size through vLLM's
                dynamic speculative decoding (B, B/2, B/4 for 1-2, 3-5, 6+ requests;
                a FULL graph per budget)
  ddtree_chain  with --chain-row: a budget per batch size whose large batches are
                chains (B, B/2, L for 1-2, 3-5, 6+ requests, ddtree_chain_budget = L):
                chain steps (the backend's causal kernel in their own FULL graphs, top-1
                drafts, no compaction) and tree steps in one run, as requests finish
  ddtree_default  with --default-row: DDTree's own V2 default (no schedule given:
                B for 1-2 requests, chain steps of L from 3 on, the tree-vs-chain
                controller at 1-2); the other rows pin ddtree_chain_budget (0: B for
                every batch size)
  ddtree_arms   with --arms-row: the controller at every batch size (schedule B for
                1-1024, chain L, ddtree_budget_control='auto') told to switch often
                (ddtree_arms="1,2"): tree and chain steps at the same batch sizes
  dflash        bfloat16 only: the DFlash chain (L drafts) as a control; a bf16
                difference the chain shows too is rounding, not the tree

Tiny models from verify/tiny_models.py (float32 checkpoints: Qwen3 target with the
"perm" structure, vocab 512).  FLASH_ATTN has no float32: its default dtype is
bfloat16, where a kernel change may flip a near tie; every difference is reported
with the reference's top-1/top-2 logprob gap at the first differing token, and only
differences at gaps >= the tie threshold count as failures (fp32: 1e-3, bf16: 0.05).

Prints a PASS/FAIL table and writes OUTDIR/equality_v2.json (tokens, first
differences, walk statistics from VLLM_DDTREE_STATS_FILE, which runner / speculator /
sampler / backends the engine built, eager tree-attention calls, errors).  Exit code
0 = every row passed, 1 = a row failed.  Expected time on an H200: 1-3 min.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "verify"))
import common as C  # noqa: E402  (sets the offline / in-process defaults)

N_PROMPTS, MAX_TOKENS = 8, 48
ROWS = ("nospec_again", "ddtree", "ddtree_swa", "ddtree_eager", "ddtree_sync", "ddtree_per_batch",
        "ddtree_chain", "ddtree_default", "ddtree_arms", "ddtree_features", "ddtree_grammar",
        "ddtree_json", "dflash")
SWA_TYPES = ["sliding_attention"] * 4 + ["full_attention"]


def models(base: Path, depth: int) -> dict:
    import tiny_models as T

    t = T.write_target(base / "target")
    d = T.write_drafter(base / "drafter", t, kind="random", block_size=depth + 1)
    s = T.write_drafter(base / "drafter_swa", t, kind="random", block_size=depth + 1,
                        num_hidden_layers=5, layer_types=SWA_TYPES, sliding_window=8)
    with open(t / "tiny_model.json") as f:
        mask = json.load(f)["mask_token_id"]
    return {"target": str(t), "drafter": str(d), "drafter_swa": str(s), "mask": mask}


def json_models(base: Path, depth: int) -> dict:
    """The same tiny target with a byte-level BPE tokenizer (it writes any text, JSON
    too) and a random drafter for it."""
    import tiny_models as T

    t = T.write_target(base / "target_bytes", tokenizer="bytes")
    d = T.write_drafter(base / "drafter_bytes", t, kind="random", block_size=depth + 1)
    with open(t / "tiny_model.json") as f:
        mask = json.load(f)["mask_token_id"]
    return {"target": str(t), "drafter": str(d), "mask": mask}


def prompts(mask: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(2, mask) for _ in range(4 + 5 * i)] for i in range(N_PROMPTS)]


def per_batch_schedule(b: int, chain: int = 0) -> list[list[int]]:
    return [[1, 2, b], [3, 5, max(1, b // 2)], [6, 1024, chain or max(1, b // 4)]]


def engine(a, m: dict, mode: str, eager: bool, drafter: str = "", profile: str = "",
           sync: bool = False, per_batch: bool = False, chain: int = 0,
           default: bool = False, arms: bool = False, tokenizer: bool = False,
           json_config: bool = False):
    from vllm import LLM

    kw = dict(model=m["target"], skip_tokenizer_init=not tokenizer, dtype=a.dtype, seed=0,
              max_model_len=512, max_num_seqs=N_PROMPTS, attention_backend=a.attn,
              enforce_eager=eager, disable_log_stats=False,
              # a fixed KV size: no memory profiling, so an engine that failed and is
              # still being freed cannot break the next one's start
              kv_cache_memory_bytes=2 << 30, gpu_memory_utilization=0.5)
    if json_config:  # the CPU tier's JSON settings (xgrammar, no free whitespace)
        kw["structured_outputs_config"] = _rq().JSON_CONFIG
    if not eager:  # the verify steps' shapes (1 + B per request) and the drafter's (1 + L)
        qs = {"ddtree": {1 + a.budget, 1 + min(a.depth, a.budget)},
              "dflash": {1 + a.depth}}.get(mode, {1})
        if per_batch:
            qs |= {1 + k for _, _, k in per_batch_schedule(a.budget, chain)}
        sizes = sorted({k * q for q in qs for k in range(1, N_PROMPTS + 1)})
        kw["compilation_config"] = {"mode": 0, "cudagraph_mode": a.cudagraph_mode,
                                    "cudagraph_capture_sizes": sizes}
    if mode == "ddtree":
        spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": a.budget,
                "ddtree_depth": a.depth}
        if profile:
            spec["ddtree_synthetic"] = profile
        kw["speculative_config"] = spec
        if per_batch and not default:
            spec["num_speculative_tokens_per_batch_size"] = per_batch_schedule(a.budget,
                                                                               chain)
        if arms:  # the controller everywhere, switching often
            spec.update(num_speculative_tokens_per_batch_size=[[1, 1024, a.budget]],
                        ddtree_budget_control="auto", ddtree_arms="1,2")
        if not default:  # 0: a fixed budget (no default budget per batch size)
            spec["ddtree_chain_budget"] = chain
        if sync:
            kw["async_scheduling"] = False
    elif mode == "dflash":
        kw["speculative_config"] = {"method": "dflash", "model": drafter,
                                    "num_speculative_tokens": a.depth}
    return LLM(**kw)


def built(llm) -> dict:
    """What the engine really runs: runner, speculator, sampler, backends."""
    try:
        r = C.runner_of(llm)
    except Exception as e:  # noqa: BLE001
        return {"error": f"runner not reachable: {e!r}"}
    spec = getattr(r, "speculator", None)
    info = {"runner": f"{type(r).__module__}.{type(r).__name__}",
            "speculator": type(spec).__name__ if spec is not None else None,
            "rejection_sampler": type(getattr(r, "rejection_sampler", None)).__name__,
            "ddtree_runtime": type(getattr(r, "ddtree", None)).__name__,
            "backends": sorted({g.backend.get_name() for gl in getattr(r, "attn_groups", [])
                                for g in gl})}
    if spec is not None:
        info["drafter_steps"] = getattr(spec, "num_speculative_steps", None)
        info["drafter_kv_groups"] = len(getattr(spec, "draft_kv_cache_group_ids", []) or [])
    cg = getattr(r, "cudagraph_manager", None)
    info["target_graphs"] = f"{getattr(cg, 'cudagraph_mode', None)}: " \
                            f"{len(getattr(cg, 'graphs', {}) or {})} captured"
    dg = getattr(spec, "query_cudagraph_manager", None)
    if dg is not None:
        info["drafter_graphs"] = f"{getattr(dg, 'cudagraph_mode', None)}: " \
                                 f"{len(getattr(dg, 'graphs', {}) or {})} captured"
    return info


def count_tree_calls():
    import vllm.v1.spec_decode.ddtree.attention.triton_tree as ca

    orig, box = ca.tree_attention, {"n": 0}

    def wrapped(*args, **kw):
        box["n"] += 1
        return orig(*args, **kw)

    ca.tree_attention = wrapped
    return box, lambda: setattr(ca, "tree_attention", orig)


def generate(llm, toks, logprobs: bool, params=None):
    """Greedy; ``params``: a SamplingParams per prompt (the features row: logprobs of
    every emitted token kept, to compare)."""
    from vllm import SamplingParams

    sp = params or SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                  detokenize=False, logprobs=2 if logprobs else None)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in toks], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    res = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": dt}
    if logprobs or params:
        res["gaps"] = [[_gap(step) for step in (o.outputs[0].logprobs or [])] for o in outs]
    if params:
        res["logprobs"] = [[{str(t): lp.logprob for t, lp in step.items()}
                            for step in (o.outputs[0].logprobs or [])] for o in outs]
    return res


def feature_params(vocab: int) -> list:
    """One request type per prompt (#32): penalties, logprobs, logit bias, allowed
    tokens, min_tokens; greedy, logprobs of every emitted token (bad words need a
    tokenizer: the CPU tier tests them, tests/engine/test_v2_requests.py)."""
    from vllm import SamplingParams

    def sp(**kw):
        kw.setdefault("logprobs", 2)
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                              detokenize=False, **kw)

    return [sp(presence_penalty=0.6, frequency_penalty=0.3), sp(repetition_penalty=1.4),
            sp(logprobs=5), sp(logit_bias={7: 4.0, 11: -3.0}),
            sp(allowed_token_ids=list(range(2, vocab // 2))),
            sp(min_tokens=MAX_TOKENS - 8, stop_token_ids=[3, 5]),
            sp(presence_penalty=0.4, logit_bias={9: 2.0}, repetition_penalty=1.2),
            sp(frequency_penalty=0.8, min_tokens=10, stop_token_ids=[4])]


def grammar_params() -> list:
    """One request per prompt (#32, the rows a tokenizer needs: the tiny target's words
    tokenizer, token i = "w<i>"): three regex grammars (one of period 3, whose node masks
    differ from a chain's), bad words, min_p; greedy."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    def sp(**kw):
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=True,
                              **kw)

    def regex(r):
        return sp(structured_outputs=StructuredOutputsParams(regex=r))

    return [regex("(w1[0-9]*)+"), regex("w2[0-9]*(w3[0-9]*w4[0-9]*)+"),
            regex("(w1[0-9]*w1[0-9]*w2[0-9]*)+"), regex("(w1[0-9]*)+"),
            sp(bad_words=["w7", "w11 w12"], ignore_eos=True), sp(min_p=0.2, ignore_eos=True),
            regex("(w1[0-9]*w1[0-9]*w2[0-9]*)+"), sp(ignore_eos=True)]


def _rq():
    """tests/engine/request_jobs.py: the CPU tier's JSON schema and settings."""
    sys.path.insert(0, str(HERE.parents[1] / "tests" / "engine"))
    import request_jobs

    return request_jobs


def json_params() -> list:
    """One JSON-schema request per prompt (#32; the CPU tier's schema: every field ends),
    greedy, long enough for a whole answer."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(json=_rq().JSON_SCHEMA)
    return [SamplingParams(temperature=0.0, max_tokens=_rq().JSON_GREEDY["max_tokens"],
                           detokenize=True, structured_outputs=so) for _ in range(N_PROMPTS)]


def params_row(tag, params, res, out, a, m, toks, **kw) -> None:
    """nospec_<tag>, then ddtree_<tag> with a synthetic drafter of no-spec's outputs,
    both with one SamplingParams per prompt (``params``)."""
    run(f"nospec_{tag}", res, out, a, m, toks, "nospec", not a.graphs, params=params, **kw)
    ref, profile = res[f"nospec_{tag}"], ""
    if "tokens" in ref:
        profile = str(out / f"profile_{tag}.json")
        Path(profile).write_text(json.dumps({
            "sequences": [p + o for p, o in zip(toks, ref["tokens"])],
            "rank_probs": [0.5, 0.25, 0.1], "seed": 0, "peak": 3.0}))
    run(f"ddtree_{tag}", res, out, a, m, toks, "ddtree", not a.graphs,
        drafter=m["drafter"], profile=profile, params=params, **kw)


def logprob_gap(ref: dict, got: dict) -> float:
    """Largest |logprob difference| over the tokens both runs report at the steps both
    emitted the same token (the features row; fp32 criterion 1e-4)."""
    worst = 0.0
    for rt, gt, rl, gl in zip(ref["tokens"], got["tokens"], ref.get("logprobs", []),
                              got.get("logprobs", [])):
        for k, (a, b) in enumerate(zip(rt, gt)):
            if a != b:
                break
            for t in set(rl[k]) & set(gl[k]):
                worst = max(worst, abs(rl[k][t] - gl[k][t]))
    return worst


COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts",
            "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
            "vllm:generation_tokens": "num_generation_tokens"}


def metrics(llm) -> dict:
    """vLLM's spec-decode counters (summed over label sets)."""
    out: dict = {}
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[COUNTERS[m.name]] = out.get(COUNTERS[m.name], 0) + int(getattr(m, "value", 0))
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in getattr(m, "values", [])]
            old = out.get("accepted_per_pos", [])
            out["accepted_per_pos"] = [(old[i] if i < len(old) else 0) +
                                       (vals[i] if i < len(vals) else 0)
                                       for i in range(max(len(old), len(vals)))]
    return out


def _gap(step) -> float:
    vals = sorted((lp.logprob for lp in step.values()), reverse=True)
    return float(vals[0] - vals[1]) if len(vals) > 1 else float("inf")


def run(name, res, out, a, m, toks, mode, eager, params=None, **kw):
    C.log("run", name)
    stats = str(out / f"stats_{name}.json")
    if mode == "ddtree":
        os.environ["VLLM_DDTREE_STATS_FILE"] = stats
    else:
        os.environ.pop("VLLM_DDTREE_STATS_FILE", None)
    try:
        t0 = time.perf_counter()
        llm = engine(a, m, mode, eager, **kw)
        r = {"startup_s": time.perf_counter() - t0, "built": built(llm)}
        box, undo = (count_tree_calls() if mode == "ddtree" else ({"n": None}, lambda: 0))
        try:
            r.update(generate(llm, toks, logprobs=mode == "nospec", params=params))
        finally:
            undo()
        r["eager_tree_attention_calls"] = box["n"]
        try:
            r["metrics"] = metrics(llm)
        except Exception as e:  # noqa: BLE001
            r["metrics"] = {"error": repr(e)}
        if mode == "ddtree" and os.path.exists(stats):
            r["walk"] = json.loads(Path(stats).read_text())
        C.teardown(llm)
    except Exception:  # noqa: BLE001
        r = {"error": traceback.format_exc()[-4000:]}
        C.log("FAILED", name, r["error"][-1500:])
    res[name] = r
    C.dump(str(out / "equality_v2.json"), res)


def compare(ref: dict, got: dict, tie: float) -> dict:
    """Per prompt: equal, near tie (first difference where the reference's top-2
    gap < tie) or a real difference, with the first differing position."""
    rep = {"equal": 0, "ties": [], "diffs": []}
    for i, (x, y) in enumerate(zip(ref["tokens"], got["tokens"])):
        if x == y:
            rep["equal"] += 1
            continue
        pos = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        gaps = ref.get("gaps", [[]] * len(ref["tokens"]))[i]
        gap = gaps[pos] if pos < len(gaps) else None
        d = {"prompt": i, "pos": pos, "ref_gap": gap, "ref": x[max(0, pos - 2): pos + 6],
             "got": y[max(0, pos - 2): pos + 6], "len": [len(x), len(y)]}
        (rep["ties"] if gap is not None and gap < tie else rep["diffs"]).append(d)
    return rep


def checks(name: str, r: dict, a) -> list[str]:
    """The engine must have run DDTree on the V2 runner (not silently something else)."""
    b = r.get("built", {})
    bad = []
    if not str(b.get("runner", "")).startswith("vllm.v1.worker.gpu.model_runner"):
        bad.append(f"runner {b.get('runner')}")
    if name.startswith("ddtree"):
        for k, want in (("speculator", "DDTreeSpeculator"),
                        ("rejection_sampler", "DDTreeV2Sampler"),
                        ("ddtree_runtime", "V2DDTree")):
            if b.get(k) != want:
                bad.append(f"{k} {b.get(k)}")
        if b.get("drafter_steps") != min(a.depth, a.budget):
            bad.append(f"drafter steps {b.get('drafter_steps')}")
        if name == "ddtree_swa" and (b.get("drafter_kv_groups") or 0) < 2:
            bad.append(f"drafter KV groups {b.get('drafter_kv_groups')} (mixed SWA: >= 2)")
        w = r.get("walk") or {}
        if not w.get("trees"):
            bad.append("no tree was walked")
        elif name == "ddtree_per_batch" and w.get("drafted", 0) > 0.75 * a.budget * w["trees"]:
            bad.append(f"budgets per batch size not applied: {w.get('drafted')} nodes in "
                       f"{w['trees']} trees")
        chains = ("ddtree_chain", "ddtree_default", "ddtree_arms")
        if name in chains and not w.get("chain_steps"):
            bad.append("no chain step ran (ddtree_chain_budget)")
        elif name not in chains and w.get("chain_steps"):
            bad.append(f"{w['chain_steps']} chain steps without ddtree_chain_budget")
        both = set(w.get("chain_steps_by_reqs", {})) & set(w.get("tree_steps_by_reqs", {}))
        if name == "ddtree_arms" and not both:
            bad.append(f"the controller never played both arms at one batch size: {w}")
        bad += metric_problems(r.get("metrics") or {}, w, min(a.depth, a.budget))
    if a.attn not in b.get("backends", []):
        bad.append(f"backends {b.get('backends')}")
    if a.graphs and name != "ddtree_eager":
        spec = not name.startswith("nospec")  # the references have no drafter
        for k in ("target_graphs", "drafter_graphs") if spec else ("target_graphs",):
            if str(b.get(k, "")).endswith(" 0 captured") or k not in b:
                bad.append(f"{k}: {b.get(k)} (FULL graphs expected)")
    return bad


def metric_problems(m: dict, w: dict, depth: int) -> list[str]:
    """vLLM's spec-decode counters must agree with the walk: accepted tokens = accepted
    tree nodes (minus what max_tokens cut), accepted_per_pos sums to them, and every
    emitted token is an accepted node or one bonus per request and step."""
    if "num_drafts" not in m:
        return [f"no spec-decode metrics: {m}"]
    bad = []
    acc, drafts = m["num_accepted_tokens"], m["num_drafts"]
    rows = w.get("trees", 0) + w.get("chain_rows", 0)  # chain steps' rows count too
    if not 0 < drafts <= rows or acc > w.get("accepted", 0) + w.get("chain_accepted", 0):
        bad.append(f"metrics {m} vs walk {w}")
    if sum(m.get("accepted_per_pos", [])) != acc:
        bad.append(f"accepted_per_pos {m.get('accepted_per_pos')} != {acc}")
    produced = acc + drafts + N_PROMPTS  # + the prefill's first token per request
    if not m["num_generation_tokens"] <= produced < m["num_generation_tokens"] + \
            N_PROMPTS * (depth + 1):
        bad.append(f"emitted {m['num_generation_tokens']} vs accepted + bonus {produced}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--attn", default="TRITON_ATTN", help="TRITON_ATTN or FLASH_ATTN")
    ap.add_argument("--graphs", action="store_true", help="FULL CUDA graphs (else eager)")
    ap.add_argument("--cudagraph-mode", default="FULL_DECODE_ONLY")
    ap.add_argument("--dtype", default=None, help="default: float32 (bfloat16 on FLASH_ATTN)")
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--depth", type=int, default=7)
    ap.add_argument("--sync-row", action="store_true",
                    help="also DDTree with synchronous scheduling (async_scheduling=False)")
    ap.add_argument("--per-batch-row", action="store_true",
                    help="also DDTree with a budget per batch size (dynamic SD)")
    ap.add_argument("--chain-row", action="store_true",
                    help="also DDTree with chains at large batches (ddtree_chain_budget)")
    ap.add_argument("--default-row", action="store_true",
                    help="also DDTree's default budget per batch size on V2")
    ap.add_argument("--arms-row", action="store_true",
                    help="also the tree-vs-chain controller at every batch size")
    ap.add_argument("--features-row", action="store_true",
                    help="also request features per prompt (#32: penalties, logprobs, "
                         "logit bias, allowed tokens, min_tokens) against no-spec")
    ap.add_argument("--grammar-row", action="store_true",
                    help="also structured outputs (three regex grammars), bad words and "
                         "min_p per prompt, with the target's words tokenizer (#32)")
    ap.add_argument("--json-row", action="store_true",
                    help="also JSON-schema structured outputs per prompt, with the target's "
                         "weights and a byte-level BPE tokenizer (#32)")
    ap.add_argument("--ref-twice", action="store_true",
                    help="run the no-spec reference twice: a row of its own says whether "
                         "the reference itself repeats (run 11 e: it did not at a 0.002 gap)")
    a = ap.parse_args(argv)
    a.dtype = a.dtype or ("bfloat16" if a.attn == "FLASH_ATTN" else "float32")
    tie = 1e-3 if a.dtype == "float32" else 0.05
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{a.dtype} {a.attn} {'graphs' if a.graphs else 'eager'}"
    C.log("configuration:", tag, f"B={a.budget} L={a.depth}")
    m = models(Path("/tmp/eq_v2_models"), a.depth)
    toks = prompts(m["mask"])
    res: dict = {"config": {**vars(a), "tie_gap": tie, "prompts": toks,
                            "max_tokens": MAX_TOKENS}}
    run("nospec", res, out, a, m, toks, "nospec", not a.graphs)
    if a.ref_twice:  # compared with the first like any row: a reference that moves fails
        run("nospec_again", res, out, a, m, toks, "nospec", not a.graphs)
    ref = res["nospec"]
    profile = ""
    if "tokens" in ref:
        profile = str(out / "profile.json")
        Path(profile).write_text(json.dumps({
            "sequences": [p + o for p, o in zip(toks[:4], ref["tokens"][:4])],
            "rank_probs": [0.5, 0.25, 0.1], "seed": 0, "peak": 3.0}))
    run("ddtree", res, out, a, m, toks, "ddtree", not a.graphs, drafter=m["drafter"],
        profile=profile)
    run("ddtree_swa", res, out, a, m, toks, "ddtree", not a.graphs,
        drafter=m["drafter_swa"], profile=profile)
    if a.graphs:
        run("ddtree_eager", res, out, a, m, toks, "ddtree", True, drafter=m["drafter"],
            profile=profile)
    if a.sync_row:
        run("ddtree_sync", res, out, a, m, toks, "ddtree", not a.graphs,
            drafter=m["drafter"], profile=profile, sync=True)
    if a.per_batch_row:
        run("ddtree_per_batch", res, out, a, m, toks, "ddtree", not a.graphs,
            drafter=m["drafter"], profile=profile, per_batch=True)
    if a.chain_row:
        run("ddtree_chain", res, out, a, m, toks, "ddtree", not a.graphs,
            drafter=m["drafter"], profile=profile, per_batch=True,
            chain=min(a.depth, a.budget))
    if a.default_row:
        run("ddtree_default", res, out, a, m, toks, "ddtree", not a.graphs,
            drafter=m["drafter"], profile=profile, default=True,
            per_batch=True, chain=min(a.depth, a.budget - 1))  # (capture sizes only)
    if a.arms_row:
        run("ddtree_arms", res, out, a, m, toks, "ddtree", not a.graphs,
            drafter=m["drafter"], profile=profile, arms=True,
            chain=min(a.depth, a.budget - 1))
    if a.features_row:  # its own reference: no-spec with the same request features
        params_row("features", feature_params(m["mask"] + 1), res, out, a, m, toks)
    if a.grammar_row:  # the same with the target's words tokenizer
        params_row("grammar", grammar_params(), res, out, a, m, toks, tokenizer=True)
    if a.json_row:  # the same with a byte-level BPE tokenizer
        params_row("json", json_params(), res, out, a, json_models(
            Path("/tmp/eq_v2_models"), a.depth), toks, tokenizer=True, json_config=True)
    if a.dtype != "float32":
        run("dflash", res, out, a, m, toks, "dflash", not a.graphs, drafter=m["drafter"])

    rows, ok_all = [], True
    for name in ROWS:
        if name not in res:
            continue
        r = res[name]
        base = res["ddtree"] if name == "ddtree_eager" else \
            res.get("nospec_features", {}) if name == "ddtree_features" else \
            res.get("nospec_grammar", {}) if name == "ddtree_grammar" else \
            res.get("nospec_json", {}) if name == "ddtree_json" else ref
        if "tokens" not in r or "tokens" not in base:
            rep, bad = None, ["error: " + (r.get("error") or base.get("error", "?"))
                              .strip().splitlines()[-1][:200]]
        else:
            if name == "ddtree_eager":  # graphs vs eager: the ddtree run holds no gaps
                base = dict(base, gaps=ref.get("gaps", []))
            rep = compare(base, r, tie)
            bad = checks(name, r, a) + [f"{len(rep['diffs'])} prompts differ"] * bool(
                rep["diffs"])
            if name == "ddtree_features":
                r["logprob_max_diff"] = gap = logprob_gap(base, r)
                if gap > (1e-4 if a.dtype == "float32" else 0.05):
                    bad.append(f"logprobs differ by up to {gap:.2e}")
        r["compare"], r["problems"] = rep, bad
        ok_all &= not bad or name == "dflash"  # the control informs, it cannot fail
        w = r.get("walk") or {}
        rows.append((f"{tag} {name}" + (" vs ddtree(graphs)" if name == "ddtree_eager"
                                         else " vs nospec"),
                     f"{rep['equal'] if rep else '-'}/{N_PROMPTS}",
                     len(rep["ties"]) if rep else "-", len(rep["diffs"]) if rep else "-",
                     w.get("trees", "-"), w.get("accepted", "-"),
                     w.get("accepted_non_first_child", "-"), w.get("max_accepted", "-"),
                     w.get("chain_steps", "-"),
                     r.get("eager_tree_attention_calls", "-"),
                     ("PASS" if not bad else "FAIL") if name != "dflash"
                     else "control"))
    res["summary"] = {"pass": ok_all, "rows": rows}
    C.dump(str(out / "equality_v2.json"), res)

    head = ("row", "equal", "ties", "diffs", "trees", "accepted", "non-first", "max-acc",
            "chain-steps", "eager-tree", "verdict")
    widths = [max(len(str(x[i])) for x in rows + [head]) for i in range(len(head))]
    print("\n" + "  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for row in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    for name in ("nospec",) + ROWS:
        r = res.get(name)
        if not r:
            continue
        print(f"\n[{name}] built: {json.dumps(r.get('built'))}")
        if r.get("walk"):
            print(f"[{name}] walk: {json.dumps(r['walk'])}")
        for p in r.get("problems", []):
            print(f"[{name}] PROBLEM: {p}")
        for d in (r.get("compare") or {}).get("diffs", []):
            print(f"[{name}] DIFF prompt {d['prompt']} at token {d['pos']} (ref gap "
                  f"{d['ref_gap']}): ref {d['ref']} got {d['got']} lens {d['len']}")
        for d in (r.get("compare") or {}).get("ties", []):
            print(f"[{name}] near tie: prompt {d['prompt']} at token {d['pos']} "
                  f"(gap {d['ref_gap']:.2e})")
        if r.get("error"):
            print(f"[{name}] ERROR:\n{r['error'][-2500:]}")
    print(f"\nRESULT {tag}: {'PASS' if ok_all else 'FAIL'}  ({out / 'equality_v2.json'})")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
