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

from functools import partial

from ..framework import Step, file_edit, insert_near
from . import v0_32

SPEC = v0_32.SPEC
VLLM = v0_32.VLLM
RUNNER = v0_32.RUNNER
INPUT = v0_32.INPUT
FLASH = "vllm/v1/attention/backends/flash_attn.py"
FLEX = "vllm/v1/attention/backends/flex_attention.py"
PKG = v0_32.PKG

# speculative.py and input_processor.py take the same edits as 0.32 (same anchors)
SPEC_EDIT = v0_32.SPEC_EDIT
INPUT_EDIT = v0_32.INPUT_EDIT

VLLM_EDIT = file_edit(VLLM, [v0_32.VLLM_POST_INIT],
                      "synchronous scheduling and the V1 runner for DDTree")

PROPOSER_RUNNER_EDIT = v0_32.PROPOSER_RUNNER_EDIT

SAMPLER_RUNNER_EDIT = file_edit(RUNNER, [
    v0_32.runtime_step("cuda_runtime.make_runtime"),
    v0_32.PREPARE,
    v0_32.ATTACH,
    Step("GPUModelRunner._dummy_run", partial(
        insert_near, qualname="GPUModelRunner._dummy_run",
        match=lambda c: c.lstrip().startswith("attn_metadata, _ = self._build_attention_metadata("),
        code="if getattr(self, 'ddtree', None) is not None:\n"
             "    self.ddtree.attach_dummy(attn_metadata)\n"), "self.ddtree.attach_dummy("),
    v0_32.COMMIT,
], "tree sampler, tree positions, tree attention metadata (also for CUDA-graph "
   "capture), path commit")


def _tree_hook(backend: str) -> str:
    return (f"if getattr(attn_metadata, 'ddtree', None) is not None and "
            f"attn_metadata.causal:\n"
            f"    from {PKG}.cuda_attention import tree_attention\n"
            f"    return tree_attention(self, layer, query, key, value, kv_cache,\n"
            f"                          attn_metadata, output, {backend!r})\n")


def _before_num_actual_tokens(c: str) -> bool:
    # the statement's code carries the comment lines above it: look at its last line
    return c.strip().splitlines()[-1].strip() == \
        "num_actual_tokens = attn_metadata.num_actual_tokens"


FLASH_EDIT = file_edit(FLASH, [
    Step("FlashAttentionImpl.forward", partial(
        insert_near, qualname="FlashAttentionImpl.forward",
        match=_before_num_actual_tokens, before=True, code=_tree_hook("flash_attn")),
        "tree_attention("),
], "tree attention (per-request ancestor mask, Triton) for DDTree verify steps on FA")

FLEX_EDIT = file_edit(FLEX, [
    Step("FlexAttentionImpl.forward", partial(
        insert_near, qualname="FlexAttentionImpl.forward",
        match=_before_num_actual_tokens, before=True, code=_tree_hook("flex_attention")),
        "tree_attention("),
], "tree attention (per-request ancestor mask, Triton) for DDTree verify steps on "
   "FlexAttention")
