"""dflash-swa for vLLM 0.20.x (0.20.0/.1/.2 share these files' anchors).

0.20.x builds every DFlash draft layer as full, non-causal attention.  These edits
resolve each layer's ``(sliding_window, causal)`` with upstream 0.25+'s precedence
(payload ``resolve_layer_attention``), hand the window to the layer's ``Attention``
(its KV-cache spec becomes a sliding-window one, so vLLM's hybrid KV-cache manager
gives each attention kind its own group), accept one context slot mapping per layer
in ``precompute_and_store_context_kv``, expose the per-layer names / causality, and
hook DFlashProposer for per-group drafting (common.py).
"""

from __future__ import annotations

from functools import partial

from ..framework import AnchorError, Step, cst, edit_function, file_edit, m, replace_one
from .common import TAG, add_methods, insert_code, proposer_edit, replace_arg

MODEL = "vllm/model_executor/models/qwen3_dflash.py"
ATTN_INIT = "DFlashQwen3Attention.__init__"
LAYER_INIT = "DFlashQwen3DecoderLayer.__init__"
MODEL_INIT = "DFlashQwen3Model.__init__"
PRECOMPUTE = "DFlashQwen3Model.precompute_and_store_context_kv"
LM_FORWARD = "DFlashQwen3ForCausalLM.forward"


def _extend(items: list, new: list):
    """Append ``new`` to a parameter / argument list, keeping vLLM's one-per-line
    layout: added items take the separator of the items before them, the last one
    the original closing separator."""
    last = items[-1]
    closing = last.comma
    inner = items[-2].comma if len(items) > 1 else cst.Comma(
        whitespace_after=cst.SimpleWhitespace(" "))
    out = items[:-1] + [last.with_changes(comma=inner)]
    for k, item in enumerate(new):
        out.append(item.with_changes(comma=closing if k == len(new) - 1 else inner))
    return out


def _add_params(fn: cst.FunctionDef, new: list[str], kwonly: bool) -> cst.FunctionDef:
    """Append parameters such as ``"causal: bool = False"`` (keyword-only ones after
    the ``*``)."""
    params = fn.params
    group = list(params.kwonly_params if kwonly else params.params)
    if not group:
        raise AnchorError(f"{fn.name.value}: no parameters to extend")
    parsed = [cst.parse_statement(f"def f({p}): pass").params.params[0] for p in new]
    group = _extend(group, parsed)
    if kwonly:
        return fn.with_changes(params=params.with_changes(kwonly_params=group))
    return fn.with_changes(params=params.with_changes(params=group))


def _add_kwargs(fn: cst.FunctionDef, callee: str, kwargs: list[str]) -> cst.FunctionDef:
    """Append ``kw=value`` arguments to the one call of ``callee`` in fn."""
    parsed = [cst.parse_expression(f"f({kw})").args[0] for kw in kwargs]
    return replace_one(fn, m.Call(func=m.Name(callee)),
                       lambda node, _: node.with_changes(args=_extend(list(node.args),
                                                                      parsed)),
                       where=f"{callee}(...)")


def _attn_init(source: str) -> str:
    source = edit_function(source, ATTN_INIT, lambda fn: _add_kwargs(_add_params(
        fn, ["sliding_window: int | None = None", "causal: bool = False"], kwonly=False),
        "Attention", ["per_layer_sliding_window=sliding_window"]))
    return insert_code(source, ATTN_INIT, before=True,
                       match=lambda c: c.strip().startswith("self.attn = Attention("),
                       code=f"# {TAG}: per-layer window (None: full attention), causality\n"
                            "self.sliding_window = sliding_window\n"
                            "self.causal = causal\n")


def _layer_init(source: str) -> str:
    source = edit_function(source, LAYER_INIT, lambda fn: _add_kwargs(_add_params(
        fn, ["layer_idx: int | None = None"], kwonly=True),
        "DFlashQwen3Attention", ["sliding_window=sliding_window", "causal=causal"]))
    return insert_code(
        source, LAYER_INIT, before=True,
        match=lambda c: c.strip().startswith("self.self_attn = DFlashQwen3Attention("),
        code=f"# {TAG}: this layer's (sliding_window, causal), upstream 0.25+ rules\n"
             "from vllm.v1.spec_decode import dflash_swa\n"
             "if layer_idx is None:\n"
             "    layer_idx = dflash_swa.layer_index_from_prefix(config, prefix)\n"
             "sliding_window, causal = dflash_swa.resolve_layer_attention(config, layer_idx)\n")


def _model_init(source: str) -> str:
    return edit_function(source, MODEL_INIT, lambda fn: _add_kwargs(
        fn, "DFlashQwen3DecoderLayer", ["layer_idx=layer_idx"]))


def _precompute(source: str) -> str:
    source = insert_code(
        source, PRECOMPUTE, before=True,
        match=lambda c: c.strip().startswith("attn.impl.do_kv_cache_update("),
        code=f"# {TAG}: one context slot mapping per layer (its KV cache group)\n"
             "layer_slots = context_slot_mapping\n"
             "if isinstance(layer_slots, (list, tuple)):\n"
             "    layer_slots = layer_slots[i]\n")
    return replace_arg(source, PRECOMPUTE, m.Name("context_slot_mapping"), "layer_slots",
                       "context_slot_mapping")


LM_METHODS = f'''
def get_draft_kv_cache_layer_names(self) -> list[str]:
    """{TAG}: attention layer names, in model layer order."""
    return [layer.self_attn.attn.layer_name for layer in self.model.layers]


def get_draft_attn_causal(self) -> list[bool]:
    """{TAG}: per-layer causality, aligned with get_draft_kv_cache_layer_names."""
    return [layer.self_attn.causal for layer in self.model.layers]
'''

MODEL_EDIT = file_edit(MODEL, [
    Step(ATTN_INIT, _attn_init, "per_layer_sliding_window=sliding_window"),
    Step(LAYER_INIT, _layer_init, "resolve_layer_attention(config, layer_idx)"),
    Step(MODEL_INIT, _model_init, "layer_idx=layer_idx"),
    Step(PRECOMPUTE, _precompute, "layer_slots = layer_slots[i]"),
    Step("DFlashQwen3ForCausalLM.get_draft_attn_causal", partial(
        add_methods, qualname=LM_FORWARD, code=LM_METHODS),
        "layer.self_attn.causal for layer in self.model.layers"),
], "DFlash draft layers: per-layer sliding window and causality; per-layer context slots")

PROPOSER_EDIT = proposer_edit(two_sided_windows=True)

EDITS = (MODEL_EDIT, PROPOSER_EDIT)
