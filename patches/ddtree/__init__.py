"""DDTree for vLLM: ``ddtree-proposer`` (method "ddtree", the DFlash pass turned into a
tree of B drafts, plus the added package vllm/v1/spec_decode/ddtree) and
``ddtree-sampler`` (verify the whole tree in one target pass, walk it, commit the
accepted path).  Hooks per version family: ``v0_20`` (0.20.0-0.20.2, CUDA tree
attention) and ``v0_32`` (0.32.0, 0.33.0)."""

from pathlib import Path

from ..framework import AddedFile, Family, Transform
from . import v0_20, v0_32

PAYLOAD = Path(__file__).parent / "payload"

DEST = "vllm/v1/spec_decode/ddtree"


def _core_dir() -> Path:
    import ddtree_patcher  # the package only: importing core would pull in torch

    return Path(ddtree_patcher.__file__).parent / "core"


def _added() -> tuple[AddedFile, ...]:
    files = []
    for p in sorted(PAYLOAD.glob("*.py")):
        files.append(AddedFile(f"{DEST}/{p.name}", p.read_bytes, f"payload {p.name}"))
    for p in sorted(_core_dir().glob("*.py")):
        files.append(AddedFile(f"{DEST}/core/{p.name}", p.read_bytes,
                               f"DDTree core {p.name}"))
    return tuple(files)


V0_20 = ("0.20.0", "0.20.1", "0.20.2")
V0_32 = ("0.32.0", "0.33.0")

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
                                            v0_32.METRICS_EDIT),
                     added=_added())),
)

SAMPLER = Transform(
    name="ddtree-sampler",
    summary="verify the whole tree in one target pass (tree positions, ancestor-only "
            "attention), walk it greedily or losslessly sampled, compact the path's KV",
    reference="DESIGN.md sections 5-6",
    families=(Family(versions=V0_20, edits=(v0_20.SAMPLER_RUNNER_EDIT,
                                            v0_20.FLASH_EDIT, v0_20.FLEX_EDIT)),
              Family(versions=V0_32, edits=(v0_32.SAMPLER_RUNNER_EDIT,
                                            v0_32.CPU_ATTN_EDIT))),
    requires=("ddtree-proposer",),
)
