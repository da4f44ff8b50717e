"""dflash-swa: DFlash drafters with sliding-window layers on vLLM's V1 runner.

0.20.x: every draft layer runs full attention; ``v0_20`` gives each layer the window
and causality upstream 0.25+ derives from ``layer_types`` / ``dflash_config.use_swa`` /
``swa_window_size`` / ``sliding_window`` (mixed drafters get one KV-cache group per
attention kind).  0.32.0 / 0.33.0: the windows are upstream but mixed sliding/full
drafters are refused on V1; ``v0_32`` lifts that.  Both: the V1 DFlashProposer drafts
with one block table / slot mapping / causality per KV-cache group and writes the
context K/V into every group (added module vllm/v1/spec_decode/dflash_swa.py).
"""

from ddtree_patcher.versions import V0_20, V0_32
from ..framework import Family, Transform
from . import v0_20, v0_32
from .common import ADDED

TRANSFORM = Transform(
    name="dflash-swa",
    summary="DFlash sliding-window drafters: per-layer windows (0.20.x) and mixed "
            "sliding/full drafters on the V1 runner (per-KV-group proposer)",
    reference="vLLM PR #40898 (closed), #47914 (V2 only)",
    families=(
        Family(versions=V0_20, edits=v0_20.EDITS, added=ADDED),
        Family(versions=V0_32, edits=v0_32.EDITS, added=ADDED,
               note="per-layer windows upstream since 0.25; V1 mixed drafters added"),
    ),
)
