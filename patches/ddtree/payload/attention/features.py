"""What of a target attention layer the tree attention serves.

A sliding window W is served (a query at position p sees keys at positions
p - W + 1 .. p, tree keys at their tree positions); ALiBi, logit softcap, attention
sinks, quantised KV caches and decode context parallelism are not.  ``check_target``
refuses those when the engine is built (the drafter's ``load_model``), so no request
ever reaches a layer the tree attention would get wrong.
"""

from __future__ import annotations


def window_of(impl) -> int | None:
    """The layer's sliding window W, or None.  The CPU backend keeps W itself (-1: none),
    FLASH_ATTN / TRITON_ATTN FlashAttention's (W - 1, 0) ((-1, -1): none)."""
    w = getattr(impl, "sliding_window", None)
    if isinstance(w, (tuple, list)):
        return None if w[0] < 0 else int(w[0]) + 1
    return None if w is None or w < 0 else int(w)


def unsupported(impl) -> list[str]:
    """The features of ``impl`` the tree attention does not serve (empty: served)."""
    bad = []
    if getattr(impl, "alibi_slopes", None) is not None:
        bad.append("ALiBi")
    if getattr(impl, "logits_soft_cap", None):
        bad.append("logit softcap")
    if getattr(impl, "sinks", None) is not None:
        bad.append("attention sinks")
    if str(getattr(impl, "kv_cache_dtype", "auto")) not in ("auto", "None"):
        bad.append(f"a quantised KV cache ({impl.kv_cache_dtype})")
    if getattr(impl, "dcp_world_size", 1) > 1:
        bad.append("decode context parallelism")
    return bad


def refusal(name: str, bad: list[str]) -> str:
    return (f"method='ddtree' does not support {', '.join(bad)} in the target's "
            f"attention yet (layer {name}): serve this model with method='dflash' "
            "(a chain) or without speculation")


def check(impl, name: str = "") -> None:
    """Raise NotImplementedError if ``impl`` uses a feature the tree attention lacks."""
    bad = unsupported(impl)
    if bad:
        raise NotImplementedError(refusal(name or type(impl).__name__, bad))


def check_target(layers: dict, draft_names) -> None:
    """Every target attention layer (``layers``: vLLM's static forward context, drafter
    layers in ``draft_names`` skipped) must be one the tree attention serves."""
    draft = set(draft_names or ())
    for name, layer in layers.items():
        impl = getattr(layer, "impl", None)
        if impl is None or name in draft or getattr(layer, "is_draft_layer", False):
            continue
        bad = unsupported(impl)
        if bad:
            raise ValueError(refusal(name, bad))
