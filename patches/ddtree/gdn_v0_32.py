"""ddtree-gdn hooks for vLLM 0.32.0 and 0.33.0: with DDTree on, the speculative steps
of Gated DeltaNet layers on the CPU backend run the tree path (payload/gdn.py).

One hook, at the top of ``_spec_forward`` in ops/cpu/gdn_attention.py (the CPU
backend's GDN core for the speculative tokens, called once per GDN layer and step);
without DDTree the stock code runs unchanged.  The commit after the walk is called
by the DDTree runtime (payload/runtime.py).  CUDA is not routed: there the GDN core
is qwen_gdn_linear_attn.py::_forward_core (Triton / the fused MTP kernel), and
DDTree refuses GDN targets (payload/gdn.py: unsupported_reason).
"""

from __future__ import annotations

from functools import partial

from ..framework import Step, file_edit, insert_at_start

CPU_GDN = "vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py"
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
