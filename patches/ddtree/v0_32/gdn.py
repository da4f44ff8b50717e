"""ddtree-gdn hooks for vLLM 0.32.0 and 0.33.0: with DDTree on, the speculative steps
of Gated DeltaNet layers on the CPU backend run the tree path (payload/gdn/cpu.py).

* ops/cpu/gdn_attention.py: at the top of ``_spec_forward`` (the CPU backend's GDN
  core for the speculative tokens, once per GDN layer and step).
* gdn/base.py: GDN layers keep one state slot per request on CUDA (gdn_cuda.py reads
  and writes the committed state in column 0), L + 1 on the CPU backend (L =
  ddtree_depth: its path reads slot num_accepted - 1 <= L), instead of B + 1 (vLLM
  sizes them by num_speculative_tokens, which is the tree budget B for DDTree).
Without DDTree the stock code runs unchanged.  The commit after the walk is called
by the DDTree runtime (payload/runtime.py).  CUDA: gdn_cuda.py hooks
qwen_gdn_linear_attn.py::_forward_core (payload gdn_cuda.py).
"""

from __future__ import annotations

from functools import partial

from ...framework import Step, add_after_function, file_edit
from ..hooks import hook, on

CPU_GDN = "vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py"
GDN_BASE = "vllm/model_executor/layers/mamba/gdn/base.py"

CPU_GDN_EDIT = file_edit(CPU_GDN, [
    hook("_spec_forward",
         "return tree_spec_forward(layer, attn_metadata_i, mixed_qkv_spec, b_spec, a_spec,\n"
         "                         conv_buf, ssm_state, width)\n",
         guard=on("layer.speculative_config", "getattr(layer, 'speculative_config', None)"),
         imports=("gdn.cpu", "tree_spec_forward"), marker="tree_spec_forward("),
], "GDN speculative steps verify trees when DDTree is on (CPU backend)")

DDTREE_ON = on("self.speculative_config")
GDN_BASE_EDIT = file_edit(GDN_BASE, [
    hook("GatedDeltaNetAttention.__init__",
         "# one state slot per request on CUDA (the tree path keeps no per-draft\n"
         "# slots); the CPU path reads slots up to ddtree_depth\n"
         "self.num_spec = state_slots(self.num_spec, self.speculative_config)\n",
         guard=DDTREE_ON, imports=("gdn.cuda", "state_slots"),
         at=lambda c: c.strip().startswith("self.num_spec = ("),
         marker="state_slots(self.num_spec, self.speculative_config)"),
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
