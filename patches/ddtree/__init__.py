"""DDTree for vLLM: ``ddtree-proposer`` (method "ddtree", the DFlash pass turned into a
tree of B drafts, plus the added package vllm/v1/spec_decode/ddtree) and
``ddtree-sampler`` (verify the whole tree in one target pass, walk it, commit the
accepted path).  ``ddtree-gdn``: Gated DeltaNet hybrid targets (CPU backend and CUDA
of 0.32.0 / 0.33.0).

Layout: ``payload/`` is the package added to vLLM (copied verbatim, every ``*.py``
under it); ``v0_20/`` and ``v0_32/`` are the transforms of each version family;
``reference/`` holds oracles that never ship into vLLM.
"""

from pathlib import Path

from ddtree_patcher.versions import V0_20, V0_32

from ..framework import AddedFile, Family, Transform
from .v0_20 import runner as v0_20
from .v0_32 import gdn as gdn_v0_32
from .v0_32 import gdn_cuda, structured
from .v0_32 import v1_runner as v0_32
from .v0_32 import v2_runner as v2_v0_32

PAYLOAD = Path(__file__).parent / "payload"

DEST = "vllm/v1/spec_decode/ddtree"


def payload_files() -> list[Path]:
    """Every module of the added package, sorted by its path under payload/."""
    return sorted(p for p in PAYLOAD.rglob("*.py") if "__pycache__" not in p.parts)


def _added() -> tuple[AddedFile, ...]:
    files = []
    for p in payload_files():
        rel = p.relative_to(PAYLOAD).as_posix()
        files.append(AddedFile(f"{DEST}/{rel}", p.read_bytes, f"payload {rel}"))
    return tuple(files)
PROPOSER = Transform(
    name="ddtree-proposer",
    summary="method='ddtree': one DFlash pass -> the best tree of B draft tokens "
            "(exact top-B prefixes, built on the device)",
    reference="Ringel & Romano, arXiv 2604.12989",
    families=(Family(versions=V0_20, edits=(v0_20.SPEC_EDIT, v0_20.VLLM_EDIT,
                                            v0_20.PROPOSER_RUNNER_EDIT, v0_20.INPUT_EDIT,
                                            v0_32.METRICS_EDIT),
                     added=_added()),
              Family(versions=V0_32, edits=(v0_32.SPEC_EDIT, v0_32.VLLM_EDIT,
                                            v0_32.PROPOSER_RUNNER_EDIT, v0_32.INPUT_EDIT,
                                            v0_32.METRICS_EDIT, *v2_v0_32.PROPOSER_EDITS),
                     added=_added())),
)

SAMPLER = Transform(
    name="ddtree-sampler",
    summary="verify the whole tree in one target pass (tree positions, ancestor-only "
            "attention), walk it greedily or losslessly sampled, compact the path's KV",
    reference="docs/DESIGN.md, tree verification",
    families=(Family(versions=V0_20, edits=(v0_20.SAMPLER_RUNNER_EDIT,
                                            v0_20.FLASH_EDIT, v0_20.FLEX_EDIT,
                                            v0_20.SAMPLING_EDIT)),
              Family(versions=V0_32, edits=(v0_32.SAMPLER_RUNNER_EDIT,
                                            v0_32.CPU_ATTN_EDIT, v0_32.FLASH_EDIT,
                                            v0_32.TRITON_EDIT, v0_32.SAMPLING_EDIT,
                                            structured.STRUCTURED_EDIT,
                                            *v2_v0_32.SAMPLER_EDITS))),
    requires=("ddtree-proposer",),
)

GDN = Transform(
    name="ddtree-gdn",
    summary="DDTree on Gated DeltaNet hybrids (Qwen3-Next/3.5/3.6): tree GDN state and "
            "short convolution, committed along the accepted path (CUDA: one state "
            "slot per request; CPU backend; 0.20.x: refused)",
    reference="issue 12; TreeWY arXiv 2608.20961",
    families=(Family(versions=V0_32, edits=(gdn_v0_32.CPU_GDN_EDIT,
                                            gdn_v0_32.GDN_BASE_EDIT, *gdn_cuda.EDITS)),),
    requires=("ddtree-sampler",),
)
