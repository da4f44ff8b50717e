"""Draft graphs of the chain arm (V2 runner, the tree-vs-chain choice of arms.py).

At a batch size whose budget is a tree the scheduler may play the chain (C drafts).
Its draft step would then replay the tree step's draft graph: a top-K pass over the
vocabulary per position and 1 + B context rows per request, where DFlash's own chain
samples an argmax over 1 + C rows (H200, run 9: the chain arm's step 3-4 % dearer than
DFlash's).  So the speculator captures a second set of draft graphs for those batch
sizes only, in chain mode (DFlash's sampling, 1 + C context rows per request), and a
chain-arm draft replays those (H200, run 10: a chain step at one request 6.72 ms vs
DFlash's 6.71, without them 6.81; lossless under FULL graphs).  On by default;
ddtree_chain_graphs=False turns them off (the chain arm then replays the tree's).

The target's verify of a chain-arm step (1 + C tokens per request) needs FULL graphs of
its own too.  vLLM captures uniform decode graphs for the query lengths its per-batch
schedule holds up to max_num_seqs, so with max_num_seqs <= 2 (or a chain budget that no
batch size of the schedule uses) none had 1 + C and every chain-arm step ran the target
eagerly (H200, run 11: 27-45 ms against 6.8).  ``target_query_lens`` adds 1 + C.
"""

from __future__ import annotations

from .. import log


def log_state(mgr) -> None:
    """One log line: what was set up for the chain arm's drafts."""
    log(__name__, "DDTree: the chain arm's own draft graphs: %s (ddtree_chain_graphs="
        "False turns them off)", "captured for the tree batch sizes" if mgr is not None
        else "none (no FULL draft graphs at the tree batch sizes)")


def target_query_lens(mgr, lens: list, sampled: int) -> list:
    """CudaGraphManager._init_candidates hook: the target's uniform decode query lengths
    ``lens`` plus 1 + C (``sampled`` new tokens per step) when the scheduler may play
    the chain arm (ddtree_budget_control='auto'); the drafter's managers keep theirs."""
    from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager

    cfg = mgr.vllm_config.speculative_config.ddtree_config
    c = cfg.chain_budget
    if not isinstance(mgr, ModelCudaGraphManager) or c < 1 or cfg.budget_control != "auto":
        return lens
    return sorted(set(lens) | {c + sampled})


def make(spec, sizes):
    """A second DFlashCudaGraphManager for the chain arm at the batch sizes ``sizes``
    (what spec's own manager would replay for them), or None (no FULL graphs, or none
    of those sizes has one)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.spec_decode.dflash.cudagraph import DFlashCudaGraphManager

    main = spec.query_cudagraph_manager
    if main is None or not main.cudagraph_mode or not sizes:
        return None
    mgr = DFlashCudaGraphManager(spec.vllm_config, spec.device, main.cudagraph_mode,
                                 decode_query_len=spec.num_query_per_req)
    keep = [d for d in descs_for(mgr, sizes, spec.num_query_per_req)
            if d.cg_mode == CUDAGraphMode.FULL]
    restrict(mgr, keep)
    return mgr if mgr.needs_capture() else None


def descs_for(mgr, sizes, q: int) -> list:
    """The descriptors ``mgr.dispatch`` picks for uniform draft steps of n requests x
    q queries, n in ``sizes`` (as DFlash's propose asks), before any capture."""
    was = mgr._graphs_captured
    mgr._graphs_captured = True  # dispatch answers only once graphs exist
    try:
        out = []
        for n in sizes:
            d = mgr.dispatch(n, n * q, q, 0)
            if d not in out:
                out.append(d)
        return out
    finally:
        mgr._graphs_captured = was


def restrict(mgr, keep) -> None:
    """Capture only ``keep``; dispatch only to them (anything else runs eagerly)."""
    mgr._capture_descs = {m: [d for d in ds if d in keep]
                          for m, ds in mgr._capture_descs.items()}
    mgr._capture_descs = {m: ds for m, ds in mgr._capture_descs.items() if ds}
    mgr._candidates = {key: [d for d in ds if d in keep]
                       for key, ds in mgr._candidates.items()}
    mgr._candidates = {key: ds for key, ds in mgr._candidates.items() if ds}
