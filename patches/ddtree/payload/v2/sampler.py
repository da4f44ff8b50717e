"""DDTreeV2Sampler: the tree sampler in place of V2's RejectionSampler (same call, same
SamplerOutput).  Logits rows of request i: cu_num_logits[i] = the root, then one per
draft node in pop order.  Greedy requests follow the target's argmax through the tree;
sampled ones walk it losslessly (core.walk_sampled: one uniform per visited node, from
the request's seed and the node's position, v2_step.uniforms).  Output: the accepted
path + bonus token, left-packed, -1 padded; num_sampled = accepted + 1 and num_rejected
= drafts - accepted (V2's own get_num_sampled_and_rejected, which also zeroes chunked
prefills), so post_update and DFlash's "valid prefix" stay right.  Requests with
penalties, bad words, logit bias, allowed tokens, min_tokens or min_p get each row
processed after its own path by V2's own processors, and logprobs come from the rows
that emitted the tokens (requests.py).
"""

from __future__ import annotations

import numpy as np

from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
from vllm.v1.worker.gpu.metrics.logits import get_num_nans
from vllm.v1.worker.gpu.sample.output import SamplerOutput

from . import requests as v2_requests
from . import step as v2_step
from ..core import row_argmax, target_probs, walk_greedy, walk_sampled


class DDTreeV2Sampler:
    # V2's warm-up switches RejectionSampler's adaptive verification off and on; the
    # tree sampler has none (adaptive verification is refused with DDTree)
    enable_adaptive_verification = False

    def __init__(self, runtime, sampler):
        self.runtime = runtime
        self.sampler = sampler  # V2's Sampler: sampling states (temperature, seeds, ...)

    def __call__(self, logits, input_batch, draft_logits=None, invalid_drafts=None):
        step = self.runtime.step
        if step is None or step.input_batch is not input_batch:
            raise RuntimeError("DDTree V2: drafts to verify but no prepared tree step")
        rt = self.runtime
        n = input_batch.num_reqs
        st = self.sampler.sampling_states
        num_nans = get_num_nans(logits) if self.sampler.compute_nans else None
        rows = v2_step.verify_rows(input_batch.cu_num_logits, n, rt.budget)
        slots_np = input_batch.idx_mapping_np
        tree = step.tree
        if invalid_drafts is not None:  # grammar: drafts verified against a permissive row
            tree = v2_requests.without_invalid(tree, invalid_drafts, input_batch.cu_num_logits,
                                               n)
        processed = v2_requests.process(self.sampler, logits, input_batch, tree)
        target = logits if processed is None else processed
        if np.all(st.temperature.np[slots_np] == 0.0):
            walk = walk_greedy(row_argmax(target)[rows], tree)
        else:
            slots = input_batch.idx_mapping
            top_k = st.top_k.gpu[slots] if np.any(st.top_k.np[slots_np] != st.vocab_size) \
                else None
            top_p = st.top_p.gpu[slots] if np.any(st.top_p.np[slots_np] != 1.0) else None
            # processed rows carry V2's temperature and min_p already
            temp = st.temperature.gpu[slots] if processed is None else \
                v2_requests.greedy_flags(self.sampler, input_batch)
            probs = target_probs(target[rows], temp, top_k, top_p)
            first = input_batch.logits_indices[input_batch.cu_num_logits[:n].long()]
            u = v2_step.uniforms(st.seeds.gpu[slots], input_batch.positions[first],
                                 rt.depth + 1, rt.fused)
            walk = walk_sampled(probs, tree, u)
        rt.walk = walk
        sampled, num_sampled = v2_step.sampler_outputs(walk, rt.budget + 1)
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            num_sampled, input_batch.seq_lens, input_batch.cu_num_logits,
            input_batch.idx_mapping, self.sampler.req_states.prefill_len.gpu)
        logprobs = v2_requests.emitted_logprobs(self.sampler, logits, input_batch, rows,
                                                walk, sampled, num_sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs,
                             num_nans=num_nans, num_sampled=num_sampled,
                             num_rejected=num_rejected)
