"""DDTree hooks for vLLM 0.20.0, 0.20.1 and 0.20.2 (V1 runner; CUDA attention backends).

Same design as ``v0_32`` (method "ddtree" -> DFlash + ``ddtree_budget``; the hooks call
into the added package vllm/v1/spec_decode/ddtree).  What differs on 0.20.x:

* no ``VllmConfig.use_v2_model_runner``: the V1 runner is the default and
  ``ddtree_vllm_config`` refuses ``VLLM_USE_V2_MODEL_RUNNER`` itself;
* one attention backend serves target and drafter, and DFlash needs non-causal
  attention everywhere, so the target runs on FLASH_ATTN (FA3) or FLEX_ATTENTION.
  Neither takes a mask: verify steps go through ``cuda_attention.tree_attention``
  (a Triton paged-attention kernel with a per-request ancestor mask), hooked into
  both backends' ``forward``;
* CUDA graphs: the runner marks the attention metadata of every dummy / capture run
  too (``attach_dummy``), so FULL graphs are captured with the tree kernel, whose
  per-request tree inputs live in static buffers (positions already do);
* the runtime is ``cuda_runtime.CudaDDTreeRuntime`` on CUDA (no host syncs, KV
  compaction in the paged cache), the CPU one elsewhere.
"""

from __future__ import annotations

from ...framework import file_edit
from ..v0_32 import v1_runner as v0_32

SPEC = v0_32.SPEC
VLLM = v0_32.VLLM
RUNNER = v0_32.RUNNER
INPUT = v0_32.INPUT
FLASH = "vllm/v1/attention/backends/flash_attn.py"
FLEX = "vllm/v1/attention/backends/flex_attention.py"

# speculative.py and input_processor.py take the same edits as 0.32 (same anchors)
SPEC_EDIT = v0_32.SPEC_EDIT
INPUT_EDIT = v0_32.INPUT_EDIT
SAMPLING_EDIT = v0_32.SAMPLING_EDIT

VLLM_EDIT = file_edit(VLLM, [v0_32.VLLM_POST_INIT],
                      "synchronous scheduling and the V1 runner for DDTree")

PROPOSER_RUNNER_EDIT = v0_32.PROPOSER_RUNNER_EDIT

# 0.20.x checks the drafter's fit inline (no _input_fits_in_drafter): 0.32's steps but
# FITS_DRAFTER
SAMPLER_RUNNER_EDIT = file_edit(
    v0_32.RUNNER, v0_32.SAMPLER_RUNNER_STEPS,
    v0_32.SAMPLER_RUNNER_WHAT + "; the CUDA runtime on GPUs, the CPU one on CPUs")

# 0.20.x keeps K and V apart: [2, blocks, block_size, heads, D]; the drafter's
# (non-causal) metadata goes through the same backend, so only causal rows are hooked
FLASH_EDIT = v0_32.backend_edit(FLASH, "FlashAttentionImpl", "flash_attn", "kv_outer",
                                "FA", causal_only=True)
FLEX_EDIT = v0_32.backend_edit(FLEX, "FlexAttentionImpl", "flex_attention", "kv_outer",
                               "FlexAttention", causal_only=True)
