"""dflash-layer-offset: DFlash drafters read the *output* of target layer k (PR #40727).

vLLM's aux-hidden-state hook captures the input of a layer, so the runner must ask for
layer ``k + 1`` and the speculators-format loader must store ``aux - 1``.  0.20.x lacks
the fix (``v0_20``); 0.32.0 and 0.33.0 ship it, which the same detectors confirm.
"""

from ddtree_patcher.versions import V0_20, V0_32
from ..framework import Family, Transform
from . import v0_20

TRANSFORM = Transform(
    name="dflash-layer-offset",
    summary="DFlash reads target layer k's output: aux layer ids = target_layer_ids + 1",
    reference="vLLM PR #40727",
    families=(
        Family(versions=V0_20, edits=v0_20.EDITS),
        Family(versions=V0_32, edits=v0_20.EDITS, upstream=True,
               note="upstream since 0.22"),
    ),
)
