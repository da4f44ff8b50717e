"""The tree-vs-chain controller of the V2 runner (payload/arms.py), against a simulated
engine: each step verifies the drafts the lookup chose one step earlier (as vLLM's
scheduler does), takes the arm's time and emits the arm's tokens.  Deterministic
(a fake clock, seeded token counts); no vLLM needed."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from .conftest import HAS_CUDA, payload_module

arms = payload_module("arms")

TREE, CHAIN = 64, 15


def out(reqs: dict[str, int], drafts: dict[str, int], sampled: list[int]):
    """A SchedulerOutput / ModelRunnerOutput pair: reqs = scheduled tokens per request,
    drafts = draft count per request (placeholders), sampled = tokens emitted."""
    so = SimpleNamespace(num_scheduled_tokens=reqs,
                         scheduled_spec_decode_tokens={r: [-1] * k for r, k in drafts.items()})
    return so, SimpleNamespace(sampled_token_ids=[[7] * t for t in sampled])


def simulate(lookup, cost: dict, tau: dict, steps: int = 600, n: int = 1, seed: int = 0):
    """Run ``steps`` decode steps of n requests; returns the k verified per step."""
    clock = [0.0]
    lookup.clock = lambda: clock[0]
    rng = random.Random(seed)
    k = lookup[n]
    seen = []
    for _ in range(steps):
        nxt = lookup[n]  # the scheduler picks the next step's drafts before this output
        clock[0] += cost[k] * rng.uniform(0.95, 1.05)
        sampled = [max(1, min(k + 1, round(rng.gauss(tau[k], 1.0)))) for _ in range(n)]
        names = [f"r{i}" for i in range(n)]
        lookup.observe(*out({r: 1 + k for r in names}, {r: k for r in names}, sampled))
        seen.append(k)
        k = nxt
    return seen


@pytest.mark.parametrize("cost,tau,winner", [
    ({TREE: 7.9, CHAIN: 6.8}, {TREE: 1.0, CHAIN: 1.0}, CHAIN),   # random drafter
    ({TREE: 7.9, CHAIN: 6.8}, {TREE: 4.6, CHAIN: 3.1}, TREE),    # p60-like
    ({TREE: 7.9, CHAIN: 6.8}, {TREE: 6.0, CHAIN: 5.6}, CHAIN),   # the tree does not pay
    ({TREE: 11.4, CHAIN: 7.2}, {TREE: 6.0, CHAIN: 4.5}, CHAIN),  # 1.58x cost, 1.33x tau
])
def test_the_faster_arm_gets_the_steps(cost, tau, winner, monkeypatch):
    monkeypatch.delenv("VLLM_DDTREE_ARMS", raising=False)
    lookup = arms.ArmLookup([0, TREE, TREE, CHAIN], CHAIN)
    seen = simulate(lookup, cost, tau)
    tail = seen[100:]
    share = tail.count(winner) / len(tail)
    assert share >= 0.9, (share, lookup.summary())
    loser = TREE if winner == CHAIN else CHAIN
    assert loser in tail, "the other arm is never tried again"
    # tokens/s reached vs always playing the winner: within the exploration's cost
    rate = lambda k: tau[k] / cost[k]  # noqa: E731  (simulate emits tau tokens a step)
    got = sum(rate(k) * cost[k] for k in tail) / sum(cost[k] for k in tail)
    assert got >= 0.95 * rate(winner)


def test_a_change_of_acceptance_is_followed(monkeypatch):
    """The chain wins for a random drafter; when the drafter turns good, the tree wins."""
    monkeypatch.delenv("VLLM_DDTREE_ARMS", raising=False)
    lookup = arms.ArmLookup([0, TREE, CHAIN], CHAIN)
    cost = {TREE: 7.9, CHAIN: 6.8}
    first = simulate(lookup, cost, {TREE: 0.5, CHAIN: 0.5}, steps=400)
    assert first[-100:].count(CHAIN) >= 85
    second = simulate(lookup, cost, {TREE: 7.0, CHAIN: 3.0}, steps=600, seed=1)
    assert second[-200:].count(TREE) >= 180


def test_only_tree_batch_sizes_have_arms_and_the_list_stays_a_list(monkeypatch):
    monkeypatch.delenv("VLLM_DDTREE_ARMS", raising=False)
    base = [0, 32, 32, 16, 7, 7]
    lookup = arms.ArmLookup(base, 7)
    assert lookup.arms == {1: (32, 7), 2: (32, 7), 3: (16, 7)}
    assert lookup[4] == 7 and lookup[5] == 7 and lookup[-1] == 7
    assert list(lookup) == base and len(lookup) == 6 and lookup[1:3] == [32, 32]
    assert lookup[1] == 32  # uncalibrated: the tree first
    assert arms.ArmLookup([0, 7, 7], 7).arms == {}  # nothing larger than the chain
    assert arms.ArmLookup([0, 8, 8], 0).arms == {}  # no chain to play against


def test_steps_that_are_not_pure_decode_are_not_measured(monkeypatch):
    monkeypatch.delenv("VLLM_DDTREE_ARMS", raising=False)
    lookup = arms.ArmLookup([0, TREE, TREE], CHAIN)
    t = [0.0]
    lookup.clock = lambda: t[0]

    def step(dt, reqs, drafts, sampled):
        t[0] += dt
        lookup.observe(*out(reqs, drafts, sampled))

    step(1, {"a": 65}, {"a": 64}, [5])            # first decode step: no interval yet
    step(1, {"a": 65}, {"a": 64}, [5])            # measured
    assert lookup.stats[(1, TREE)].steps == 1
    step(9, {"a": 300}, {}, [1])                  # a prefill: not measured...
    step(1, {"a": 65}, {"a": 64}, [5])            # ...nor the interval after it
    step(1, {"a": 65, "b": 16}, {"a": 64, "b": 15}, [5, 2])  # mixed widths
    step(1, {"a": 65, "b": 40}, {"a": 64, "b": 64}, [5, 2])  # b: a partial verify
    step(1, {"a": 65, "b": 65}, {"a": 64}, [5, 1])  # b without drafts
    step(0.5, {}, {}, [])                         # an empty step
    assert lookup.stats[(1, TREE)].steps == 1 and lookup.stats[(2, TREE)].steps == 0
    step(1, {"a": 65, "b": 65}, {"a": 64, "b": 64}, [5, 1])
    step(2, {"a": 65, "b": 65}, {"a": 64, "b": 64}, [5, 1])
    s = lookup.stats[(2, TREE)]
    assert s.steps == 1 and s.tokens == 6 and s.seconds == 2
    step(1, {"a": 17}, {"a": 16}, [3])            # 16 drafts: no such arm (skipped)
    assert sum(a.steps for a in lookup.stats.values()) == 2


def test_window_and_exploration_knobs(monkeypatch):
    monkeypatch.setenv("VLLM_DDTREE_ARMS", "1,2")
    lookup = arms.ArmLookup([0, TREE], CHAIN)
    assert (lookup.window, lookup.explore) == (1, 2)
    seen = simulate(lookup, {TREE: 1.0, CHAIN: 1.0}, {TREE: 3.0, CHAIN: 2.9}, steps=60)
    assert 10 <= seen[20:].count(CHAIN) <= 30  # every other choice explores
    for bad in ("1", "0,4", "2,1", "a,b", "1,2,3"):
        monkeypatch.setenv("VLLM_DDTREE_ARMS", bad)
        with pytest.raises(ValueError, match="VLLM_DDTREE_ARMS"):
            arms.ArmLookup([0, TREE], CHAIN)


def test_wrap_lookup_only_for_the_v2_controller(monkeypatch):
    monkeypatch.delenv("VLLM_DDTREE_ARMS", raising=False)

    def sched(v2=True, control="auto", budget=32, chain=7):
        spec = SimpleNamespace(ddtree_budget=budget, ddtree_budget_control=control,
                               ddtree_chain_budget=chain)
        return SimpleNamespace(vllm_config=SimpleNamespace(use_v2_model_runner=v2,
                                                           speculative_config=spec))

    base = [0, 32, 32, 7]
    assert isinstance(arms.wrap_lookup(sched(), base), arms.ArmLookup)
    for s in (sched(v2=False), sched(control="off"), sched(control=None),
              sched(budget=None), sched(chain=0), sched(chain=None)):
        assert arms.wrap_lookup(s, base) is base
    assert arms.wrap_lookup(sched(), None) is None
    assert arms.wrap_lookup(sched(), [0, 7, 7]) == [0, 7, 7]  # no tree batch size
    summary = arms.wrap_lookup(sched(), base).summary()
    assert set(summary) == {1, 2} and set(summary[1]) == {"tree 32", "chain 7"}


# ------------------------------------------------------------------ the worker's half


def _kept(n: int, depth: int, k: int, p: float, vocab: int = 50):
    """A kept top-K [n, depth, k] whose top-1 has probability p at every depth (the
    rest spread evenly), as logits with their lse."""
    import math

    import torch

    rest = (1 - p) / (vocab - 1)
    vals = torch.full((n, depth, k), math.log(rest))
    vals[..., 0] = math.log(p)
    idx = torch.arange(k).expand(n, depth, k).clone()
    lse = torch.zeros(n, depth)
    return vals, idx, lse


@pytest.mark.parametrize("dev", ["cpu"] + (["cuda"] if HAS_CUDA else []))
def test_expected_tokens_of_both_arms_from_the_drafter(monkeypatch, dev):
    """E[chain] = sum of p^d over the chain's C prefixes; E[tree] = the tree's sum of
    path probabilities (>= the chain's: the tree holds the chain); both published (on
    CUDA through pinned memory, one period late, without a sync)."""
    import torch

    from ddtree_patcher.core import build_tree_from_topk

    v2_arms = payload_module("v2_arms")
    monkeypatch.setattr(v2_arms, "PUBLISH", 1)
    monkeypatch.setattr(v2_arms, "SAMPLE", 1)
    arms.EXPECTED.clear()
    depth, chain, budget, p = 6, 4, 16, 0.7
    ex = v2_arms.ArmExpect([1, 2], chain, depth, max_reqs=4, device=dev)
    vals, idx, lse = (t.to(dev) for t in _kept(2, depth, budget, p))
    tree = build_tree_from_topk(vals, idx, budget, budget, lse)
    slots = torch.tensor([3, 1], device=dev)
    ex.draft(2, vals, idx, lse, slots, tree)
    if dev == "cuda":
        torch.cuda.synchronize()
    ex.draft(2, vals, idx, lse, slots, tree)  # the copy of the first is published now
    e_tree, e_chain = arms.EXPECTED[2]
    want_chain = 1 + sum(p ** d for d in range(1, chain + 1))
    assert e_chain == pytest.approx(want_chain, rel=1e-4)
    want_tree = 1 + float(torch.exp(tree.scores[0]).sum())
    assert e_tree == pytest.approx(want_tree, rel=1e-4) and e_tree > e_chain
    assert 1 not in arms.EXPECTED  # nothing drafted at 1 request yet
    ex.draft(3, vals, idx, lse, slots, tree)  # 3: not a tree batch size, ignored
    assert float(ex.sums[3].abs().sum()) == 0
    before = ex.ctrl.num.clone()
    ex.verified(slots, torch.ones(2, dtype=torch.int64, device=dev), True, k_chain=chain)
    assert torch.equal(ex.ctrl.num, before)  # the draft at 3 was not measured: no verify

    # calibration: the target accepts nothing -> the expectations shrink
    zero = torch.zeros(2, dtype=torch.int64, device=dev)
    for _ in range(30):
        ex.draft(2, vals, idx, lse, slots)
        ex.verified(slots, zero, True, k_chain=chain)
        ex.draft(2, vals, idx, lse, slots, tree)
        ex.verified(slots, zero, False, num_nodes=torch.full_like(zero, budget),
                    valid=torch.ones(2, dtype=torch.bool, device=dev))
    ex.sums.zero_()
    for _ in range(4):  # the new drafts, with the calibration learnt
        ex.draft(2, vals, idx, lse, slots, tree)
        if dev == "cuda":
            torch.cuda.synchronize()
    e_tree2, e_chain2 = arms.EXPECTED[2]
    assert e_chain2 < 1 + 0.5 * (want_chain - 1) and e_tree2 < 1 + 0.5 * (want_tree - 1)


def test_the_expected_tokens_decide_when_published(monkeypatch):
    """Measured tokens say the tree (a lucky draw), the drafter's expectations say the
    chain: with EXPECTED published the lookup follows the expectations."""
    monkeypatch.delenv("VLLM_DDTREE_ARMS", raising=False)
    lookup = arms.ArmLookup([0, TREE], CHAIN)
    for k, tokens, dt in ((TREE, 9, 8.0), (CHAIN, 3, 7.0)):
        for _ in range(arms.MIN_STEPS):
            lookup.stats[(1, k)].add(tokens, dt)
    assert lookup.rates(1)[TREE] > lookup.rates(1)[CHAIN]
    arms.EXPECTED[1] = (4.0, 3.9)  # per request-step: 4.0 / 8 ms < 3.9 / 7 ms
    rate = lookup.rates(1)
    assert rate[CHAIN] > rate[TREE] and rate[TREE] == pytest.approx(4.0 / 8.0)
    assert lookup[1] == CHAIN
    assert lookup.summary()[1]["chain 15"]["expected"] == 3.9
    arms.ArmLookup([0, TREE], CHAIN)  # a new engine forgets the old expectations
    assert arms.EXPECTED == {}


def test_only_one_draft_in_sample_is_measured(monkeypatch):
    import torch

    from ddtree_patcher.core import build_tree_from_topk

    v2_arms = payload_module("v2_arms")
    monkeypatch.setattr(v2_arms, "SAMPLE", 4)
    ex = v2_arms.ArmExpect([1], 4, 6, max_reqs=2, device="cpu")
    vals, idx, lse = _kept(1, 6, 8, 0.6)
    tree = build_tree_from_topk(vals, idx, 8, 8, lse)
    seen = []
    for _ in range(12):
        ex.draft(1, vals, idx, lse, torch.tensor([0]), tree)
        seen.append(ex.measured)
    assert seen.count(True) == 3 and float(ex.sums[1, 3]) > 0


def test_a_switch_and_a_slow_step_do_not_set_the_step_time(monkeypatch):
    monkeypatch.delenv("VLLM_DDTREE_ARMS", raising=False)
    lookup = arms.ArmLookup([0, TREE], CHAIN)
    t = [0.0]
    lookup.clock = lambda: t[0]

    def step(dt, k, tokens=2):
        t[0] += dt
        lookup.observe(*out({"a": 1 + k}, {"a": k}, [tokens]))

    step(1, CHAIN)
    step(7, CHAIN)
    step(20, TREE)  # the first tree step after chain steps: not measured
    for dt in (8, 8, 30, 8, 8):  # one slow step among them
        step(dt, TREE)
    tree, chain = lookup.stats[(1, TREE)], lookup.stats[(1, CHAIN)]
    assert tree.steps == 5 and tree.step_s == 8
    assert chain.steps == 1 and chain.step_s == 7


def test_an_unreadable_output_turns_the_choice_off_not_the_scheduler(monkeypatch):
    monkeypatch.delenv("VLLM_DDTREE_ARMS", raising=False)
    lookup = arms.ArmLookup([0, TREE, TREE, CHAIN], CHAIN)
    assert lookup[1] == TREE
    so, _ = out({"a": 1 + CHAIN}, {"a": CHAIN}, [1])
    lookup.observe(so, SimpleNamespace(sampled_token_ids=[[1]]))
    lookup.observe(so, SimpleNamespace(sampled_token_ids=[5]))  # no len(): unreadable
    assert lookup.arms == {}
    assert [lookup[n] for n in (1, 2, 3)] == [TREE, TREE, CHAIN]  # the fixed schedule
    lookup.observe(so, None)  # off: nothing read any more
