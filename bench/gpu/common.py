"""Shared helpers of the H200 engine runs (vLLM 0.20.2 patched by ddtree-patch).

Models are written by the scripts themselves (no hub): Qwen3 targets (config through
transformers' Qwen3Config, weights random or vLLM's load_format="dummy") and DFlash
drafters (config.json + random safetensors with the names vLLM 0.20.2's
qwen3_dflash.py loads).  Engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so
the scripts can reach the model runner (timing hooks, weight surgery).
"""

from __future__ import annotations

import gc
import json
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

import torch  # noqa: E402

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, max_position_embeddings=40960)
DFLASH_B16 = dict(layers=5, target_layer_ids=[1, 9, 17, 25, 33], block_size=16,
                  mask_token_id=151669)


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def qwen3_config(**sizes) -> dict:
    from transformers import Qwen3Config

    kw = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
              bos_token_id=0, eos_token_id=1, pad_token_id=None,
              architectures=["Qwen3ForCausalLM"], **sizes)
    try:  # transformers >= 5
        cfg = Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **kw)
    except TypeError:
        cfg = Qwen3Config(rope_theta=1e6, **kw)
    d = cfg.to_dict()
    d["torch_dtype"] = "bfloat16"
    return d


def write_target(path: str, cfg: dict, random_weights: bool, std: float = 0.05,
                 seed: int = 0) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    if not random_weights:
        return path
    v, h = cfg["vocab_size"], cfg["hidden_size"]
    return _save_random(path, cfg, cfg["num_hidden_layers"], "model.layers.", std, seed,
                        lambda rnd, ones: {"model.embed_tokens.weight": rnd(v, h),
                                           "model.norm.weight": ones(h),
                                           "lm_head.weight": rnd(v, h)})


def write_drafter(path: str, target_cfg: dict, layers: int, target_layer_ids, block_size: int,
                  mask_token_id: int, std: float = 0.05, seed: int = 1) -> str:
    """A DFlash drafter with random weights (no embed/lm_head: shared with the target)."""
    os.makedirs(path, exist_ok=True)
    cfg = dict(target_cfg)
    cfg.update(architectures=["DFlashDraftModel"], num_hidden_layers=layers,
               layer_types=["full_attention"] * layers, block_size=block_size,
               dflash_config={"mask_token_id": mask_token_id,
                              "target_layer_ids": list(target_layer_ids)})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    h, n_aux = cfg["hidden_size"], len(target_layer_ids)
    return _save_random(path, cfg, layers, "layers.", std, seed,
                        lambda rnd, ones: {"fc.weight": rnd(h, h * n_aux),
                                           "hidden_norm.weight": ones(h),
                                           "norm.weight": ones(h)})


def _save_random(path: str, cfg: dict, layers: int, prefix: str, std: float, seed: int,
                 head) -> str:
    """model.safetensors with head(rnd, ones) (drawn first) and `layers` Qwen3 decoder
    layers named prefix + index; bf16, normal(0, std) weights, norms 1."""
    from safetensors.torch import save_file

    g = torch.Generator(device="cuda").manual_seed(seed)
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rnd(*s):
        return (torch.randn(*s, generator=g, device="cuda") * std).to(torch.bfloat16).cpu()

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    t = head(rnd, ones)
    for li in range(layers):
        p = f"{prefix}{li}."
        t.update({p + "self_attn.q_proj.weight": rnd(nh * hd, h),
                  p + "self_attn.k_proj.weight": rnd(nkv * hd, h),
                  p + "self_attn.v_proj.weight": rnd(nkv * hd, h),
                  p + "self_attn.o_proj.weight": rnd(h, nh * hd),
                  p + "self_attn.q_norm.weight": ones(hd),
                  p + "self_attn.k_norm.weight": ones(hd),
                  p + "mlp.gate_proj.weight": rnd(i, h), p + "mlp.up_proj.weight": rnd(i, h),
                  p + "mlp.down_proj.weight": rnd(h, i),
                  p + "input_layernorm.weight": ones(h),
                  p + "post_attention_layernorm.weight": ones(h)})
    save_file({k: x.contiguous() for k, x in t.items()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def runner_of(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def arms_of(llm):
    """The scheduler's tree-vs-chain controller (DDTree's ArmLookup), or None."""
    try:
        lookup = llm.llm_engine.engine_core.engine_core.scheduler.dynamic_sd_lookup
    except AttributeError:
        return None
    return lookup if hasattr(lookup, "observe") else None


def reset_arms(llm, keep_times: bool = False) -> None:
    """A fresh controller (nothing measured yet) in the scheduler, if there is one, and
    nothing measured in the worker's half (v2_arms.ArmExpect.reset); keep_times: the
    step times it measured carry over (arms.ArmLookup.renew: a running server)."""
    lookup = arms_of(llm)
    if lookup is None:
        return
    llm.llm_engine.engine_core.engine_core.scheduler.dynamic_sd_lookup = \
        lookup.renew(keep_times)
    spec = getattr(runner_of(llm), "speculator", None)
    ex = getattr(spec, "expect", None)
    if ex is not None:
        ex.reset()


def teardown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception as e:  # keep going: the next engine may still start
        log("cleanup failed:", repr(e))
    gc.collect()
    torch.cuda.empty_cache()


def prompts(n: int, length: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(lo, hi, (length,), generator=g).tolist() for _ in range(n)]


class GcPauses:
    """Python garbage collections while a block runs (count and ms per generation):
    run 24's cells had 20-35 ms host stalls in every config; this says whether the
    collector caused them."""

    def __enter__(self):
        self.ms = {0: 0.0, 1: 0.0, 2: 0.0}
        self.count = {0: 0, 1: 0, 2: 0}
        self._t0 = None
        gc.callbacks.append(self._cb)
        return self

    def _cb(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            g = info.get("generation", 2)
            self.ms[g] += (time.perf_counter() - self._t0) * 1e3
            self.count[g] += 1
            self._t0 = None

    def __exit__(self, *exc):
        gc.callbacks.remove(self._cb)
        return False

    def summary(self) -> dict:
        return {"count": [self.count[g] for g in (0, 1, 2)],
                "ms": [round(self.ms[g], 3) for g in (0, 1, 2)]}


def generate(llm, toks: list[list[int]], max_tokens, margins: bool = False):
    """Greedy outputs and seconds; max_tokens: one for all or one per prompt;
    margins=True also returns, per prompt and step, the top-1 minus top-2 logprob
    (needs logprobs, so not with method 'ddtree')."""
    from vllm import SamplingParams

    def params(m):
        return SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True,
                              detokenize=False, logprobs=2 if margins else None)

    sp = [params(m) for m in max_tokens] if isinstance(max_tokens, list) else \
        params(max_tokens)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in toks], sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    if not margins:
        return tokens, dt
    gaps = []
    for o in outs:
        row = []
        for step in o.outputs[0].logprobs or []:
            v = sorted((x.logprob for x in step.values()), reverse=True)
            row.append(v[0] - v[1] if len(v) > 1 else float("inf"))
        gaps.append(row)
    return tokens, dt, gaps


def graph_us(fn, reps: int) -> float:
    """Median us of one CUDA-graph replay of fn (captured after two warm-up calls on a
    side stream) over reps replays, each between its own events."""
    import statistics

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev) * 1e3


def dump(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
