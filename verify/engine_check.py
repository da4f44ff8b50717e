"""Engine check: a tiny random Qwen3 target + DFlash drafter built in a temp folder,
greedy no-spec vs DDTree (random drafter, then a synthetic drafter that forces deep
and sibling accepts), tokens must be identical; reports the mean accepted length.
With ddtree-gdn, also a tiny GDN hybrid in bf16 (the CPU GDN kernels' only dtype; on
CUDA vLLM's FLA chunk prefill refuses fp32): a Qwen3-Next on the CPU backend, a dense
Qwen3.5 on CUDA (Triton GDN prefill): greedy DDTree == no-spec except at near ties
(no-spec top-2 gap < HYBRID_EPS: about two bf16 steps of the top logit, 0.125 at the
tiny models' logit scale of ~25; the tree path computes the recurrence in another
order, so its bf16 outputs round differently)."""

from __future__ import annotations

import gc
import json
import os
import random
import tempfile

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
       "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


HYBRID_EPS = {"cpu": 0.125, "cuda": 0.25}


def _generate(llm_kwargs: dict, prompts, max_tokens: int, logprobs: int | None = None):
    from vllm import LLM, SamplingParams

    llm = LLM(**llm_kwargs)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                        detokenize=False, logprobs=logprobs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    counts = {}
    if logprobs:  # top-1 / top-2 gap per step
        counts["gaps"] = [[_gap(step) for step in o.outputs[0].logprobs] for o in outs]
    for m in llm.get_metrics():
        if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"):
            counts[m.name] = getattr(m, "value", 0)
    del llm
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:
        pass
    gc.collect()
    return tokens, counts


def run(spec: dict) -> tuple[bool, str]:
    from . import tiny_models

    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    extra = json.loads(os.environ.get("DDTREE_VERIFY_ENGINE_ARGS", "{}"))
    rng = random.Random(spec.get("seed") or 0)
    with tempfile.TemporaryDirectory(prefix="ddtree-verify-models-") as tmp:
        target = tiny_models.write_target(os.path.join(tmp, "target"))
        drafter = tiny_models.write_drafter(os.path.join(tmp, "drafter"), target)
        vocab = tiny_models.TARGET_DEFAULTS["vocab_size"]
        prompts = [[rng.randrange(2, vocab - 12) for _ in range(3 + 4 * i)] for i in range(8)]
        common = dict(model=str(target), skip_tokenizer_init=True, dtype="float32",
                      max_model_len=256, enforce_eager=True, seed=0, disable_log_stats=False,
                      distributed_executor_backend="uni")
        common.update(extra)
        base, _ = _generate(common, prompts, 24)
        sequences = [p + t for p, t in zip(prompts, base)]
        syn = os.path.join(tmp, "synthetic.json")
        with open(syn, "w") as f:
            json.dump({"sequences": sequences, "rank_probs": [0.6, 0.25, 0.1], "seed": 1,
                       "peak": 6.0}, f)
        report = []
        for name, extra_spec in (("random drafter", {}),
                                 ("synthetic drafter", {"ddtree_synthetic": syn})):
            sc = {"method": "ddtree", "model": str(drafter), "num_speculative_tokens": 8,
                  **extra_spec}
            got, m = _generate({**common, "speculative_config": sc}, prompts, 24)
            if got != base:
                i = next(i for i, (a, b) in enumerate(zip(base, got)) if a != b)
                j = next((j for j, (a, b) in enumerate(zip(base[i], got[i])) if a != b), 0)
                return False, (f"DDTree ({name}) output differs from no-spec decoding: "
                               f"prompt {i}, token {j}: {base[i][j:j + 4]} vs {got[i][j:j + 4]}")
            drafts = m.get("vllm:spec_decode_num_drafts", 0) or 0
            acc = m.get("vllm:spec_decode_num_accepted_tokens", 0) or 0
            tau = 1 + acc / drafts if drafts else float("nan")
            report.append(f"{name}: identical, mean accepted length {tau:.2f}")
    ok, hybrid = _hybrid(spec, rng)
    return ok, "greedy DDTree == no-spec on 8 prompts; " + "; ".join(report) + "; " + hybrid


def _gap(step) -> float:
    top = sorted((lp.logprob for lp in step.values()), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def _hybrid(spec: dict, rng) -> tuple[bool, str]:
    from vllm.platforms import current_platform

    cpu, cuda = current_platform.is_cpu(), current_platform.is_cuda()
    if "ddtree-gdn" not in spec["applied"] or not (cpu or cuda):
        return True, "GDN hybrid check skipped (needs ddtree-gdn, on CUDA or the CPU backend)"
    from . import tiny_hybrid

    dtype = "bfloat16"
    with tempfile.TemporaryDirectory(prefix="ddtree-verify-hybrid-") as tmp:
        pair = tiny_hybrid.write_pair(tmp, {} if cpu else {"arch": "qwen3_5"})
        prompts = [[rng.randrange(2, 500) for _ in range(3 + 5 * i)] for i in range(4)]
        common = dict(model=pair["target"], skip_tokenizer_init=True, dtype=dtype,
                      max_model_len=256, enforce_eager=True, seed=0,
                      enable_prefix_caching=False, disable_log_stats=False,
                      distributed_executor_backend="uni")
        if cuda:  # Triton GDN prefill runs everywhere (FlashInfer may be absent)
            common.update(additional_config={"gdn_prefill_backend": "triton"},
                          attention_backend="TRITON_ATTN")
        base, m = _generate(common, prompts, 16, logprobs=2)
        got, _ = _generate({**common, "speculative_config": {
            "method": "ddtree", "model": pair["drafter"], "num_speculative_tokens": 8}},
            prompts, 16)
    compared, eps = 0, HYBRID_EPS["cpu" if cpu else "cuda"]
    for i, (a, b) in enumerate(zip(base, got)):
        j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        if j < len(a) and m["gaps"][i][j] >= eps:
            return False, (f"DDTree on a GDN hybrid differs from no-spec decoding: prompt "
                           f"{i}, token {j} (no-spec top-2 gap {m['gaps'][i][j]:.3f}): "
                           f"{a[j:j + 4]} vs {b[j:j + 4]}")
        compared += j
    total = sum(map(len, base))
    return True, (f"GDN hybrid ({dtype}, {'CPU' if cpu else 'CUDA'}): {compared}/{total} "
                  "tokens identical" + ("" if compared == total else
                                        f", the rest after {dtype} near ties"))
