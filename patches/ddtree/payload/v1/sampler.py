"""DDTreeSampler: the tree rejection sampler (drop-in for vLLM's RejectionSampler).

Same call and output as RejectionSampler.forward: [N, D+1] token ids, the accepted
path then the bonus token, -1 padded.  Verify rows per request: row 0 is the root
(the token the step started from), row 1 + j is draft node j.  Greedy: follow the
child whose token is the target argmax.  Sampling: target-only and lossless
(core.walk_sampled); temperature / min_p / top-k / top-p as vLLM applies them.  Each
row's logits are first processed for the request's penalties, allowed tokens, bad
words, min_tokens and logit_bias after that row's own path (requests.py); logprobs
of the emitted tokens come from the rows that emitted them.

Rank determinism (tensor parallelism): every rank runs this sampler on the same
all-gathered logits and must walk to the same path.  The walk's uniforms come from the
request's own generator (seeded requests, as in vLLM's samplers) or from a generator
the walk owns (the others), seeded from the engine seed and advanced only here: never
torch's global RNG, so nothing else that draws random numbers on one rank (a plugin,
a warm-up, another sampler) can move the walk of that rank.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vllm.v1.outputs import SamplerOutput

from ..core import (DDTree, chain_depths, chain_parents, row_argmax, target_probs, walk_greedy,
                    walk_sampled)
from .requests import batch_requests, emitted_logprobs, min_p_of, process_rows

WALK_SEED_SALT = 0xDD7EE  # the walk's own stream, apart from the engine seed's


class DDTreeSampler(nn.Module):
    def __init__(self, runtime, sampler):
        super().__init__()
        self.runtime = runtime
        self.sampler = sampler
        model_config = getattr(runtime.runner, "model_config", None)
        self.seed = walk_seed(getattr(model_config, "seed", None))
        self._generator = None  # made on the logits' device at the first sampled walk

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        num_drafts = list(metadata.num_draft_tokens)
        n = len(num_drafts)
        dmax = max(num_drafts)
        dev = logits.device
        step = self.runtime.step
        tree = step.tree if step is not None and step.num_drafts == num_drafts else \
            self._chains(metadata, num_drafts, dev)
        # logits rows of request i: [root, node 0 .. node d_i - 1]; pads repeat the
        # last row (never a child, so the walk never reads them)
        if min(num_drafts) == dmax:  # every request verifies dmax drafts: a plain view
            rows = logits[: n * (dmax + 1)].view(n, dmax + 1, -1)
        else:
            starts, k = [], 0
            for d in num_drafts:
                starts.append(k)
                k += d + 1
            offs = torch.arange(dmax + 1)
            idx = (torch.tensor(starts)[:, None] + torch.minimum(
                offs[None, :], torch.tensor(num_drafts)[:, None])).reshape(-1)
            if dev.type == "cuda":  # pinned + non-blocking: no wait for the forward
                idx = idx.pin_memory().to(dev, non_blocking=True)
            rows = logits[idx.to(dev)].view(n, dmax + 1, -1)
        reqs = batch_requests(self.runtime.runner, n)
        target = process_rows(rows, tree, reqs,
                              getattr(sampling_metadata, "prompt_token_ids", None))
        if sampling_metadata.all_greedy:
            res = walk_greedy(row_argmax(target), tree)
        else:
            temp = sampling_metadata.temperature
            probs = target_probs(target, temp[:n], _cut(sampling_metadata.top_k, n),
                                 _cut(sampling_metadata.top_p, n), min_p_of(reqs, n, dev))
            res = walk_sampled(probs, tree, self._uniforms(n, tree.max_depth + 1,
                                                          sampling_metadata, dev))
        self.runtime.walk = res
        out = torch.full((n, dmax + 1), -1, dtype=torch.int32, device=dev)
        width = min(res.output_tokens.shape[1], dmax + 1)
        out[:, :width] = res.output_tokens[:, :width].to(torch.int32)
        logprobs = None
        k = getattr(sampling_metadata, "max_num_logprobs", None)
        if k is not None:
            logprobs = emitted_logprobs(self.sampler, rows, res, out, k)
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs)

    @staticmethod
    def _chains(metadata, num_drafts, dev) -> DDTree:
        """Drafts without a stored tree (e.g. the warm-up run) are verified as chains."""
        n, dmax = len(num_drafts), max(max(num_drafts), 1)
        tokens = torch.zeros(n, dmax, dtype=torch.int64, device=dev)
        flat = metadata.draft_token_ids.to(torch.int64)
        k = 0
        for i, d in enumerate(num_drafts):
            tokens[i, :d] = flat[k:k + d]
            k += d
        parents = chain_parents(dmax, dev).expand(n, dmax).clone()
        depths = chain_depths(dmax, dev).expand(n, dmax).clone()
        num = torch.tensor(num_drafts, dtype=torch.int64, device=dev)
        return DDTree(tokens=tokens, parents=parents, depths=depths, num_nodes=num,
                      scores=torch.zeros(n, dmax, device=dev), ancestor_mask=None,
                      position_offsets=torch.zeros(n, dmax + 1, dtype=torch.int64,
                                                   device=dev),
                      max_depth=max(num_drafts), max_budget=dmax)

    def _uniforms(self, n, width, sampling_metadata, dev) -> torch.Tensor:
        """[n, width] uniforms: the walk's own generator, then each seeded request's
        row from its generator (both advance identically on every rank)."""
        if self._generator is None or self._generator.device != torch.device(dev):
            self._generator = torch.Generator(device=dev).manual_seed(self.seed)
        u = torch.rand(n, width, device=dev, generator=self._generator)
        for i, gen in sampling_metadata.generators.items():
            if i < n:
                u[i] = torch.rand(width, generator=gen, device=gen.device).to(dev)
        return u


def walk_seed(engine_seed) -> int:
    """The walk generator's seed: a function of the engine seed only (the same on every
    rank), mixed so its stream is not the one torch's global RNG was seeded with."""
    x = ((engine_seed or 0) ^ WALK_SEED_SALT) * 0x9E3779B97F4A7C15
    return (x ^ (x >> 29)) & ((1 << 63) - 1)


def _cut(t, n):
    return None if t is None else t[:n]
