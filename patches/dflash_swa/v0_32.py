"""dflash-swa for vLLM 0.32.0 / 0.33.0.

Per-layer sliding windows are upstream (0.25+, ``_resolve_layer_attention``); mixed
sliding/full drafters are refused on the V1 runner (``VllmConfig.
_get_v1_model_runner_unsupported_features`` and the model's own check) because the V1
``DFlashProposer`` knows one KV-cache group.  These edits lift both refusals and give
the proposer per-group block tables, slot mappings and causality (common.py).
"""

from __future__ import annotations

from functools import partial

from ..framework import Step, file_edit
from .common import MODULE, TAG, proposer_edit, replace_if

VLLM = "vllm/config/vllm.py"
MODEL = "vllm/model_executor/models/qwen3_dflash.py"
V1_FEATURES = "VllmConfig._get_v1_model_runner_unsupported_features"
RESOLVE = "_resolve_layer_attention"

VLLM_EDIT = file_edit(VLLM, [
    Step(V1_FEATURES, partial(
        replace_if, qualname=V1_FEATURES,
        test=lambda c: c.strip() == "self._dflash_needs_multi_kv_group()", code="",
        note=f"{TAG}: mixed sliding/full DFlash drafts run on V1 too: DFlashProposer\n"
             "drafts with one KV cache group per attention kind (spec_decode/dflash_swa.py)."),
        lambda code: "_dflash_needs_multi_kv_group" not in code and TAG in code),
], "V1 runner: accept mixed sliding/full DFlash drafters")

MODEL_EDIT = file_edit(MODEL, [
    Step(RESOLVE, partial(
        replace_if, qualname=RESOLVE,
        test=lambda c: "use_v2_model_runner" in c and "num_sliding" in c,
        code=f"from {MODULE} import validate_layer_types\n"
             "validate_layer_types(config)\n",
        note=f"{TAG}: mixed sliding/full attention runs on the V1 runner too\n"
             "(per-KV-cache-group DFlashProposer); other layer types are refused."),
        lambda code: "use_v2_model_runner" not in code and "validate_layer_types(config)"
        in code),
], "DFlash model: no V2-only refusal for mixed drafters; unknown layer types refused")

PROPOSER_EDIT = proposer_edit(two_sided_windows=False)

EDITS = (VLLM_EDIT, MODEL_EDIT, PROPOSER_EDIT)
