"""DDTree tree speculative decoding for vLLM (added by ddtree-patch; removed by
``ddtree-patch revert``).

Turn it on with ``speculative_config={"method": "ddtree", "model": <DFlash drafter>,
"num_speculative_tokens": B}``: one DFlash drafter pass gives per-position
distributions, ``proposer`` builds the best tree of B nodes (``core.build_tree``),
the target verifies the whole tree in one pass (tree positions + ancestor-only
attention, ``runtime`` / ``cpu_attention``), and ``sampler`` walks it (greedy or
lossless sampling), after which ``runtime`` compacts the accepted path's KV.
``core`` holds the algorithms (torch + optional Triton, no vllm import).
"""


def log(name: str, msg: str, *args, warn: bool = False) -> None:
    """One line in vLLM's log (logger ``name``; info, or a warning): logging never fails
    its caller."""
    try:
        from vllm.logger import init_logger

        logger = init_logger(name)
        (logger.warning if warn else logger.info)(msg, *args)
    except Exception:  # noqa: BLE001  (logging only)
        pass
