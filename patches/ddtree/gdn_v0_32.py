"""ddtree-gdn hooks for vLLM 0.32.0 and 0.33.0: with DDTree on, the speculative steps
of Gated DeltaNet layers on the CPU backend run the tree path (payload/gdn.py).

* ops/cpu/gdn_attention.py: at the top of ``_spec_forward`` (the CPU backend's GDN
  core for the speculative tokens, once per GDN layer and step).
* gdn/base.py: GDN layers keep L + 1 state slots per request (L = ddtree_depth: the
  tree path reads slot num_accepted - 1 <= L) instead of B + 1 (vLLM sizes them by
  num_speculative_tokens, which is the tree budget B for DDTree).
Without DDTree the stock code runs unchanged.  The commit after the walk is called
by the DDTree runtime (payload/runtime.py).  CUDA is not routed: there the GDN core
is qwen_gdn_linear_attn.py::_forward_core (Triton / the fused MTP kernel), and
DDTree refuses GDN targets (payload/gdn.py: unsupported_reason).
"""

from __future__ import annotations

from functools import partial

from ..framework import Step, add_after_function, file_edit, insert_at_start, insert_near

CPU_GDN = "vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py"
GDN_BASE = "vllm/model_executor/layers/mamba/gdn/base.py"
PKG = "vllm.v1.spec_decode.ddtree"

CPU_GDN_EDIT = file_edit(CPU_GDN, [
    Step("_spec_forward", partial(
        insert_at_start, qualname="_spec_forward",
        code=f"if getattr(getattr(layer, 'speculative_config', None), 'ddtree_budget',\n"
             f"           None) is not None:\n"
             f"    from {PKG}.gdn import tree_spec_forward\n"
             f"    return tree_spec_forward(layer, attn_metadata_i, mixed_qkv_spec, b_spec,\n"
             f"                             a_spec, conv_buf, ssm_state, width)\n"),
        "tree_spec_forward("),
], "GDN speculative steps verify trees when DDTree is on (CPU backend)")

DDTREE_ON = "getattr(self.speculative_config, 'ddtree_budget', None) is not None"
GDN_BASE_EDIT = file_edit(GDN_BASE, [
    Step("GatedDeltaNetAttention.__init__", partial(
        insert_near, qualname="GatedDeltaNetAttention.__init__",
        match=lambda c: c.strip().startswith("self.num_spec = ("),
        code=f"# DDTree: accepted paths are at most ddtree_depth long\n"
             f"if {DDTREE_ON}:\n"
             f"    self.num_spec = min(self.num_spec, self.speculative_config.ddtree_depth)\n"),
        "self.speculative_config.ddtree_depth)"),
    Step("GatedDeltaNetAttention.get_kv_cache_spec", partial(
        add_after_function, qualname="GatedDeltaNetAttention.get_state_dtype",
        code=f"def get_kv_cache_spec(self, vllm_config):\n"
             f"    spec = super().get_kv_cache_spec(vllm_config)\n"
             f"    if spec.num_speculative_blocks and \\\n"
             f"            {DDTREE_ON}:\n"
             f"        import dataclasses\n\n"
             f"        spec = dataclasses.replace(spec, num_speculative_blocks=self.num_spec)\n"
             f"    return spec\n"),
        "dataclasses.replace(spec, num_speculative_blocks=self.num_spec)"),
], "GDN layers keep ddtree_depth + 1 state slots per request under DDTree, not B + 1")
