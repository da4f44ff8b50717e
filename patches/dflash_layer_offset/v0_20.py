"""#40727 for vLLM 0.20.x (the detectors also recognise the upstream form in 0.22+)."""

from __future__ import annotations

from ..framework import FileEdit, edit_function, expr, function_code, m, replace_one

RUNNER = "vllm/v1/worker/gpu_model_runner.py"
RUNNER_FN = "GPUModelRunner._get_eagle3_aux_layers_from_config"
ALGOS = "vllm/transformers_utils/configs/speculators/algos.py"
ALGOS_FN = "update_dflash"


def _runner_apply(source: str) -> str:
    if _runner_applied(source):
        return source

    def edit(fn):
        # layer_ids = dflash_config.get("target_layer_ids")
        anchor = m.Call(func=m.Attribute(value=m.Name("dflash_config"), attr=m.Name("get")),
                        args=[m.Arg(m.SimpleString('"target_layer_ids"'))])
        return replace_one(fn, anchor, expr(
            '[i + 1 for i in (dflash_config.get("target_layer_ids") or [])]'),
            where="dflash_config.get('target_layer_ids')")

    return edit_function(source, RUNNER_FN, edit)


def _runner_applied(source: str) -> bool:
    code = function_code(source, RUNNER_FN) or ""
    return "i + 1 for i in" in code and "target_layer_ids" in code


def _algos_apply(source: str) -> str:
    if _algos_applied(source):
        return source

    def edit(fn):
        # "target_layer_ids": aux_layer_ids  inside the dflash_config dict
        anchor = m.DictElement(key=m.SimpleString('"target_layer_ids"'),
                               value=m.Name("aux_layer_ids"))
        return replace_one(fn, anchor, lambda node, _: node.with_changes(
            value=expr("[i - 1 for i in aux_layer_ids]")), where='"target_layer_ids": aux_layer_ids')

    return edit_function(source, ALGOS_FN, edit)


def _algos_applied(source: str) -> bool:
    code = function_code(source, ALGOS_FN) or ""
    return "i - 1 for i in aux_layer_ids" in code


EDITS = (
    FileEdit(RUNNER, _runner_apply, _runner_applied,
             "_get_eagle3_aux_layers_from_config: target_layer_ids + 1"),
    FileEdit(ALGOS, _algos_apply, _algos_applied,
             "update_dflash: store aux_hidden_state_layer_ids - 1"),
)
