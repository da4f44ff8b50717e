"""Step time (chain k=15 vs DDTree B) and end-to-end tokens/s on the H200 with real
(patched) vLLM 0.20.2.

Target: Qwen3-8B shape, load_format="dummy", bf16, FLASH_ATTN (FA3; DFlash needs a
non-causal backend), CUDA graphs: cudagraph_mode FULL_DECODE_ONLY without torch.compile
(mode 0), capture sizes = the verify shapes N * (1 + K) (a uniform verify step replays
one FULL graph; for DDTree that graph holds the tree-attention kernel).  Drafter:
DFlash-b16 shape (5 layers, target_layer_ids [1, 9, 17, 25, 33], block 16 -> L = 15)
with random safetensors written here (draft_load_config: safetensors).

(b) step time: N random prompts of 512 tokens, 48 new tokens, random drafter
    (acceptance ~0, so every step is a full verify); 32 new tokens.  Per uniform verify step: wall time
    between consecutive execute_model starts (median), and CUDA-event spans of the
    phases: verify forward (target), sample (DDTree: logits gather + tree walk; chain:
    rejection sampler), commit (DDTree: positions back, path rows first, KV
    compaction), draft (drafter pass incl. tree build), tree build, walk, prepare.
(c) end-to-end: after (b), in the same engine, the target is rewired so that its greedy
    next token is pi(current token) for a fixed random permutation pi (o_proj and
    down_proj zeroed, final norm 1, lm_head = permuted embeddings: same shapes, same
    cost) and the drafter's logits are replaced by calibrated synthetic ones: at depth d
    the drafter gives probability p_k to its k-th token and the true token pi^d(bonus)
    sits at a rank drawn from that same profile p.  Chain = argmax per depth,
    DDTree = the best tree of B.  Tokens/s over 128 new tokens (all profiles at batch 1,
    p80 at the other BENCH_E2E_BATCHES; BENCH_E2E_ALL=1: every profile at every batch),
    tau = tokens / steps,
    and every output is checked against the pi-chain (lossless).
(BENCH_TPROFILE=1: after (b) at each batch, the decode step's device time by kernel,
kernel_prof.py: kernels_<config>_N<n>.json; compare configs with kernel_prof.py A B.)

    python bench/gpu/step_bench.py OUT_DIR CONFIG [CONFIG ...]
    CONFIG: nospec | chain15 | chain15async |
            ddtree<B>[pb|chain|auto|every][warm][kt][bg|nobg][cg|nocg][async][split][argmax]
    (pb: budget B, B/2, B/4 for batches of 1, 2-3, 4+ through vLLM's dynamic speculative
    decoding; chain: budget B for 1-2 requests, a
    chain of L = 15 from 3 on, ddtree_chain_budget = 15, fixed, V2 only; auto: nothing
    pinned, DDTree's V2 default (config.default_schedule: B = 64 verifies 63 at 1-2
    requests after run 23; in runs up to 23 64 at 1, 32 at 2), chains of min(L, B - 1)
    from 3 on, and at 1-2 requests the tree or the chain by tokens/s, arms.py; every: B
    at every batch size, the tree or the chain of min(L, B - 1) by tokens/s at each; the chain
    arm's own draft graphs follow the default (on) unless nocg (ddtree_chain_graphs=0)
    or cg (=1); warm: before each timed e2e cell an untimed run of it on other prompts, so the choice is
    timed in its steady state instead of its start; kt: the choice keeps its step
    times from one cell to the next (a running server), its counts start afresh; the tree build replayed from its
    own CUDA graphs follows the default (on) unless nobg (ddtree_build_graphs=0) or
    bg (=1); split: the drafter's top-K select over several programs,
    core/vocab_topk_split.py; argmax: the greedy walk's target argmax in Triton,
    core/row_argmax.py; both set in this process before the engine starts)

With VLLM_USE_V2_MODEL_RUNNER=1 the engines run on the V2 runner (vLLM 0.32/0.33's GPU
default; DDTree follows it there): the same step walls, spans hooked on V2's own
methods (verify forward = the FULL-graph replay, sample, draft = speculator.propose,
which on V2 includes the commit and the tree build), drafter graphs captured for
1 + L queries per request.  ddtree<B>async runs with async scheduling (V2 only;
DDTree's default there), ddtree<B> pins synchronous scheduling.  (c) on V2: the
synthetic distributions enter after the drafter's graph (use_synthetic_v2; run 7).
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
import torch  # noqa: E402

BATCHES = [int(x) for x in os.environ.get("BENCH_BATCHES", "1,4,16,32").split(",")]
E2E_BATCHES = [int(x) for x in os.environ.get("BENCH_E2E_BATCHES", "1,16").split(",") if x]
E2E_ALL = os.environ.get("BENCH_E2E_ALL") == "1"  # every profile at every e2e batch
PROMPT, NEW = 512, 32
E2E_NEW = int(os.environ.get("BENCH_E2E_NEW", "128"))  # tokens per request, end to end
# rand: the random drafter itself (acceptance ~0; first, before any synthetic hook);
# pNN: the calibrated synthetic drafter (FastSynthetic) with these rank probabilities
PROFILES = {"rand": None, "p60": [0.6, 0.15, 0.08, 0.05], "p80": [0.8, 0.1, 0.04],
            "p90": [0.9, 0.05, 0.02]}
L = 15
# BENCH_SHAPE=qwen36_27b: the Qwen3.6-27B-shaped GDN hybrid of gdn_step_bench.py (TRITON_ATTN,
# Triton GDN prefill, its [S,S,S,S,F] drafter) instead of the Qwen3-8B shape
GDN = os.environ.get("BENCH_SHAPE", "qwen3_8b") == "qwen36_27b"
BASE = "/tmp/gdn27b_models" if GDN else "/tmp/bench_models"
GPU_UTIL = float(os.environ.get("BENCH_GPU_UTIL", "0.8"))  # the 27B shape (0.9 on 80 GB)
V2 = os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1"


def parse(cfg: str):
    if cfg == "nospec":
        return dict(kind="nospec", k=0)
    if cfg.startswith("chain"):
        return dict(kind="chain", k=15, async_sched=cfg.endswith("async"))
    if cfg.startswith("ddtree"):
        rest = cfg[6:]
        argmax = rest.endswith("argmax")  # the walk's argmax in Triton (row_argmax.AUTO)
        rest = rest[:-6] if argmax else rest
        split = rest.endswith("split")  # vocab_topk's select stage spread (AUTO_SELECT)
        rest = rest[:-5] if split else rest
        asy = rest.endswith("async")
        rest = rest[:-5] if asy else rest
        # the chain arm's own draft graphs (v2_chain_graphs.py): on by default; nocg
        # turns them off, cg pins them on
        cg = "0" if rest.endswith("nocg") else "1" if rest.endswith("cg") else None
        rest = rest[:-4] if cg == "0" else rest[:-2] if cg else rest
        # the tree build's own graphs: the default (on) unless nobg, bg pins them on
        bg = "0" if rest.endswith("nobg") else "1" if rest.endswith("bg") else None
        rest = rest[:-4] if bg == "0" else rest[:-2] if bg else rest
        # kt: the choice keeps its step times from cell to cell (a running server
        # meeting new text), its counts start afresh
        kt = rest.endswith("kt")
        rest = rest[:-2] if kt else rest
        # warm: the choice keeps what an untimed whole run of the cell taught it
        warm = rest.endswith("warm")
        rest = rest[:-4] if warm else rest
        # every: B at every batch size, the tree or the chain of min(L, B - 1) by
        # tokens/s at each (arms.py): the schedule to try where B <= C + 1 (#29)
        every = rest.endswith("every")
        rest = rest[:-5] if every else rest
        pb = rest.endswith("pb")  # budget per batch size: B, B/2, B/4 for 1, 2-3, 4+
        chain = rest.endswith("chain")  # B for 1-2 requests, a chain of L from 3 on
        auto = rest.endswith("auto")  # DDTree's V2 default: that, tree vs chain at 1-2
        k = int(rest[:-5] if chain else rest[:-4] if auto else rest[:-2] if pb else rest)
        sched = [[1, 1, k], [2, 3, max(1, k // 2)], [4, 1024, max(1, k // 4)]] if pb else \
            [[1, 2, k], [3, 1024, min(L, k)]] if chain else \
            auto_schedule(k, min(L, k - 1)) if auto else [[1, 1 << 16, k]] if every else None
        return dict(kind="ddtree", k=k, async_sched=asy, per_batch=sched, auto=auto,
                    every=every,
                    chain=min(L, k) if chain else min(L, k - 1) if auto or every else 0, cg=cg,
                    warm=warm, bg=bg, kt=kt, split=split, argmax=argmax)
    raise ValueError(cfg)


def auto_schedule(k: int, c: int) -> list:
    """DDTree's V2 default schedule for budget k and chain c, read from this checkout's
    payload (config.default_schedule; the package imports no vLLM)."""
    import importlib
    import importlib.util

    pkg = "ddtree_payload_bench"
    if pkg not in sys.modules:
        where = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                             "patches", "ddtree", "payload")
        spec = importlib.util.spec_from_file_location(
            pkg, os.path.join(where, "__init__.py"), submodule_search_locations=[where])
        sys.modules[pkg] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[pkg])
    return importlib.import_module(f"{pkg}.config").default_schedule(k, c)


def budget_at(spec: dict, n: int) -> int:
    """The verify budget of a batch of n requests (per_batch: vLLM's schedule)."""
    for lo, hi, b in spec.get("per_batch") or []:
        if lo <= n <= hi:
            return min(b, spec["k"])
    return spec["k"]


def make_models():
    if GDN:
        import gdn_step_bench

        return gdn_step_bench.make_models()
    cfg = C.qwen3_config(**C.QWEN3_8B)
    C.write_target(f"{BASE}/target", cfg, random_weights=False)
    if not os.path.exists(f"{BASE}/drafter/model.safetensors"):
        d = C.DFLASH_B16
        C.write_drafter(f"{BASE}/drafter", cfg, d["layers"], d["target_layer_ids"],
                        d["block_size"], d["mask_token_id"], std=0.02)


def engine(spec: dict, **llm_kw):
    """llm_kw: more LLM arguments, or ones that replace this bench's (tp_equality.py:
    tensor parallelism; startup_bench.py: max_num_seqs and vLLM's default capture sizes)."""
    from vllm import LLM
    from vllm.config import LoadConfig

    k = spec["k"]
    # every batch size up to the largest end-to-end one: a draining batch then replays
    # its own graphs (with only 1/4/16/32, a tree step at 2 requests replays the graph
    # captured for 4)
    batches = sorted(set(BATCHES + list(range(1, max(E2E_BATCHES, default=0) + 1))))
    sizes = [n * (1 + k) for n in batches]
    if V2 and spec["kind"] == "ddtree":  # V2 captures the drafter: 1 + L per request
        sizes = sorted(set(sizes + [n * (1 + min(L, k)) for n in batches]))
    if spec.get("per_batch"):  # a FULL graph per budget
        sizes = sorted(set(sizes + [n * (1 + b) for n in batches for _, _, b in spec["per_batch"]]))
    kw = dict(model=f"{BASE}/target", load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", seed=0, max_model_len=2048, max_num_seqs=max(BATCHES + E2E_BATCHES),
              max_num_batched_tokens=max(BATCHES + E2E_BATCHES) * PROMPT + 512,
              gpu_memory_utilization=0.3, attention_backend="FLASH_ATTN",
              compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                  "cudagraph_capture_sizes": sizes})
    if GDN:  # as gdn_step_bench.py runs it (54 GB of weights; the bundle has no FlashInfer)
        kw.update(attention_backend="TRITON_ATTN", gpu_memory_utilization=GPU_UTIL,
                  enable_prefix_caching=False,
                  additional_config={"gdn_prefill_backend": "triton"})
    if spec["kind"] != "nospec":
        sc = {"model": f"{BASE}/drafter", "num_speculative_tokens": k,
              "draft_load_config": LoadConfig(load_format="safetensors")}
        if spec["kind"] == "ddtree":
            sc.update(method="ddtree", ddtree_depth=L)
            # the payload as installed; the engine runs in this process
            # (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the module setting reaches it
            if (spec.get("split") or spec.get("argmax")) and \
                    os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
                raise ValueError("...split / ...argmax configs need "
                                 "VLLM_ENABLE_V1_MULTIPROCESSING=0")
            core = "vllm.v1.spec_decode.ddtree.core"
            importlib.import_module(f"{core}.vocab_topk").AUTO_SELECT = \
                "split" if spec.get("split") else "one"
            importlib.import_module(f"{core}.row_argmax").AUTO = \
                "triton" if spec.get("argmax") else "torch"
            if spec.get("auto"):  # nothing pinned: DDTree's V2 default
                if not V2:
                    raise ValueError("ddtree<B>auto is DDTree's V2 default: V2 only")
            elif spec.get("every"):  # the user's schedule under the arms (C = min(L, B - 1))
                if not V2:
                    raise ValueError("ddtree<B>every chooses by arms: V2 only")
                sc["num_speculative_tokens_per_batch_size"] = spec["per_batch"]
                sc["ddtree_budget_control"] = "auto"
            elif spec.get("per_batch"):
                sc["num_speculative_tokens_per_batch_size"] = spec["per_batch"]
            if V2 and not spec.get("auto") and not spec.get("every"):  # pinned: 0 = B always
                sc["ddtree_chain_budget"] = spec.get("chain", 0)
            # pinned either way: on V2 DDTree keeps vLLM's async default unless told not to
            asy = bool(spec.get("async_sched"))
            # the chain arm's draft graphs (cg / nocg) and the tree build's graphs (bg /
            # nobg): config keys of the V2 runner, its defaults when not pinned
            if spec.get("cg") is not None:
                sc["ddtree_chain_graphs"] = spec["cg"]
            if spec.get("bg") is not None:
                sc["ddtree_build_graphs"] = spec["bg"]
            kw["async_scheduling"] = asy
        else:
            sc["method"] = "dflash"
            kw["async_scheduling"] = bool(spec.get("async_sched"))
        kw["speculative_config"] = sc
    kw.update(llm_kw)
    return LLM(**kw)


def decode_width(scheduler_output):
    """k when every scheduled request verifies k drafts (1 + k tokens each), else None
    (a prefill chunk, a mixed step, no drafts)."""
    try:
        sched = scheduler_output.num_scheduled_tokens
        drafts = scheduler_output.scheduled_spec_decode_tokens
        ks = {len(drafts.get(r) or ()) for r in sched}
        k = ks.pop() if len(ks) == 1 else 0
        return k if k and all(n == 1 + k for n in sched.values()) else None
    except Exception:  # noqa: BLE001  (a diagnostic only)
        return None


class Hooks:
    """CUDA-event spans of the step phases + wall time per step (no extra syncs)."""

    def __init__(self, runner, kind):
        self.runner = runner
        self.steps = []
        self.cur = None
        self.call = None
        r = runner

        def step_start(orig):
            def f(scheduler_output, *a, **k):
                self.cur = {"t": time.perf_counter(),
                            "tokens": scheduler_output.total_num_scheduled_tokens,
                            "reqs": len(scheduler_output.num_scheduled_tokens),
                            "width": decode_width(scheduler_output),
                            "ev": {}, "cpu": {}}
                self.steps.append(self.cur)
                return orig(scheduler_output, *a, **k)
            return f

        def span(name, orig, cpu=False):
            def f(*a, **k):
                if self.cur is None:
                    return orig(*a, **k)
                s = torch.cuda.Event(enable_timing=True)
                e = torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                s.record()
                out = orig(*a, **k)
                e.record()
                self.cur["ev"].setdefault(name, []).append((s, e))
                if cpu:
                    self.cur["cpu"][name] = self.cur["cpu"].get(name, 0.0) + \
                        (time.perf_counter() - t0) * 1e3
                return out
            return f

        r.execute_model = step_start(r.execute_model)
        if V2:
            self._hook_v2(r, kind, span)
            return
        r._model_forward = span("verify_forward", r._model_forward)
        r._sample = span("sample", r._sample)
        if kind != "nospec":
            orig_propose = r.drafter.propose

            def propose(*a, **k):
                self.call = k
                return orig_propose(*a, **k)

            r.drafter.propose = span("draft", propose, cpu=True)
        if kind == "ddtree":
            import vllm.v1.spec_decode.ddtree.v1.proposer as pm
            import vllm.v1.spec_decode.ddtree.v1.sampler as sm

            pm.build_tree = span("tree_build", pm.build_tree)
            sm.walk_greedy = span("walk", sm.walk_greedy)
            r.ddtree.prepare = span("prepare", r.ddtree.prepare, cpu=True)
            r.ddtree.commit = span("commit", r.ddtree.commit, cpu=True)

    def _hook_v2(self, r, kind, span):
        """V2 runner (vllm/v1/worker/gpu/model_runner.py): its own method names."""
        cg = getattr(r, "cudagraph_manager", None)  # None without CUDA graphs
        if cg is not None:
            cg.run_fullgraph = span("verify_forward", cg.run_fullgraph)
        r.sample = span("sample", r.sample)
        if kind == "nospec":
            return
        r.speculator.propose = span("draft", r.speculator.propose, cpu=True)
        if kind == "ddtree":
            r.speculator.build_trees = span("tree_build", r.speculator.build_trees)
            r.ddtree.prepare = span("prepare", r.ddtree.prepare, cpu=True)
            r.ddtree.commit = span("commit", r.ddtree.commit, cpu=True)

    def reset(self):
        self.steps, self.cur = [], None

    def phase_medians(self, steps) -> dict:
        """Median GPU ms per phase, and the median wall ms between step starts, over
        ``steps`` (a subset of self.steps)."""
        torch.cuda.synchronize()
        pos = {id(s): i for i, s in enumerate(self.steps)}
        phases, walls = {}, []
        for s in steps:
            i = pos[id(s)]
            if i + 1 < len(self.steps):
                walls.append((self.steps[i + 1]["t"] - s["t"]) * 1e3)
            for name, evs in s["ev"].items():
                phases.setdefault(name, []).append(sum(a.elapsed_time(b) for a, b in evs))
        out = {k: round(statistics.median(v), 4) for k, v in phases.items()}
        if walls:  # the mean and the largest show stalls (compiles) the median hides
            out["wall"] = round(statistics.median(walls), 4)
            out["wall_mean"] = round(statistics.fmean(walls), 4)
            out["wall_max"] = round(max(walls), 4)
        return out

    def timeline(self) -> list:
        """[requests, scheduled tokens, decode width (None: not a pure decode step), wall
        ms to the next step's start (None: the last step)] per step of the last run, for
        what medians hide: switches of width, slow first steps."""
        st = self.steps
        return [[s["reqs"], s["tokens"], s["width"],
                 round((st[i + 1]["t"] - s["t"]) * 1e3, 3) if i + 1 < len(st) else None]
                for i, s in enumerate(st)]

    def summary(self, verify_tokens: int) -> dict:
        torch.cuda.synchronize()
        st = self.steps
        walls, phases, cpus = [], {}, {}
        for i, s in enumerate(st):
            if s["tokens"] != verify_tokens:
                continue
            if i + 1 < len(st):
                walls.append((st[i + 1]["t"] - s["t"]) * 1e3)
            for name, evs in s["ev"].items():
                phases.setdefault(name, []).append(sum(a.elapsed_time(b) for a, b in evs))
            for name, v in s["cpu"].items():
                cpus.setdefault(name, []).append(v)
        med = lambda x: statistics.median(x) if x else None  # noqa: E731
        return {"verify_steps": len(walls), "all_steps": len(st),
                "step_ms": med(walls),
                "step_ms_mean": statistics.fmean(walls) if walls else None,
                "gpu_ms": {k: med(v) for k, v in phases.items()},
                "cpu_ms": {k: med(v) for k, v in cpus.items()}}


class FastSynthetic:
    """A calibrated synthetic drafter on the GPU: at depth d its distribution puts
    probability p_k on k-th ranked tokens (the profile), the rest spread over the vocab,
    and the true token pi^d(bonus) sits at a rank drawn from the same profile (or in the
    tail).  Calibrated: what the drafter believes is what the target then accepts.

    The rank (and the tokens ranked above it) belong to the true token itself, drawn
    once per token id: every config (chain, tree, any schedule) meets the same drafter
    at the same place of the text, so their accepted lengths differ by what they draft,
    not by a random stream that each consumes differently (run 9: one chain-step
    config drew tau 5.13 and another 4.72 on the same text)."""

    def __init__(self, perm, rank_probs, seed=0):
        """rank_probs: one profile [p_0, p_1, ...] for every depth, or one per depth
        ([[...], [...], ...]; depths past the last use the last): a profile measured
        on a trained pair (bench/realpair: offline_acceptance.rank_probs_per_depth)."""
        self.perm = perm
        dev = perm.device
        v = perm.numel()
        rows = rank_probs if isinstance(rank_probs[0], (list, tuple)) else [rank_probs]
        r = max(len(x) for x in rows)
        p = torch.tensor([list(x) + [0.0] * (r - len(x)) for x in rows], dtype=torch.float64)
        self.logp = p.clamp(min=1e-9).log().float().to(dev)  # [D, r]
        tail = (1 - p.sum(-1)).clamp(min=1e-6)
        self.tail = (tail / v).log().float().to(dev)  # [D]
        self.r = r
        g = torch.Generator().manual_seed(seed)
        draws = torch.cat([p, (1 - p.sum(-1, keepdim=True)).clamp(min=0)], -1).float()
        # r: the tail; one draw per depth (one profile: the draws of earlier runs)
        self.rank_of = torch.stack([torch.multinomial(d, v, True, generator=g)
                                    for d in draws]).to(dev)  # [D, v]
        self.cand_of = torch.randint(0, v, (v, self.r), generator=g).to(dev)
        self.gen = torch.Generator(device=dev).manual_seed(seed)

    def logits(self, runner, call, n, depth, real):
        dev = real.device
        v = real.shape[-1]
        t = call["next_token_ids"][:n].long()
        true = torch.empty(n, depth, dtype=torch.long, device=dev)
        for d in range(depth):
            t = self.perm[t]
            true[:, d] = t
        dd = torch.arange(depth, device=dev).clamp(max=self.rank_of.shape[0] - 1)
        rank = self.rank_of[dd.unsqueeze(0), true]  # [n, depth]
        base = self.tail[dd].view(1, depth, 1) + \
            1e-3 * torch.rand(n, depth, v, device=dev, generator=self.gen)
        cand = self.cand_of[true]
        base.scatter_(-1, cand, self.logp[dd].unsqueeze(0).expand(n, depth, self.r)
                      .contiguous())
        absent = (rank >= self.r).unsqueeze(-1)
        tgt = cand.gather(-1, rank.clamp(max=self.r - 1).unsqueeze(-1))
        tgt = torch.where(absent, true.unsqueeze(-1), tgt)  # absent: stays in the tail
        v_true = base.gather(-1, true.unsqueeze(-1))
        v_tgt = base.gather(-1, tgt)
        base.scatter_(-1, tgt, v_true)
        base.scatter_(-1, true.unsqueeze(-1), v_tgt)
        return base


def real_profile(path: str) -> list:
    """The per-depth rank probabilities a trained pair measured (bench/realpair's
    train.json: offline_acceptance.rank_probs_per_depth), or a JSON list of them."""
    with open(path) as f:
        doc = json.load(f)
    rows = doc["offline_acceptance"]["rank_probs_per_depth"] if isinstance(doc, dict) else doc
    if not rows or not all(isinstance(r, list) and r and sum(r) <= 1 + 1e-6 for r in rows):
        raise ValueError(f"{path}: not a list of per-depth rank probabilities")
    return rows


def rewire_target(runner, seed=0):
    """Greedy next token = pi(current token), robustly (large margins in bf16): every
    layer's output projection zeroed (attention o_proj, MLP down_proj, GDN out_proj),
    so the residual stream is the embedding, and the final norm the identity scale."""
    model = runner.model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
                p.zero_()
        norm = model.model.norm  # Qwen3.5 / Qwen3-Next (GemmaRMSNorm) scale by 1 + w
        norm.weight.fill_(0.0 if "Gemma" in type(norm).__name__ else 1.0)
        emb = model.model.embed_tokens.weight
        v = emb.shape[0]
        g = torch.Generator(device=emb.device).manual_seed(seed)
        perm = torch.randperm(v, device=emb.device, generator=g)
        inv = torch.argsort(perm)
        model.lm_head.weight.copy_(emb[inv])
    return perm


def use_synthetic(runner, kind, hooks, synth):
    if kind == "ddtree":
        runner.drafter._ddtree_synthetic = synth
    elif kind == "chain":
        def greedy(hidden_states):
            depth = runner.drafter.num_speculative_tokens
            n = hidden_states.shape[0] // depth
            lg = synth.logits(runner, hooks.call, n, depth, runner.drafter.model.compute_logits(
                hidden_states).view(n, depth, -1))
            return lg.argmax(-1).reshape(-1)

        runner.drafter._greedy_sample = greedy


def use_synthetic_v2(runner, kind, synth):
    """V2: the drafter's step runs in a FULL graph, so the synthetic distributions go in
    after it: DDTree's kept top-K (before its tree build), the chain's argmax drafts
    (what propose returns).  The bonus token is V2's last_sampled_tokens by slot."""
    from vllm.v1.spec_decode.ddtree.core.vocab_topk import vocab_topk

    spec = runner.speculator
    last = runner.req_states.last_sampled_tokens  # [max_reqs, 1]
    meta = torch.empty(1, 1, spec.vocab_size, device=last.device)  # vocab size + device

    def logits(batch, depth):
        call = {"next_token_ids": last[batch.idx_mapping, 0]}
        return synth.logits(runner, call, batch.num_reqs, depth, meta)

    # one profile at a time: wrap the unwrapped methods (a wrapper of the previous
    # profile's wrapper would overwrite this profile's distributions with its own)
    if kind == "ddtree":
        orig = spec.__dict__.get("_unwrapped_build") or spec.build_trees
        spec._unwrapped_build = orig  # trees and chain steps read the kept top-K

        def build_trees(batch, store, want=None):
            if store:
                n, depth = batch.num_reqs, spec.num_speculative_steps
                lg = logits(batch, depth).view(n * depth, -1)
                # a chain (a chain batch size, or the chain arm at a tree batch size)
                # keeps the argmax as sample_draft does there; a tree its top-K pass
                if spec.drafts_chain(n) or (want is not None
                                            and 0 < want <= spec.chain_budget):
                    spec.keep_top1(lg.argmax(-1))
                else:
                    vals, idx, lse = vocab_topk(lg, spec.topk)
                    spec._top_vals[: n * depth].copy_(vals)
                    spec._top_idx[: n * depth].copy_(idx)
                    spec._lse[: n * depth].copy_(lse)
            return orig(batch, store, want)

        spec.build_trees = build_trees
    elif kind == "chain":
        orig = spec.__dict__.get("_unwrapped_propose") or spec.propose
        spec._unwrapped_propose = orig

        def propose(*a, **k):
            out = orig(*a, **k)
            if k.get("dummy_run"):
                return out
            batch = a[0] if a else k["input_batch"]
            return logits(batch, out.shape[1]).argmax(-1).to(out.dtype)

        spec.propose = propose


def host_profile(out_dir, name, n):
    """BENCH_CPROFILE=1: cProfile the host over one step-table run (where DDTree's
    host time per step goes); returns the function that stops it and writes
    cprofile_<config>_N<n>.txt (top functions by own and by cumulative time)."""
    if os.environ.get("BENCH_CPROFILE") != "1":
        return None
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()

    def stop():
        pr.disable()
        buf = io.StringIO()
        st = pstats.Stats(pr, stream=buf)
        st.sort_stats("tottime").print_stats(45)
        st.sort_stats("cumulative").print_stats(60)
        with open(os.path.join(out_dir, f"cprofile_{name}_N{n}.txt"), "w") as f:
            f.write(buf.getvalue())
    return stop


def run_config(name, out_dir, res):
    spec = parse(name)
    kind, k = spec["kind"], spec["k"]
    C.log("engine", name)
    t0 = time.perf_counter()
    llm = engine(spec)
    res[name] = {"init_s": time.perf_counter() - t0, "steps": {}, "e2e": {},
                 "runner": type(C.runner_of(llm)).__module__}
    C.dump(os.path.join(out_dir, "step_bench.json"), res)
    runner = C.runner_of(llm)
    hooks = Hooks(runner, kind)
    verify = 1 + k
    for i, n in enumerate(BATCHES):
        toks = C.prompts(n, PROMPT, 1000, 100000, seed=n)
        if i == 0:
            C.generate(llm, toks, 8)  # warm-up (Triton compiles, allocator)
        hooks.reset()
        prof = host_profile(out_dir, name, n)
        outs, dt = C.generate(llm, toks, NEW)
        if prof is not None:
            prof()
        s = hooks.summary(n * (1 + budget_at(spec, n)))
        s["generate_s"] = dt
        s["tokens"] = sum(len(o) for o in outs)
        res[name]["steps"][str(n)] = s
        C.log(name, "N", n, "step ms", s["step_ms"], "gpu", json.dumps(s["gpu_ms"]),
              "cpu", json.dumps(s["cpu_ms"]))
        if os.environ.get("BENCH_TPROFILE") == "1":  # by kernel (kernel_prof.py, #29)
            import kernel_prof

            kernel_prof.step_kernels(C, llm, hooks, n, NEW, PROMPT,
                                     os.path.join(out_dir, f"kernels_{name}_N{n}.json"))
        C.dump(os.path.join(out_dir, "step_bench.json"), res)
    if not E2E_BATCHES:
        C.teardown(llm)
        return
    perm = rewire_target(runner)
    only = os.environ.get("BENCH_PROFILES", "p60,p80,p90")
    profiles = {p: v for p, v in PROFILES.items() if p in only.split(",")}
    if "real" in only.split(","):  # a profile measured on a trained pair (#31)
        profiles["real"] = real_profile(os.environ["BENCH_REAL_PROFILE"])
    profiles = profiles if kind != "nospec" else {"-": None}
    for pname, probs in profiles.items():
        if probs is not None and V2:
            use_synthetic_v2(runner, kind, FastSynthetic(perm, probs))
        elif probs is not None:
            use_synthetic(runner, kind, hooks, FastSynthetic(perm, probs))
        for n in E2E_BATCHES:
            if n > 1 and pname not in ("p80", "-") and not E2E_ALL:
                continue
            toks = C.prompts(n, PROMPT, 1000, 100000, seed=100 + n)
            # the tree-vs-chain controller learns each cell afresh (kt: but its step times)
            C.reset_arms(llm, keep_times=bool(spec.get("kt")))
            if spec.get("warm") and C.arms_of(llm) is not None:
                # ... or keeps what a whole untimed run of the cell (other prompts, same
                # profile and batch) taught it: a server's steady state, not its start
                C.generate(llm, C.prompts(n, PROMPT, 1000, 100000, seed=700 + n), E2E_NEW)
            # warm-up, other prompts (no prefix-cache hits), staggered lengths: the batch
            # drains one request at a time, so every batch size below n (and its Triton
            # specialisations: n == 1, n % 16 == 0, other) compiles before the timed run
            C.generate(llm, C.prompts(n, PROMPT, 1000, 100000, seed=900 + n),
                       [8 + 4 * i for i in range(n)])
            hooks.reset()
            with C.GcPauses() as gcp:
                outs, dt = C.generate(llm, toks, E2E_NEW)
            # decode steps (no prompt chunk: <= 1 + B rows per request); request-steps
            dec = [s for s in hooks.steps if s["reqs"] and s["tokens"] <= s["reqs"] * verify]
            steps = len(dec)
            active = sum(s["reqs"] for s in dec)
            pc = perm.cpu()
            bad = 0
            for p, o in zip(toks, outs):
                prev = p[-1]
                for x in o:
                    bad += int(x != int(pc[prev]))
                    prev = x
            toks_out = sum(len(o) for o in outs)
            e = {"tokens": toks_out, "seconds": dt, "tok_per_s": toks_out / dt,
                 "decode_steps": steps,
                 "tau": (toks_out - n) / active if active else None,
                 "mismatches_vs_pi_chain": bad}
            e["phases_ms"] = hooks.phase_medians(dec)
            e["timeline"] = hooks.timeline()
            e["gc"] = gcp.summary()  # collections during the timed run, per generation
            arms = C.arms_of(llm)
            if arms is not None:  # what the controller measured and chose (warm-up too)
                e["arms"] = {str(k): v for k, v in arms.summary().items()}
                # each measured step with the estimates published then (a replay of the
                # estimator against what each arm realized: #29)
                e["arms_trace"] = list(arms.trace)
            res[name]["e2e"][f"{pname}_N{n}"] = e
            C.log(name, "e2e", pname, "N", n, json.dumps(e))
            C.dump(os.path.join(out_dir, "step_bench.json"), res)
    C.teardown(llm)


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "step_bench.json")
    res = json.load(open(path)) if os.path.exists(path) else {}
    make_models()
    for name in sys.argv[2:]:
        try:
            run_config(name, out_dir, res)
        except Exception:
            res.setdefault(name, {})["error"] = traceback.format_exc()[-3000:]
            C.log("FAILED", name, res[name]["error"][-1500:])
            C.dump(path, res)


if __name__ == "__main__":
    main()
