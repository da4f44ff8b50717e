"""DDTree for vLLM: ``ddtree-proposer`` (method "ddtree", the DFlash pass turned into a
tree of B drafts, plus the added package vllm/v1/spec_decode/ddtree) and
``ddtree-sampler`` (verify the whole tree in one target pass, walk it, commit the
accepted path).  Hooks per version family: ``v0_20`` (0.20.0-0.20.2, CUDA tree
attention) and ``v0_32`` (0.32.0, 0.33.0; ``v2_v0_32``: their V2 model runner).
``ddtree-gdn`` (gdn_v0_32): Gated DeltaNet hybrid targets, CPU backend of 0.32.0 /
0.33.0."""

from pathlib import Path

from ...versions import V0_20, V0_32
from ..framework import AddedFile, Family, Transform
from . import gdn_v0_32, v0_20, v0_32, v2_v0_32
from . import gdn_cuda_v0_32 as gdn_cuda

PAYLOAD = Path(__file__).parent / "payload"

DEST = "vllm/v1/spec_decode/ddtree"
# The heapq oracle / benchmark baseline stays out of vLLM (verify carries its own copy).
NOT_SHIPPED = ("heap_reference.py",)


def _core_dir() -> Path:
    import ddtree_patcher  # the package only: importing core would pull in torch

    return Path(ddtree_patcher.__file__).parent / "core"


def _added() -> tuple[AddedFile, ...]:
    files = []
    for p in sorted(PAYLOAD.glob("*.py")):
        files.append(AddedFile(f"{DEST}/{p.name}", p.read_bytes, f"payload {p.name}"))
    for p in sorted(_core_dir().glob("*.py")):
        if p.name in NOT_SHIPPED:
            continue
        files.append(AddedFile(f"{DEST}/core/{p.name}", p.read_bytes,
                               f"DDTree core {p.name}"))
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
                                            v0_20.FLASH_EDIT, v0_20.FLEX_EDIT)),
              Family(versions=V0_32, edits=(v0_32.SAMPLER_RUNNER_EDIT,
                                            v0_32.CPU_ATTN_EDIT, v0_32.FLASH_EDIT,
                                            v0_32.TRITON_EDIT, *v2_v0_32.SAMPLER_EDITS))),
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
