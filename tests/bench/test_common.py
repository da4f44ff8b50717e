"""bench/gpu/common.py's helpers that reach into a live engine, against the real
payload classes in a stand-in engine (a broken helper costs a whole device call:
run 9's e2e cells died in reset_arms after an ArmExpect change)."""

import json
from types import SimpleNamespace

import pytest

from .conftest import load_bench

torch = pytest.importorskip("torch")


def _common():
    return load_bench("common")


def test_reset_arms_renews_both_halves():
    from tests.gpu.conftest import payload_module

    arms, v2_arms = payload_module("sched.arms"), payload_module("sched.paired")
    ch = payload_module("sched.channel").ArmChannel()
    C = _common()
    lookup = arms.ArmLookup([0, 64, 64], 15, ch, pinned=(1, 2))
    lookup.stats[(1, 64)].add(5, 0.008)
    ex = v2_arms.ArmExpect([1, 2], 15, 15, 4, "cpu", channel=ch)
    ch.expected[1] = (2.0, 1.5)
    ex.sums[1] = 3.0
    sched = SimpleNamespace(dynamic_sd_lookup=lookup)
    spec = SimpleNamespace(expect=ex)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(
        engine_core=SimpleNamespace(engine_core=SimpleNamespace(scheduler=sched)),
        model_executor=SimpleNamespace(driver_worker=SimpleNamespace(
            worker=SimpleNamespace(model_runner=SimpleNamespace(speculator=spec))))))
    assert C.arms_of(llm) is lookup
    C.reset_arms(llm)
    fresh = sched.dynamic_sd_lookup
    assert fresh is not lookup and list(fresh) == [0, 64, 64] and fresh.chain == 15
    assert fresh.stats[(1, 64)].steps == 0
    # the engine's channel, emptied, and the pinned window stay
    assert fresh.channel is ch and ch.expected == {} and fresh.pinned == (1, 2)
    assert spec.expect is ex and float(ex.sums.abs().sum()) == 0


def _step_bench():
    return load_bench("step_bench")


def test_the_synthetic_drafter_is_the_same_for_every_config():
    """Ranks belong to the true tokens: the same text gets the same drafter whatever the
    batch it is drafted in (so configs differ only by what they draft); its top-1 is
    right as often as the profile says."""
    sb = _step_bench()
    V = 2000
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(0))
    fs = sb.FastSynthetic(perm, [0.8, 0.1, 0.04])
    meta = torch.empty(1, 1, V)
    one = fs.logits(None, {"next_token_ids": torch.tensor([5])}, 1, 6, meta)
    two = fs.logits(None, {"next_token_ids": torch.tensor([9, 5])}, 2, 6, meta)
    assert torch.equal(one.argmax(-1), two[1:].argmax(-1))
    assert torch.equal(one.topk(3, -1).indices, two[1:].topk(3, -1).indices)
    t = torch.arange(V)
    top1 = fs.logits(None, {"next_token_ids": t}, V, 1, meta).argmax(-1)[:, 0]
    assert float((top1 == perm[t]).float().mean()) == pytest.approx(0.8, abs=0.03)


def test_the_synthetic_drafter_takes_a_profile_per_depth(tmp_path):
    """A profile measured on a trained pair gives each depth its own rank law (the
    truth's rank frequencies follow it depth by depth; depths past the last use it)."""
    sb = _step_bench()
    V = 4000
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(0))
    rows = [[0.9, 0.05], [0.5, 0.2, 0.1], [0.2]]
    doc = tmp_path / "train.json"
    doc.write_text(json.dumps({"offline_acceptance": {"rank_probs_per_depth": rows}}))
    fs = sb.FastSynthetic(perm, sb.real_profile(str(doc)))
    t = torch.arange(V)
    lg = fs.logits(None, {"next_token_ids": t}, V, 5, torch.empty(1, 1, V))
    truth, cur = torch.empty(V, 5, dtype=torch.long), t
    for d in range(5):
        cur = perm[cur]
        truth[:, d] = cur
    rank = (lg > lg.gather(-1, truth.unsqueeze(-1))).sum(-1)
    for d, want in enumerate(rows + rows[-1:] * 2):
        for r, p in enumerate(want):
            assert float((rank[:, d] == r).float().mean()) == pytest.approx(p, abs=0.025)
    bad = tmp_path / "bad.json"
    bad.write_text("[[0.9, 0.5]]")
    with pytest.raises(ValueError):
        sb.real_profile(str(bad))


def test_config_names_of_the_step_bench():
    sb = _step_bench()
    cg = sb.parse("ddtree64autocgasync")
    assert cg["cg"] and cg["auto"] and cg["async_sched"] and cg["k"] == 64 and cg["chain"] == 15
    assert cg["cg"] == "1" and sb.parse("ddtree64autoasync")["cg"] is None  # the default
    assert cg["per_batch"] == [[1, 2, 63], [3, 1 << 16, 15]]  # DDTree's V2 default (64 -> 63)
    assert sb.parse("ddtree16autoasync")["per_batch"] == [[1, 2, 16], [3, 1 << 16, 15]]
    off = sb.parse("ddtree64autonocgasync")
    assert off["cg"] == "0" and off["auto"] and off["k"] == 64
    assert sb.parse("ddtree64chainasync")["per_batch"] == [[1, 2, 64], [3, 1024, 15]]
    warm = sb.parse("ddtree64autowarmnocgasync")
    assert warm["warm"] and warm["auto"] and warm["cg"] == "0" and warm["k"] == 64
    assert sb.parse("ddtree64autowarmasync")["warm"] and not cg["warm"]
    bg = sb.parse("ddtree64autowarmbgcgasync")
    assert bg["bg"] == "1" and bg["warm"] and bg["cg"] == "1" and bg["k"] == 64
    assert cg["bg"] is None  # the default (on)
    assert sb.parse("ddtree32bg") == dict(sb.parse("ddtree32"), bg="1")
    nobg = sb.parse("ddtree64autonobgasync")
    assert nobg["bg"] == "0" and nobg["auto"] and nobg["k"] == 64 and nobg["cg"] is None
    assert sb.parse("ddtree64autowarmnobgnocgasync")["bg"] == "0"
    every = sb.parse("ddtree16everyasync")  # B everywhere, the arms at every batch size
    assert every["per_batch"] == [[1, 1 << 16, 16]] and every["every"] and not every["auto"]
    assert every["chain"] == 15 and every["k"] == 16 and every["async_sched"]
    # split: the drafter's top-K select spread over programs (vocab_topk.AUTO_SELECT)
    split = sb.parse("ddtree63chainasyncsplit")
    assert split == dict(sb.parse("ddtree63chainasync"), split=True)
    assert not cg["split"] and not cg["argmax"]
    both = sb.parse("ddtree63chainasyncsplitargmax")
    assert both == dict(sb.parse("ddtree63chainasync"), split=True, argmax=True)


def test_equality_v2_reference_rows_expect_no_drafter():
    """equality_v2's checks: the no-spec references (nospec, nospec_again) need target
    graphs only; a DDTree row without drafter graphs is a problem (run 12 c3 flagged
    nospec_again for its missing drafter graphs)."""
    import os

    was = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    eq = load_bench("equality_v2")  # sets the V2 runner at import: not for this process
    assert os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == was
    a = SimpleNamespace(graphs=True, attn="TRITON_ATTN", depth=7, budget=32)
    built = {"runner": "vllm.v1.worker.gpu.model_runner.GPUModelRunner",
             "backends": ["TRITON_ATTN"], "target_graphs": "FULL_DECODE_ONLY: 8 captured"}
    for name in ("nospec", "nospec_again"):
        assert eq.checks(name, {"built": built}, a) == []
    bad = eq.checks("nospec_again", {"built": dict(built, target_graphs="NONE: 0 captured")}, a)
    assert bad and "target_graphs" in bad[0]
    row = {"built": dict(built, speculator="DDTreeSpeculator", rejection_sampler="DDTreeV2Sampler",
                         ddtree_runtime="V2DDTree", drafter_steps=7),
           "walk": {"trees": 3}}
    assert any("drafter_graphs" in p for p in eq.checks("ddtree", row, a))
    row["built"]["drafter_graphs"] = "FULL_DECODE_ONLY: 8 captured"
    assert not [p for p in eq.checks("ddtree", row, a) if "graphs" in p]


def test_equality_v2_logprob_gap_reads_only_equal_prefixes():
    """The features row's logprob check: the largest difference over the tokens both
    runs report, at the steps before the first differing token only."""
    eq = load_bench("equality_v2")
    ref = {"tokens": [[5, 6, 7]], "logprobs": [[{"5": -0.1, "9": -2.0}, {"6": -0.5},
                                                 {"7": -0.2}]]}
    got = {"tokens": [[5, 6, 8]], "logprobs": [[{"5": -0.1, "9": -2.00003}, {"6": -0.6},
                                                 {"8": -9.0}]]}
    assert abs(eq.logprob_gap(ref, got) - 0.1) < 1e-9  # step 1; step 2 differs: ignored
    assert eq.logprob_gap(ref, ref) == 0.0


def test_gdn_step_bench_configs():
    """gdn_step_bench / gdn_profile configs: ddtreechain is DDTree's chain step (a chain
    of L at every batch size: the budget pinned to L = ddtree_chain_budget)."""
    g = load_bench("gdn_step_bench")
    assert g.parse("dflash") == {"kind": "dflash", "q": 1 + g.L}
    assert g.parse("ddtree16") == {"kind": "ddtree", "b": 16, "q": 17}
    c = g.parse("ddtreechain")
    assert c["kind"] == "ddtree" and c["chain"] == g.L and c["q"] == 1 + g.L > 1
    assert c["b"] > c["chain"]  # a tree budget above the chain's: the chain is a choice
    import pytest

    with pytest.raises(SystemExit):
        g.parse("ddtreex")


def test_synthetic_v2_keeps_what_each_step_drafts(monkeypatch):
    """step_bench.use_synthetic_v2 (DDTree): a tree step keeps the synthetic top-K, a
    chain (a chain batch size, or the chain arm at a tree batch size: want <= C) keeps
    its argmax as the drafter's own sampling does there, with no top-K pass (run 12:
    DDTree's chain-arm steps paid one that DFlash's did not)."""
    import importlib
    import sys
    import types

    vt = importlib.import_module("ddtree_patcher.patches.ddtree.payload.core.vocab_topk")

    for name in ("vllm", "vllm.v1", "vllm.v1.spec_decode", "vllm.v1.spec_decode.ddtree",
                 "vllm.v1.spec_decode.ddtree.core"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.spec_decode.ddtree.core.vocab_topk", vt)
    sb = load_bench("step_bench")
    L, K, V = 3, 4, 50

    class Spec:  # the DDTreeSpeculator surface the wrapper reads
        vocab_size, num_speculative_steps, topk, chain_budget = V, L, K, 2

        def __init__(self):
            self._top_vals = torch.zeros(2 * L, K)
            self._top_idx = torch.zeros(2 * L, K, dtype=torch.int64)
            self._lse = torch.zeros(2 * L)
            self.calls = []

        def drafts_chain(self, n):
            return n >= 2

        def keep_top1(self, tokens):  # as DDTreeSpeculator.keep_top1
            m = tokens.numel()
            self._top_idx[:m, 0] = tokens
            self._top_vals[:m, 0] = 0.0
            self._top_vals[:m, 1:] = float("-inf")
            self._lse[:m] = 0.0

        def build_trees(self, batch, store, want=None):
            self.calls.append((store, want))
            return "tree"

    g = torch.Generator().manual_seed(0)
    lg = torch.randn(2, L, V, generator=g)
    synth = SimpleNamespace(logits=lambda runner, call, n, depth, meta: lg[:n, :depth])
    spec = Spec()
    runner = SimpleNamespace(speculator=spec, req_states=SimpleNamespace(
        last_sampled_tokens=torch.zeros(4, 1, dtype=torch.int64)))
    sb.use_synthetic_v2(runner, "ddtree", synth)
    one = SimpleNamespace(num_reqs=1, idx_mapping=torch.tensor([0]))
    two = SimpleNamespace(num_reqs=2, idx_mapping=torch.tensor([0, 1]))

    assert spec.build_trees(one, store=True, want=3) == "tree"  # a tree: the top-K
    top = lg[0].topk(K, -1)
    assert torch.equal(spec._top_idx[:L], top.indices)
    assert torch.isfinite(spec._top_vals[:L]).all()
    assert torch.allclose(spec._lse[:L], lg[0].logsumexp(-1))
    for batch, want in ((one, 2), (two, None)):  # chains: the argmax alone
        spec.build_trees(batch, store=True, want=want)
        m = batch.num_reqs * L
        assert torch.equal(spec._top_idx[:m, 0], lg[: batch.num_reqs].reshape(m, V).argmax(-1))
        assert (spec._top_vals[:m, 1:] == float("-inf")).all()
    before = spec._top_idx.clone()
    spec.build_trees(one, store=False, want=3)  # a dummy run: nothing written
    assert torch.equal(spec._top_idx, before)
    assert spec.calls == [(True, 3), (True, 2), (True, None), (False, 3)]
    sb.use_synthetic_v2(runner, "ddtree", synth)  # a second profile wraps the original
    spec.build_trees(one, store=False)
    assert spec.calls[-1] == (False, None) and len(spec.calls) == 5


def test_gc_pauses_counts_the_collections_inside_its_block():
    import gc

    C = _common()
    with C.GcPauses() as g:
        gc.collect()  # a full collection: generation 2
    after = len(gc.callbacks)
    s = g.summary()
    assert s["count"][2] >= 1 and s["ms"][2] >= 0.0
    gc.collect()  # outside the block: not counted, and the callback is gone
    assert g.summary() == s and g._cb not in gc.callbacks and after == len(gc.callbacks)
