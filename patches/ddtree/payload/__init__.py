"""DDTree tree speculative decoding for vLLM (added by ddtree-patch; removed by
``ddtree-patch revert``).

Turn it on with ``speculative_config={"method": "ddtree", "model": <DFlash drafter>,
"num_speculative_tokens": B}``: one DFlash drafter pass gives per-position
distributions, ``proposer`` builds the best tree of B nodes (``core.build_tree``),
the target verifies the whole tree in one pass (tree positions + ancestor-only
attention, ``runtime`` / ``cpu_attention``), and ``sampler`` walks it (greedy or
lossless sampling), after which ``runtime`` compacts the accepted path's KV.
``core`` is a verbatim copy of ddtree_patcher.core (torch + optional Triton).
"""
