"""ddtree-gdn hooks for CUDA, vLLM 0.32.0 and 0.33.0 (payload gdn/cuda.py):

* qwen_gdn_linear_attn.py ``QwenGatedDeltaNetAttention._forward_core``: with DDTree on,
  the speculative rows run the tree path (``tree_spec_forward``) instead of vLLM's
  chain conv update and recurrent kernel; prefill and decode rows of the same batch
  keep vLLM's kernels.  ``_can_use_fused_gdn_mtp_decode`` says no under DDTree, so
  the fused CUDA MTP kernel (chain only) is never picked.
* gdn_attn.py ``GDNAttentionMetadataBuilder.__init__``: the persistent state-index
  buffer of FULL CUDA graphs has 1 + num_speculative_blocks columns (one slot per
  request under DDTree), not 1 + num_speculative_tokens.
* model_states/mamba_hybrid.py ``MambaHybridModelState.prepare_attn`` (V2 runner):
  the target's attention metadata is marked for tree attention, as
  ``DefaultModelState.prepare_attn`` is for dense targets.
Without DDTree the stock code runs unchanged.
"""

from __future__ import annotations

from ...framework import AnchorError, Step, cst, code_of, edit_function, file_edit, \
    hook_code, statements
from ..hooks import PKG, RUNTIME, hook, on

GDN_LAYER = "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py"
GDN_BUILDER = "vllm/v1/attention/backends/gdn_attn.py"
MAMBA_STATE = "vllm/v1/worker/gpu/model_states/mamba_hybrid.py"
ON = on("self.speculative_config")
SPEC = "spec_sequence_masks is not None"

TREE_CALL = "ddtree_spec_out = None\n" + hook_code(
    "ddtree_spec_out = tree_spec_forward(self, attn_metadata, mixed_qkv_spec, b_spec,\n"
    "                                    a_spec, conv_state, ssm_state)\n",
    guard=f"{SPEC} and {ON}", imports=("gdn.cuda", "tree_spec_forward"), package=PKG)
TAKE = ("if ddtree_spec_out is not None:\n"
        "    core_attn_out_spec = ddtree_spec_out\n")


def _spec_ifs(fn, needle: str) -> list:
    hits = []

    class Find(cst.CSTVisitor):
        def visit_If(self, node):
            if code_of(node.test).strip() == SPEC and needle in code_of(node.body):
                hits.append(node)

    fn.visit(Find())
    return hits


def _route_spec_rows(source: str) -> str:
    """Three edits of ``_forward_core``: the tree call after the speculative rows are
    selected, vLLM's chain conv and recurrence guarded off when it ran, and its output
    taken as ``core_attn_out_spec``."""

    def edit(fn):
        anchors = {}
        for key, needle in (("select", "mixed_qkv_spec = mixed_qkv.index_select("),
                            ("conv", "causal_conv1d_update("),
                            ("rec", "fused_sigmoid_gating_delta_rule_update(")):
            hits = _spec_ifs(fn, needle)
            if len(hits) != 1:
                raise AnchorError(f"_forward_core: 'if {SPEC}:' around {needle!r} found "
                                  f"{len(hits)} times (need exactly 1)")
            anchors[key] = hits[0]
        test = cst.parse_expression(f"{SPEC} and ddtree_spec_out is None")

        class Edit(cst.CSTTransformer):
            def leave_If(self, original, updated):
                if original is anchors["select"]:
                    return cst.FlattenSentinel([updated, *statements(TREE_CALL)])
                if original is anchors["conv"]:
                    return updated.with_changes(test=test)
                if original is anchors["rec"]:
                    return cst.FlattenSentinel([updated.with_changes(test=test),
                                                *statements(TAKE)])
                return updated

        return fn.visit(Edit())

    return edit_function(source, "QwenGatedDeltaNetAttention._forward_core", edit)


GDN_LAYER_EDIT = file_edit(GDN_LAYER, [
    Step("QwenGatedDeltaNetAttention._forward_core", _route_spec_rows,
         "core_attn_out_spec = ddtree_spec_out"),
    hook("QwenGatedDeltaNetAttention._can_use_fused_gdn_mtp_decode",
         "return False  # DDTree verifies trees (gdn/cuda.py), not chains\n", guard=ON,
         marker="return False  # DDTree verifies trees"),
], "GDN speculative steps verify trees when DDTree is on (CUDA)")

GDN_BUILDER_EDIT = file_edit(GDN_BUILDER, [
    hook("GDNAttentionMetadataBuilder.__init__",
         "# DDTree: one state slot per request (num_speculative_blocks = 0)\n"
         "self.spec_state_indices_tensor = torch.empty(\n"
         "    (self.decode_cudagraph_max_bs,\n"
         "     1 + kv_cache_spec.num_speculative_blocks),\n"
         "    dtype=torch.int32, device=device)\n", guard=ON,
         at=lambda c: c.strip().startswith("self.spec_state_indices_tensor"),
         marker="1 + kv_cache_spec.num_speculative_blocks)"),
], "GDN metadata: FULL-graph state indices sized by the slots DDTree keeps")

MAMBA_STATE_EDIT = file_edit(MAMBA_STATE, [
    hook("MambaHybridModelState.prepare_attn",
         "self.ddtree.mark(input_batch, attn_metadata, for_capture)\n", guard=RUNTIME,
         at=lambda c: c.lstrip().startswith("attn_metadata = build_attn_metadata("),
         marker="self.ddtree.mark("),
], "V2 runner, hybrid targets: tree attention for verify steps and FULL graph captures")

EDITS = (GDN_LAYER_EDIT, GDN_BUILDER_EDIT, MAMBA_STATE_EDIT)
