"""Target probabilities for the sampled walk, processed the way vLLM 0.32.0 does it.

Mirrors vllm/v1/sample/rejection_sampler.py::apply_sampling_constraints and
vllm/v1/sample/ops/topk_topp_sampler.py::apply_top_k_top_p_pytorch: logits in
float32, divided by the request's temperature, min_p (the no-spec sampler's
MinPLogitsProcessor), then top-k (keep tokens >= the k-th largest logit, ties kept) and top-p (sort ascending, softmax, cumsum, drop tokens
with cumulative prob <= 1 - p, always keep the largest), then softmax.  Greedy
requests (temperature < 1e-5) get a one-hot of the argmax (first max), so the
sampled walk reproduces the greedy walk for them.
"""

import torch

SAMPLING_EPS = 1e-5


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """logits [rows, V]; k [rows] int (<= 0 or >= V: off); p [rows] float (1.0: off)."""
    if k is None and p is None:
        return logits
    v = logits.shape[-1]
    srt, idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        kk = k.to(torch.long)
        kk = torch.where((kk <= 0) | (kk > v), v, kk)
        kth = srt.gather(1, (v - kk).unsqueeze(1))
        srt = srt.masked_fill(srt < kth, float("-inf"))
    if p is not None:
        cum = srt.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - p.to(cum.dtype).unsqueeze(1)
        drop[:, -1] = False
        srt = srt.masked_fill(drop, float("-inf"))
    return logits.scatter(-1, idx, srt)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's MinPLogitsProcessor: drop tokens whose probability is below min_p times
    the row's largest (min_p [rows], 0: off); logits [rows, V], after temperature."""
    probs = logits.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p.to(probs.dtype).unsqueeze(1)
    return logits.masked_fill(probs < floor, float("-inf"))


def target_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [N, R, V] (R verify rows per request) + per-request params [N] ->
    float32 probs [N, R, V] for walk_sampled."""
    n, r, v = logits.shape
    x = logits.float().reshape(n * r, v)
    temp = temperature.float().to(x.device).repeat_interleave(r)
    greedy = temp < SAMPLING_EPS
    x = x / torch.where(greedy, torch.ones_like(temp), temp).unsqueeze(1)
    if min_p is not None:
        x = apply_min_p(x, min_p.to(x.device).repeat_interleave(r))
    kk = None if top_k is None else top_k.to(x.device).repeat_interleave(r)
    pp = None if top_p is None else top_p.to(x.device).repeat_interleave(r)
    probs = apply_top_k_top_p(x, kk, pp).softmax(dim=-1)
    onehot = torch.zeros_like(probs).scatter_(1, x.argmax(-1, keepdim=True), 1.0)
    probs = torch.where(greedy.unsqueeze(1), onehot, probs)
    return probs.reshape(n, r, v)
