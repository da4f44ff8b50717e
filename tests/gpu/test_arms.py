"""The tree-vs-chain controller of the V2 runner (payload/sched/: arms.py, the
scheduler's half; paired.py, the worker's; channel.py between them), against a
simulated engine: each step verifies the drafts the lookup chose one step earlier (as
vLLM's scheduler does), takes the arm's time and emits the arm's tokens.
Deterministic (a fake clock, seeded token counts); no vLLM needed."""

from __future__ import annotations

import itertools
import math
import random
from types import SimpleNamespace

import pytest

from .conftest import HAS_CUDA, payload_module

arms = payload_module("sched.arms")
channel = payload_module("sched.channel")
settings = payload_module("settings")

TREE, CHAIN = 64, 15


@pytest.fixture
def ch():
    """The channel both halves of one engine hold (DDTreeConfig.channel); a lookup
    made without one holds its own (a scheduler without the worker half)."""
    return channel.ArmChannel()


def out(reqs: dict[str, int], drafts: dict[str, int], sampled: list[int]):
    """A SchedulerOutput / ModelRunnerOutput pair: reqs = scheduled tokens per request,
    drafts = draft count per request (placeholders), sampled = tokens emitted."""
    so = SimpleNamespace(num_scheduled_tokens=reqs,
                         scheduled_spec_decode_tokens={r: [-1] * k for r, k in drafts.items()})
    return so, SimpleNamespace(sampled_token_ids=[[7] * t for t in sampled])


def simulate(lookup, cost: dict, tau: dict, steps: int = 600, n: int = 1, seed: int = 0,
             in_flight: int = 1):
    """Run ``steps`` decode steps of n requests; returns the k verified per step.  The
    scheduler picks a step's drafts before the outputs of the in_flight steps before
    it are in (vLLM's async scheduling: 2)."""
    clock = [0.0]
    lookup.clock = lambda: clock[0]
    rng = random.Random(seed)
    pending = [lookup[n] for _ in range(in_flight)]
    seen = []
    for _ in range(steps):
        pending.append(lookup[n])
        k = pending.pop(0)
        clock[0] += cost[k] * rng.uniform(0.95, 1.05)
        sampled = [max(1, min(k + 1, round(rng.gauss(tau[k], 1.0)))) for _ in range(n)]
        names = [f"r{i}" for i in range(n)]
        lookup.observe(*out({r: 1 + k for r in names}, {r: k for r in names}, sampled))
        seen.append(k)
    return seen


@pytest.mark.parametrize("cost,tau,winner", [
    ({TREE: 7.9, CHAIN: 6.8}, {TREE: 1.0, CHAIN: 1.0}, CHAIN),   # random drafter
    ({TREE: 7.9, CHAIN: 6.8}, {TREE: 4.6, CHAIN: 3.1}, TREE),    # p60-like
    ({TREE: 7.9, CHAIN: 6.8}, {TREE: 6.0, CHAIN: 5.6}, CHAIN),   # the tree does not pay
    ({TREE: 11.4, CHAIN: 7.2}, {TREE: 6.0, CHAIN: 4.5}, CHAIN),  # 1.58x cost, 1.33x tau
])
def test_the_faster_arm_gets_the_steps(cost, tau, winner):
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


def test_a_change_of_acceptance_is_followed():
    """The chain wins for a random drafter; when the drafter turns good, the tree wins."""
    lookup = arms.ArmLookup([0, TREE, CHAIN], CHAIN)
    cost = {TREE: 7.9, CHAIN: 6.8}
    first = simulate(lookup, cost, {TREE: 0.5, CHAIN: 0.5}, steps=400)
    assert first[-100:].count(CHAIN) >= 85
    second = simulate(lookup, cost, {TREE: 7.0, CHAIN: 3.0}, steps=600, seed=1)
    assert second[-200:].count(TREE) >= 180


def test_only_tree_batch_sizes_have_arms_and_the_list_stays_a_list():
    base = [0, 32, 32, 16, 7, 7]
    lookup = arms.ArmLookup(base, 7)
    assert lookup.arms == {1: (32, 7), 2: (32, 7), 3: (16, 7)}
    assert lookup[4] == 7 and lookup[5] == 7 and lookup[-1] == 7
    assert list(lookup) == base and len(lookup) == 6 and lookup[1:3] == [32, 32]
    assert lookup[1] == 32  # uncalibrated: the tree first
    assert arms.ArmLookup([0, 7, 7], 7).arms == {}  # nothing larger than the chain
    assert arms.ArmLookup([0, 8, 8], 0).arms == {}  # no chain to play against


def test_steps_that_are_not_pure_decode_are_not_measured():
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
    lookup = arms.ArmLookup([0, TREE], CHAIN, pinned=(1, 2))
    assert (lookup.window, lookup.explore) == (1, 2)
    seen = simulate(lookup, {TREE: 1.0, CHAIN: 1.0}, {TREE: 3.0, CHAIN: 2.9}, steps=60)
    assert 10 <= seen[20:].count(CHAIN) <= 30  # every other choice explores
    # ddtree_arms (or its deprecated variable), parsed at engine configuration
    parse = settings.parse_arms
    assert parse([1, 2], "ddtree_arms") == parse("1,2", "VLLM_DDTREE_ARMS") == (1, 2)
    for bad in ("1", "0,4", "2,1", "a,b", "1,2,3"):
        with pytest.raises(ValueError, match="VLLM_DDTREE_ARMS"):
            parse(bad, "VLLM_DDTREE_ARMS")
    for bad in ([1], [0, 4], [2, 1], [1.5, 2], [True, 2], [1, 2, 3], 7):
        with pytest.raises(ValueError, match="ddtree_arms"):
            parse(bad, "ddtree_arms")
    monkeypatch.setenv("VLLM_DDTREE_ARMS", "1,2")  # the scheduler reads no variable
    assert arms.ArmLookup([0, TREE], CHAIN).pinned is None


def test_wrap_lookup_only_for_the_v2_controller():

    def sched(v2=True, control="auto", budget=32, chain=7, pinned=None):
        cfg = None if budget is None else settings.DDTreeConfig(
            budget=budget, depth=7, v2=v2, budget_control=control or "off",
            chain_budget=chain or 0, arms=pinned)
        spec = SimpleNamespace(ddtree_budget=budget, ddtree_config=cfg)
        return SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=spec))

    base = [0, 32, 32, 7]
    s = sched(pinned=(1, 2))
    lookup = arms.wrap_lookup(s, base)
    assert isinstance(lookup, arms.ArmLookup)
    # the engine's channel (the worker half publishes to it) and its pinned window
    cfg = s.vllm_config.speculative_config.ddtree_config
    assert lookup.channel is cfg.channel and lookup.pinned == (1, 2) and lookup.window == 1
    renewed = lookup.renew()
    assert renewed is not lookup and renewed.channel is cfg.channel and list(renewed) == base
    for s in (sched(v2=False), sched(control="off"), sched(control=None),
              sched(budget=None), sched(chain=0), sched(chain=None)):
        assert arms.wrap_lookup(s, base) is base
    assert arms.wrap_lookup(sched(), None) is None
    assert arms.wrap_lookup(sched(), [0, 7, 7]) == [0, 7, 7]  # no tree batch size
    summary = arms.wrap_lookup(sched(), base).summary()
    assert set(summary) == {1, 2} and set(summary[1]) == {"tree 32", "chain 7"}


# ------------------------------------------------------------------ the worker's half


def _walk_out(paths: list[list[int]], width: int):
    """A walk's output [n, width]: the accepted drafts, then the bonus, -1 after; and
    num_accepted (paths[i] = the accepted drafts + the bonus)."""
    import torch

    out = torch.full((len(paths), width), -1, dtype=torch.int64)
    for i, p in enumerate(paths):
        out[i, : len(p)] = torch.tensor(p)
    return out, torch.tensor([len(p) - 1 for p in paths])


@pytest.mark.parametrize("dev", ["cpu"] + (["cuda"] if HAS_CUDA else []))
def test_both_arms_measured_on_the_same_tree_step(monkeypatch, dev, ch):
    """The chain's accepted length = the common prefix of the drafted top-1 chain and
    the tree step's output (path + bonus); past the bonus it is not known (counted up
    to it).  Both sums are published (on CUDA through pinned memory, one period late,
    without a sync); rows without a tree and other batch sizes add nothing."""
    import math

    import torch

    v2_arms = payload_module("sched.paired")
    monkeypatch.setattr(v2_arms, "PUBLISH", 1000)
    depth, chain = 6, 4

    def fresh():
        return v2_arms.ArmExpect([2, 3], chain, depth, max_reqs=4, device=dev, channel=ch)

    ex = fresh()
    # the kept top-K ids [n, L, K] of a draft of slots 3, 1, 0: column 0 = the top-1
    top1 = torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25],
                         [30, 31, 32, 33, 34, 35]])
    idx = torch.stack([top1, top1 + 100, top1 + 200], -1).to(dev)
    vals = torch.tensor([math.log(0.5), math.log(0.2), math.log(0.1)], device=dev)
    vals = vals.expand(3, depth, 3).contiguous()  # top-1 probability 0.5 everywhere
    lse = torch.zeros(3, depth, device=dev)
    slots = torch.tensor([3, 1, 0], device=dev)
    ex.draft(vals, idx, lse, slots)
    assert torch.equal(ex.top1[slots].cpu(), top1[:, :chain])
    out, acc = _walk_out([
        [10, 11, 112, 13, 7],  # slot 3: the tree took a sibling at depth 3: chain 2
        [20, 21, 22, 23, 24],  # slot 1: the chain all along: 4 (its C drafts)
        [30, 31, 5],  # slot 0: 2 accepted, bonus 5 (not the chain's 32): chain 2
    ], depth + 1)
    # the step verified slots 1, 3 and 0 (batch order), all with a tree
    order = torch.tensor([1, 0, 2])
    out, acc, slots = out[order].to(dev), acc[order].to(dev), slots[order.to(dev)]
    valid = torch.ones(3, dtype=torch.bool, device=dev)
    ex.verified(3, slots, out, acc, valid)
    # tree 4, 4, 2 and chain 4, 2, 2 per row: sums, then tree^2, chain^2, tree x chain,
    # squared weights
    assert ex.sums[3].tolist() == [10, 3, 8, 3, 16 + 16 + 4, 16 + 4 + 4, 16 + 8 + 4, 3]
    ex.verified(1, slots[:1], out, acc, valid)  # no arms at 1 request
    assert float(ex.sums[1].abs().sum()) == 0

    # published: one period late, through pinned memory on CUDA (no sync)
    monkeypatch.setattr(v2_arms, "PUBLISH", 1)
    ex = fresh()
    ex.draft(vals, idx, lse, torch.tensor([3, 1, 0], device=dev))
    ex.verified(3, slots, out, acc, valid)
    if dev == "cuda":
        torch.cuda.synchronize()
    ex.verified(2, slots[:2], out[:2], acc[:2], valid)
    assert ch.expected[3] == pytest.approx((1 + 10 / 3, 1 + 8 / 3))
    mt, mc = 10 / 3, 8 / 3  # the paired spread: population (co)variances of the rows
    assert ch.spread[3] == pytest.approx((36 / 3 - mt * mt, 24 / 3 - mc * mc,
                                            28 / 3 - mt * mc, 3))

    # the bonus is the chain's next token but the tree had no such node: known up to
    # the bonus, then the drafter's expected rest (position 3: p = 0.5); a row without
    # a tree (valid False) is left out
    monkeypatch.setattr(v2_arms, "PUBLISH", 1000)
    ex = fresh()
    ex.draft(vals, idx, lse, torch.tensor([3, 1, 0], device=dev))
    out2, acc2 = _walk_out([[10, 11, 12], [99, 1]], depth + 1)
    ex.verified(2, torch.tensor([3, 1], device=dev), out2.to(dev), acc2.to(dev),
                torch.tensor([True, False], device=dev))
    assert ex.sums[2].tolist()[:4] == [2, 1, 3.5, 1]
    ex.reset()  # what the benchmark calls between cells (bench/gpu/common.py)
    assert float(ex.sums.abs().sum()) == 0 and not ex.pending and ex.calls == 0


def test_a_chain_that_is_not_in_the_tree_is_still_read_off_the_output():
    """A random drafter: nothing accepted by either arm; a chain of C = L: every
    position counts."""
    import torch

    v2_arms = payload_module("sched.paired")
    ex = v2_arms.ArmExpect([1], 3, 3, max_reqs=1, device="cpu")
    ex.draft(torch.zeros(1, 3, 2), torch.tensor([[[5, 6], [7, 8], [9, 1]]]),
             torch.zeros(1, 3), torch.tensor([0]))
    out, acc = _walk_out([[4]], 4)
    ex.verified(1, torch.tensor([0]), out, acc, torch.tensor([True]))
    assert ex.sums[1].tolist()[:4] == [0, 1, 0, 1]
    out, acc = _walk_out([[5, 7, 9, 2]], 4)  # the tree took the whole chain
    ex.verified(1, torch.tensor([0]), out, acc, torch.tensor([True]))
    assert ex.sums[1].tolist()[:4] == [3, 2, 3, 2]


def test_the_expected_tokens_decide_when_published(ch):
    """Measured tokens say the tree (a lucky draw), the paired measurement of both arms
    on tree steps says the chain: with EXPECTED published the lookup follows it."""
    lookup = arms.ArmLookup([0, TREE], CHAIN, ch)
    for k, tokens, dt in ((TREE, 9, 8.0), (CHAIN, 3, 7.0)):
        for _ in range(arms.MIN_STEPS):
            lookup.stats[(1, k)].add(tokens, dt)
    assert lookup.rates(1)[TREE] > lookup.rates(1)[CHAIN]
    ch.expected[1] = (4.0, 3.9)  # per request-step: 4.0 / 8 ms < 3.9 / 7 ms
    rate = lookup.rates(1)
    assert rate[CHAIN] > rate[TREE] and rate[TREE] == pytest.approx(4.0 / 8.0)
    assert lookup[1] == CHAIN
    assert lookup.summary()[1]["chain 15"]["expected"] == 3.9
    # what each arm realized, in the estimate's unit, logged beside it
    assert lookup.summary()[1]["chain 15"]["measured"] == pytest.approx(3.0)
    assert lookup.summary()[1][f"tree {TREE}"]["measured"] == pytest.approx(9.0)
    arms.ArmLookup([0, TREE], CHAIN, ch)  # a fresh start forgets the old expectations
    assert ch.expected == {}


def test_a_switch_and_a_slow_step_do_not_set_the_step_time():
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


def test_an_unreadable_output_turns_the_choice_off_not_the_scheduler():
    lookup = arms.ArmLookup([0, TREE, TREE, CHAIN], CHAIN)
    assert lookup[1] == TREE
    so, _ = out({"a": 1 + CHAIN}, {"a": CHAIN}, [1])
    lookup.observe(so, SimpleNamespace(sampled_token_ids=[[1]]))
    lookup.observe(so, SimpleNamespace(sampled_token_ids=[5]))  # no len(): unreadable
    assert lookup.arms == {}
    assert [lookup[n] for n in (1, 2, 3)] == [TREE, TREE, CHAIN]  # the fixed schedule
    lookup.observe(so, None)  # off: nothing read any more


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_the_worker_half_never_syncs_the_host(monkeypatch):
    """Every call of the worker half, publishing included, under torch's sync debug
    mode: a host sync there would stall every draft (run 8 b: 1.61x)."""
    import torch

    v2_arms = payload_module("sched.paired")
    monkeypatch.setattr(v2_arms, "PUBLISH", 2)
    ex = v2_arms.ArmExpect([2], 4, 6, max_reqs=4, device="cuda")
    idx = torch.randint(0, 1000, (2, 6, 3), device="cuda")
    vals, lse = torch.zeros(2, 6, 3, device="cuda"), torch.ones(2, 6, device="cuda")
    slots = torch.tensor([3, 0], device="cuda")
    out, acc = _walk_out([[1, 2, 3], [4]], 7)
    out, acc = out.cuda(), acc.cuda()
    valid = torch.ones(2, dtype=torch.bool, device="cuda")
    ex.draft(vals, idx, lse, slots)
    ex.verified(2, slots, out, acc, valid)  # warm: first launches, allocations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            ex.draft(vals, idx, lse, slots)
            ex.verified(2, slots, out, acc, valid)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _tree_step(seed: int, n: int, L: int, V: int, B: int, probs):
    """One tree step of n requests against a target whose continuation is known
    (token t -> pi(t)): drafter logits = log(probs) on ranks 0.. (the rest spread),
    the true token at a rank drawn from ``probs`` (calibrated); the real tree build and
    greedy walk.  Returns (vals, idx, lse, walk, the top-1 chain's real accepted
    length per row for chains of every length)."""
    import torch

    from ddtree_patcher.patches.ddtree.payload.core import build_tree_from_topk, vocab_topk, walk_greedy

    g = torch.Generator().manual_seed(seed)
    p = torch.tensor(probs, dtype=torch.float64)
    pi = torch.randperm(V, generator=g)
    root = torch.randint(0, V, (n,), generator=g)
    true = torch.empty(n, L, dtype=torch.int64)
    t = root
    for d in range(L):
        t = pi[t]
        true[:, d] = t
    rest = float((1 - p.sum()) / (V - len(probs)))
    logits = torch.full((n, L, V), rest, dtype=torch.float64)
    ranked = torch.rand(n, L, V, generator=g).argsort(-1)[..., : len(probs)]
    logits.scatter_(-1, ranked, p.expand(n, L, -1).contiguous())
    rank = torch.multinomial(torch.cat([p, p.new_tensor([1 - p.sum()])]).float(),
                             n * L, True, generator=g).view(n, L)
    # the true token takes rank r's place (r = len(probs): a tail token)
    tail = torch.where(logits == rest, torch.rand(n, L, V, generator=g, dtype=torch.float64),
                       -1.0).argmax(-1)
    at = torch.where(rank < len(probs), ranked.gather(-1, rank.clamp(
        max=len(probs) - 1).unsqueeze(-1)).squeeze(-1), tail)
    tv, av = logits.gather(-1, true.unsqueeze(-1)), logits.gather(-1, at.unsqueeze(-1))
    logits.scatter_(-1, at.unsqueeze(-1), tv)
    logits.scatter_(-1, true.unsqueeze(-1), av)
    logits = logits.log().float()
    vals, idx, lse = vocab_topk(logits, B)
    tree = build_tree_from_topk(vals, idx, B, B, lse)
    target = torch.cat([pi[root].unsqueeze(1), pi[tree.tokens.clamp(min=0)]], 1)
    walk = walk_greedy(target, tree)
    hits = (idx[..., 0] == true).long().cumprod(1)
    _tree_step.last = (tree, target)  # for the subtree test
    return vals, idx, lse, walk, hits


def _read_off(v2_arms, C, L, vals, idx, lse, walk):
    """ArmExpect's per-row counts (tree, chain) of one tree step, one row at a time."""
    import torch

    n = idx.shape[0]
    # many rows: the kernels' torch reference (test_paired_counts.py holds them equal)
    ex = v2_arms.ArmExpect([1], C, L, max_reqs=n, device="cpu", fused=False)
    slots = torch.randperm(n)
    ex.draft(vals, idx, lse, slots)
    tree, chain = [], []
    for i in range(n):
        before = ex.sums[1].clone()
        ex.verified(1, slots[i: i + 1], walk.output_tokens[i: i + 1],
                    walk.num_accepted[i: i + 1], torch.ones(1, dtype=torch.bool))
        d = (ex.sums[1] - before).tolist()
        assert d[1] == 1 and d[3] == 1
        tree.append(d[0])
        chain.append(d[2])
    return torch.tensor(tree), torch.tensor(chain)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_chain_read_off_a_tree_step_is_what_the_chain_would_have_accepted(
        seed, monkeypatch):
    """Real tree build and greedy walk: where the step's output decides it, the chain's
    count is exactly the top-1 chain's real accepted length; where the chain matched
    the bonus too (the tree left out its next node) it is at least that and at most C;
    the tree's count is the walk's."""
    import torch

    v2_arms = payload_module("sched.paired")
    monkeypatch.setattr(v2_arms, "PUBLISH", 10 ** 6)  # sums kept whole
    n, L, V, B, C = 400, 6, 40, 6, 5
    vals, idx, lse, walk, hits = _tree_step(seed, n, L, V, B, [0.55, 0.2, 0.1])
    real = hits[:, :C].sum(1).float()
    tree, chain = _read_off(v2_arms, C, L, vals, idx, lse, walk)
    acc = walk.num_accepted.float()
    assert torch.allclose(tree, acc, atol=1e-4)  # (differences of float32 sums)
    known = chain < acc + 0.5
    assert torch.allclose(chain[known], real[known], atol=1e-4)
    censored = ~known
    assert censored.any() and known.float().mean() > 0.5  # both kinds of row
    assert (chain[censored] >= acc[censored] + 1 - 1e-4).all() and (chain <= C + 1e-4).all()
    assert (real[censored] >= acc[censored] + 1).all()


def test_the_chain_read_off_tree_steps_is_right_on_average(monkeypatch):
    """With a calibrated drafter the read-off count (exact where known, the drafter's
    expected rest past the bonus) averages the chain's real accepted length; a small
    tree (B = 4) leaves the chain out often, so the expected rest matters."""
    v2_arms = payload_module("sched.paired")
    monkeypatch.setattr(v2_arms, "PUBLISH", 10 ** 6)
    n, L, V, B, C = 3000, 6, 40, 4, 6
    vals, idx, lse, walk, hits = _tree_step(7, n, L, V, B, [0.75, 0.1, 0.05])
    real = hits[:, :C].sum(1).float()
    tree, chain = _read_off(v2_arms, C, L, vals, idx, lse, walk)
    censored = chain > walk.num_accepted.float() + 0.5
    assert censored.float().mean() > 0.2
    assert float(chain.mean()) == pytest.approx(float(real.mean()), rel=0.02)
    lower = chain.minimum(walk.num_accepted.float() + 1)  # up to the bonus only
    assert float(lower.mean()) < 0.95 * float(real.mean())  # without the rest: biased


# ------------------------------------------------------------------ both halves together

# H200, run 9 (bench/RESULTS.md): ms per step at 1 request, tree of 64 / chain of 15
STEP_MS = {"tree": 8.4, "chain": 7.2}


@pytest.mark.parametrize("probs,label", [
    ([0.6, 0.15, 0.08, 0.05], "p60"), ([0.8, 0.1, 0.04], "p80"),
    ([0.9, 0.05, 0.02], "p90"), ([0.3, 0.1], "weak")])
def test_both_halves_pick_the_arm_that_is_faster_on_this_text(probs, label, ch):
    """The scheduler's ArmLookup and the worker's ArmExpect together, on steps of the
    real tree build and walk (a calibrated synthetic drafter, _tree_step) with run 9's
    step times: a tree step publishes both arms' counts, a chain step emits the
    chain's real accepted length.  Whichever arm is faster for the profile (the tree
    at p60 by 18 %, at p80 by 4 %; the chain at p90 by 6 %, a tie for a weak drafter),
    the choice gets within 5 % of it and never below 99 % of the chain."""
    import torch

    v2_arms = payload_module("sched.paired")
    L, V, B, C = 8, 200, 24, 8
    vals, idx, lse, walk, hits = _tree_step(3, 3000, L, V, B, probs)
    tree_acc, chain_acc = walk.num_accepted, hits[:, :C].sum(1)
    rate = {"tree": (1 + float(tree_acc.float().mean())) / STEP_MS["tree"],
            "chain": (1 + float(chain_acc.float().mean())) / STEP_MS["chain"]}
    k_of = {"tree": B, "chain": C}
    # many steps: the kernels' torch reference (test_paired_counts.py holds them equal)
    ex = v2_arms.ArmExpect([1], C, L, max_reqs=1, device="cpu", channel=ch, fused=False)
    lookup = arms.ArmLookup([0, B], C, ch)
    clock = [0.0]
    lookup.clock = lambda: clock[0] / 1000
    one, valid = torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.bool)
    rows = torch.randint(0, 3000, (2500,), generator=torch.Generator().manual_seed(0))
    k = lookup[1]
    played = []
    for j in rows.tolist():
        arm = "tree" if k == B else "chain"
        nxt = lookup[1]  # chosen a step ahead (async scheduling)
        if arm == "tree":
            ex.draft(vals[j: j + 1], idx[j: j + 1], lse[j: j + 1], one)
            ex.verified(1, one, walk.output_tokens[j: j + 1], tree_acc[j: j + 1], valid)
            emitted = 1 + int(tree_acc[j])
        else:
            emitted = 1 + int(chain_acc[j])
        clock[0] += STEP_MS[arm]
        lookup.observe(*out({"r": 1 + k_of[arm]}, {"r": k_of[arm]}, [emitted]))
        played.append(arm)
        k = nxt
    tail = played[300:]  # after the first choices
    ms = sum(STEP_MS[a] for a in tail)
    got = sum(rate[a] * STEP_MS[a] for a in tail) / ms  # the arms' true rates, as played
    why = (label, got, rate, tail.count("tree") / len(tail), lookup.summary())
    assert got >= 0.95 * max(rate.values()), why
    assert got >= 0.99 * rate["chain"], why


def test_a_tree_step_prices_every_smaller_tree_exactly(monkeypatch, ch):
    """The best tree of b nodes is the first b nodes in pop order: the count read off
    the B-node step (where its path leaves the subtree) equals the real walk over the
    tree cut to b nodes, row by row; and it is published with the arms."""
    import dataclasses

    import torch

    from ddtree_patcher.patches.ddtree.payload.core import walk_greedy

    v2_arms = payload_module("sched.paired")
    monkeypatch.setattr(v2_arms, "PUBLISH", 1)
    n, L, V, B, C = 300, 6, 60, 16, 3
    vals, idx, lse, walk, _ = _tree_step(5, n, L, V, B, [0.5, 0.2, 0.1, 0.05])
    tree, target = _tree_step.last
    subs = (8, 4, 2)  # 2 <= C: not a subtree arm (dropped)
    ex = v2_arms.ArmExpect([n], C, L, max_reqs=n, device="cpu", subtrees=subs, channel=ch)
    assert ex.subtrees == [4, 8]
    slots = torch.arange(n)
    ex.draft(vals, idx, lse, slots)
    ex.verified(n, slots, walk.output_tokens, walk.num_accepted, torch.ones(n, dtype=bool),
                walk.accepted_rows)
    for col, b in zip((8, 9), ex.subtrees):
        cut = dataclasses.replace(tree, num_nodes=torch.full_like(tree.num_nodes, b))
        want = walk_greedy(target, cut).num_accepted
        assert float(ex.host[n, col]) == float(want.sum())
        assert (want <= walk.num_accepted).all() and (want < walk.num_accepted).any()
    ex.verified(n, slots, walk.output_tokens, walk.num_accepted, torch.ones(n, dtype=bool),
                walk.accepted_rows)  # publishes the first copy
    got = ch.subtrees[n]
    assert set(got) == {4, 8} and got[4] <= got[8] <= ch.expected[n][0]
    lookup = arms.ArmLookup([0] + [B] * n, C, ch)  # a fresh start forgets them
    assert ch.subtrees == {}
    ch.subtrees[n] = {4: 1.5}
    assert lookup.summary()[n]["subtrees"] == {4: 1.5}


def test_a_close_call_goes_to_the_tree(ch, monkeypatch):
    """With both counts published, the chain leads only where the tree trails it by
    more than Z standard errors of the paired counts, once MIN_ROWS rows are in: only
    a tree step adds rows, so a close call (or a few rows) goes to the tree, which
    settles it (run 21: a chain picked on 3 rows held 16-20 steps of a p60 cell); a
    chain that leads by less than 2 Z has the tree looked at again soon; rows that
    all agree (no spread): the sign decides, a clear lead only after enough of them
    (the spread's floor, PRIOR_VAR)."""
    lookup = arms.ArmLookup([0, TREE, TREE, TREE], CHAIN, ch)
    for n in (1, 2, 3):
        for k, dt in ((TREE, 0.010), (CHAIN, 0.007)):
            for _ in range(arms.WELL):
                lookup.stats[(n, k)].add(5, dt)
    # per request-step: tree 5.6 / 10 ms vs chain 4.2 / 7 ms = 0.56 vs 0.60 tokens/ms
    ch.expected[1] = ch.expected[2] = (5.6, 4.2)
    ch.expected[3] = (4.9, 4.2)  # 0.49 vs 0.60
    var = (9.0, 8.0, 7.5)  # sd 3 and 2.8, correlation 0.88: sd of the edge 0.2/ms
    ch.spread[1] = var + (20.0,)  # 20 rows: se 0.044/ms, the chain ahead by < 1 se
    ch.spread[2] = var + (400.0,)  # 400 rows: se 0.0007/ms, the chain clearly ahead
    ch.spread[3] = var + (arms.MIN_ROWS - 1.0,)  # far ahead, but on too few rows
    e1, e2, e3 = lookup.edge(1), lookup.edge(2), lookup.edge(3)
    assert -arms.Z < e1 < 0 and e2 < -2 * arms.Z and e3 < -arms.Z
    # the error bar shrinks as 1 / sqrt(rows) (the prior's pseudo-rows aside)
    def se(rows):  # the edge's standard error in tokens/ms, the spreads' floor applied
        floor = arms.PRIOR_VAR * arms.PRIOR_ROWS / (rows + arms.PRIOR_ROWS)
        vt, vc = (max(v, floor) for v in var[:2])
        return math.sqrt((vt / 10 ** 2 + vc / 7 ** 2 - 2 * var[2] / 70) / rows)
    assert e2 * se(400) == pytest.approx(e1 * se(20))
    assert e2 == pytest.approx(e1 * (400 / 20) ** 0.5, rel=0.01)
    picks = {n: [lookup[n] for _ in range(64)] for n in (1, 2, 3)}
    assert picks[2] == [CHAIN] * 64  # a clear lead: explored every 4 x EXPLORE choices
    # within its noise the tree is played (the chain explored every EXPLORE choices),
    # and so it is on fewer than MIN_ROWS rows
    assert picks[1][0] == TREE and 0 < picks[1].count(CHAIN) <= 64 // arms.EXPLORE
    assert picks[3] == picks[1]
    # the chain ahead by 1-2 se: the tree is tried every EXPLORE // 4 choices
    ch.spread[1] = var + (20.0 * (1.5 / e1) ** 2,)
    assert -2 * arms.Z < lookup.edge(1) < -arms.Z
    picks = [lookup[1] for _ in range(64)]
    assert picks.count(CHAIN) == 3 * picks.count(TREE)
    assert lookup.summary()[1]["edge"] == pytest.approx(lookup.edge(1), abs=0.01)
    ch.spread[1] = (0.0, 0.0, 0.0, 50.0)  # a random drafter: 1 token a step each
    ch.expected[1] = (1.0, 1.0)
    assert lookup.edge(1) < -2 * arms.Z  # 50 rows that agree: a clear lead
    ch.spread[1] = (0.0, 0.0, 0.0, 10.0)  # 10 that agree: the sign, not yet a clear lead
    assert -2 * arms.Z < lookup.edge(1) < -arms.Z
    ch.expected[1] = (1.0 * 10 / 7, 1.0)  # the same tokens per second: no edge
    assert lookup.edge(1) == pytest.approx(0.0, abs=1e-9)
    monkeypatch.setattr(arms, "PRIOR_VAR", 0.0)  # no floor: agreeing rows are certain
    ch.spread[1], ch.expected[1] = (0.0, 0.0, 0.0, 50.0), (1.0, 1.0)
    assert lookup.edge(1) == -math.inf and lookup.summary()[1]["edge"] == -99.0
    monkeypatch.undo()
    arms.ArmLookup([0, TREE], CHAIN, ch)  # a fresh start forgets the spread too
    assert ch.spread == {}


def test_the_choice_keeps_up_with_the_faster_arm_in_short_cells():
    """Both halves against the real tree build and walk (bench/arms_sim.py), run 21's
    27B-shape step times (tree of 16: 30.3 ms, chain of 15: 29.7), cells as long as
    the GPU's end-to-end cells at 256 tokens: at p60, where the tree delivers 1.22x
    the chain, the choice reached 0.947 of it over 95 steps on the GPU and in this
    simulation before the tree settled close calls; at p90, where the chain is ahead,
    calibrating on the tree costs little."""
    import statistics
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import arms_sim

    for prof, steps, floor in (("p60", 95, 0.97), ("p90", 35, 0.98)):
        pool = _tree_step(3, 600, arms_sim.L, arms_sim.V, 16, arms_sim.PROFILES[prof])
        got, best = [], []
        for seed in range(6):
            got.append(arms_sim.play(pool, steps, seed, 30.3, 29.7, B=16)[0])
            best.append(max(arms_sim.play(pool, steps, seed, 30.3, 29.7, fixed=b, B=16)[0]
                            for b in (16, arms_sim.C)))
        assert statistics.mean(got) / statistics.mean(best) >= floor, (prof, got, best)


def test_the_choice_keeps_up_at_four_requests():
    """The arms at 4 requests (step_bench's ddtree16every: B <= C + 1, so B at every
    batch size), run 21's 4-request step times (tree of 16: 35.36 ms, chain of 15:
    34.45): four rows a tree step, the choice within 2.5 % of the faster arm at p60 (the
    tree's cell) and p90 (the chain's) over a p90 cell's 35 steps."""
    import statistics
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import arms_sim

    mt, mc, b, reqs = arms_sim.STEP_MS["27B, 4"]
    for prof in ("p60", "p90"):
        pool = _tree_step(3, 600, arms_sim.L, arms_sim.V, b, arms_sim.PROFILES[prof])
        got, best = [], []
        for seed in range(4):
            got.append(arms_sim.play(pool, 35, seed, mt, mc, reqs=reqs, B=b)[0])
            best.append(max(arms_sim.play(pool, 35, seed, mt, mc, fixed=k, reqs=reqs, B=b)[0]
                            for k in (b, arms_sim.C)))
        assert statistics.mean(got) / statistics.mean(best) >= 0.975, (prof, got, best)


def test_paired_counts_shorten_the_calibration():
    """With the worker half in this process (an ArmExpect exists), each arm needs
    MIN_PAIRED measured steps before the choice, not MIN_STEPS (the tree's steps give
    the chain's tokens too); the first copy of the sums goes out from the first tree
    step, without fading it."""
    import torch

    v2_arms = payload_module("sched.paired")

    def calibration(paired: bool):
        ch = channel.ArmChannel()
        if paired:
            v2_arms.ArmExpect([1], CHAIN, CHAIN, max_reqs=1, device="cpu", channel=ch)
        lookup = arms.ArmLookup([0, TREE], CHAIN, ch)
        return ch, simulate(lookup, {TREE: 8.0, CHAIN: 7.0}, {TREE: 3.0, CHAIN: 2.0},
                            steps=24)

    ch, alone = calibration(False)
    assert not ch.paired and alone[:2 * arms.WINDOW] == [TREE] * 2 * arms.WINDOW
    ch, paired = calibration(True)
    assert ch.paired and arms.MIN_PAIRED < arms.MIN_STEPS
    assert paired[:arms.WINDOW] == [TREE] * arms.WINDOW
    # the chain: the switch's step and MIN_PAIRED measured ones, then the tree while
    # their outputs are in flight
    cal = arms.WINDOW + arms.MIN_PAIRED + 1
    assert paired[arms.WINDOW:cal] == [CHAIN] * (arms.MIN_PAIRED + 1)
    assert paired[cal:cal + arms.IN_FLIGHT] == [TREE] * arms.IN_FLIGHT
    ex = v2_arms.ArmExpect([1], 2, 3, max_reqs=1, device="cpu")
    ex.draft(torch.zeros(1, 3, 2), torch.tensor([[[5, 6], [7, 8], [9, 1]]]),
             torch.zeros(1, 3), torch.tensor([0]))
    out, acc = _walk_out([[5, 7, 4]], 4)
    ex.verified(1, torch.tensor([0]), out, acc, torch.tensor([True]))
    assert ex.pending and ex.sums[1].tolist()[:4] == [2, 1, 2, 1]  # copied, not faded


@pytest.mark.parametrize("paired", [True, False])
def test_the_chain_is_calibrated_once_while_its_steps_are_in_flight(paired):
    """vLLM's async scheduling sets a step's drafts before the outputs of the 2 steps
    before it are in: a cold cell's chain calibration was chosen twice over (run 24,
    H100: 8 chain steps in every cold cell, 12 % of a p60 cell, where the chain emits
    2.6 tokens a step to the tree's 4).  Once is enough: its steps are measured when
    they land, and the tree plays meanwhile."""
    ch = channel.ArmChannel()
    ch.paired = paired  # as the worker half (sched/paired.py's ArmExpect) sets it
    least = arms.MIN_PAIRED if paired else arms.MIN_STEPS
    seen = simulate(arms.ArmLookup([0, TREE], CHAIN, ch), {TREE: 8.0, CHAIN: 7.0},
                    {TREE: 4.0, CHAIN: 2.0}, steps=40, in_flight=2)
    runs = [(k, len(list(g))) for k, g in itertools.groupby(seen)]
    assert runs[1] == (CHAIN, least + 1), runs  # the switch's step + `least` measured
    assert runs[0][0] == runs[2][0] == TREE and runs[2][1] >= 4, runs
    assert seen.count(CHAIN) == least + 1, runs  # the tree leads: no second window


@pytest.mark.parametrize("extra,first", [(0.0, 0.0), (0.3, 0.3), (6.0, 6.0), (0.0, 50.0)])
def test_a_switch_is_priced_and_held_longer_when_it_costs(extra, first):
    """The first step after a switch is not an arm step (its interval may hold the other
    arm's tail); its excess over the new arm's median step is reported as switch_ms,
    and a choice holds long enough that a switch costs at most SWITCH_SHARE of it.  The
    median of the recent switches: one slow switch (``first``) changes nothing."""
    lookup = arms.ArmLookup([0, TREE], CHAIN)
    clock = [0.0]
    lookup.clock = lambda: clock[0]
    cost, k, prev, seen, switches = {TREE: 8.0, CHAIN: 7.0}, lookup[1], None, [], 0
    for _ in range(400):
        nxt = lookup[1]
        clock[0] += cost[k]
        if prev is not None and k != prev:
            switches += 1
            clock[0] += first if switches == 2 else extra  # 2: the first one measured
        lookup.observe(*out({"r": 1 + k}, {"r": k}, [2]))
        if switches == 2 and k != prev:  # the slow one was measured
            assert max(lookup.switches[1][1]) == pytest.approx(first, abs=1e-6)
        prev, k = k, nxt
        seen.append(k)
    st = lookup.summary()[1]
    assert st["switches"] >= 3, st
    assert st["switch_ms"] == pytest.approx(1e3 * extra, abs=1e-6), st  # clock: seconds
    assert st[f"tree {TREE}"]["ms"] == 1e3 * cost[TREE]  # switches left out of the medians
    assert st[f"chain {CHAIN}"]["ms"] == 1e3 * cost[CHAIN]
    want = max(arms.WINDOW, math.ceil(extra / (arms.SWITCH_SHARE * cost[CHAIN])))
    assert lookup._window(1) == want and want == (9 if extra > 1 else arms.WINDOW)
    runs = [len(list(g)) for _, g in itertools.groupby(seen[200:])][1:-1]
    assert runs and all(r >= want for r in runs), runs  # whole choices between switches
    pinned = arms.ArmLookup([0, TREE], CHAIN, pinned=(1, 2))  # stays as given
    pinned.stats, pinned.switches = lookup.stats, lookup.switches
    assert pinned._window(1) == 1


def test_measured_tokens_are_per_request_step_and_decayed():
    """summary's "measured" is the decayed mean of an arm's tokens per step divided by
    the batch size: the unit of the published "expected", so the two can be compared."""
    lookup = arms.ArmLookup([0, TREE, TREE], CHAIN)
    tree = lookup.stats[(2, TREE)]
    tree.add(4, 0.01)
    tree.add(8, 0.01)
    want = (4 * arms.DECAY + 8) / (arms.DECAY + 1) / 2
    assert lookup.summary()[2][f"tree {TREE}"]["measured"] == pytest.approx(want, abs=1e-3)
    assert lookup.summary()[2][f"chain {CHAIN}"]["measured"] == 0.0


def test_a_clear_tree_lead_explores_the_chain_rarely_from_its_calibration(ch):
    """Paired counts price the chain on every tree step: once the chain's step time is
    calibrated (MIN_PAIRED steps) and the tree leads by more than 2 Z standard errors,
    the chain is explored every 4 x EXPLORE choices, not only after WELL steps of it (a
    cold 68-step cell on the H100, 8B shape, p60: 8 chain steps, calibration and one
    exploration, 0.945 of the fixed tree).  A chain that leads still needs WELL steps
    of both arms before the tree is looked at less often."""
    ch.paired = True  # as the worker half (sched/paired.py's ArmExpect) sets it
    lookup = arms.ArmLookup([0, TREE, TREE], CHAIN, ch)
    for n in (1, 2):
        for _ in range(arms.WELL):
            lookup.stats[(n, TREE)].add(5, 0.010)
        for _ in range(arms.MIN_PAIRED):
            lookup.stats[(n, CHAIN)].add(5, 0.007)
    var = (9.0, 8.0, 7.5)
    ch.expected[1], ch.spread[1] = (5.6, 2.8), var + (400.0,)  # the tree clearly ahead
    ch.expected[2], ch.spread[2] = (4.2, 4.2), var + (400.0,)  # the chain clearly ahead
    assert lookup.edge(1) > 2 * arms.Z and lookup.edge(2) < -2 * arms.Z
    picks = [lookup[1] for _ in range(4 * arms.EXPLORE * arms.WINDOW)]
    assert picks.count(CHAIN) == arms.WINDOW  # one exploration in 4 x EXPLORE choices
    picks = [lookup[2] for _ in range(4 * arms.EXPLORE * arms.WINDOW)]
    assert picks.count(TREE) == 4 * arms.WINDOW  # every EXPLORE-th choice: not yet known


def test_each_measured_step_is_traced_with_the_estimates_of_its_time(ch, monkeypatch):
    """ArmLookup.trace: per measured step its batch size, drafts, ms, tokens and the
    expected tokens per request-step published then (None before), the last TRACE
    steps; what a replay of the estimator against the realized arms reads."""
    monkeypatch.setattr(arms, "TRACE", 16)
    lookup = arms.ArmLookup([0, TREE], CHAIN, ch)
    cost = {TREE: 0.008, CHAIN: 0.007}
    simulate(lookup, cost, {TREE: 3.0, CHAIN: 2.0}, steps=12)
    assert len(lookup.trace) == sum(a.steps for a in lookup.stats.values()) > 0
    for n, k, tree, ms, tokens, et, ec in lookup.trace:
        assert (n, et, ec) == (1, None, None) and tree == (k == TREE) and 1 <= tokens <= k + 1
        assert ms == pytest.approx(1e3 * cost[k], rel=0.06)
    ch.expected[1] = (4.0, 2.5)
    simulate(lookup, cost, {TREE: 3.0, CHAIN: 2.0}, steps=40)
    assert len(lookup.trace) == 16 and lookup.trace[-1][5:] == [4.0, 2.5]


def test_the_estimates_replayed_against_what_each_arm_realized():
    """bench/gpu/arms_replay.py on a trace recorded by both halves against the real tree
    build and walk (bench/arms_sim.py, 27B step times, p60, 300 steps): the tree's
    published tokens per request-step match what its own steps realized (the paired
    counts are unbiased), and the chain's estimate is there for its steps."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "bench"
    sys.path.insert(0, str(bench))
    import arms_sim

    spec = importlib.util.spec_from_file_location("arms_replay", bench / "gpu" / "arms_replay.py")
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    pool = _tree_step(3, 600, arms_sim.L, arms_sim.V, 16, arms_sim.PROFILES["p60"])
    kept = []
    arms_sim.play(pool, 300, 0, 30.3, 29.7, B=16, keep=kept)
    res = replay.replay(list(kept[0].trace))
    tree, chain = res[(1, 16)], res[(1, arms_sim.C)]
    assert tree["steps"] > 200 and 0.93 <= tree["ratio"] <= 1.07, res
    assert chain["steps"] >= arms.MIN_PAIRED and chain["expected"] is not None, res


def test_a_renewal_that_keeps_step_times_needs_no_chain_calibration(ch):
    """renew(keep_times=True): a running server meeting new text keeps the arms' step
    times (and switch costs) and forgets their tokens, so with paired counts the chain
    is not played to calibrate; without paired counts (TP > 1: measured tokens only)
    it still is, and a plain renew forgets the times too."""
    ch.paired = True
    lookup = arms.ArmLookup([0, TREE], CHAIN, ch)
    simulate(lookup, {TREE: 8.0, CHAIN: 7.0}, {TREE: 4.5, CHAIN: 2.0}, steps=60)
    old = {k: list(a.recent) for k, a in lookup.stats.items()}
    assert all(len(r) >= arms.MIN_PAIRED for r in old.values())
    kept, cold = lookup.renew(keep_times=True), lookup.renew()
    for k, a in kept.stats.items():
        assert list(a.recent) == old[k] and a.steps == 0 and a.tokens == 0.0
    assert all(not a.recent for a in cold.stats.values())
    ch.expected[1], ch.spread[1] = (4.5, 2.0), (4.0, 3.0, 2.0, 100.0)
    assert kept[1] == TREE  # the tree calibrates its counts first (it adds the rows)
    for s in kept.stats.values():  # ... then the chain's known step time suffices
        if s is kept.stats[(1, TREE)]:
            for _ in range(arms.MIN_PAIRED):
                s.add(5, 8.0)
    kept.hold[1] = 0
    picks = [kept[1] for _ in range(8 * arms.WINDOW)]
    assert CHAIN not in picks
    cold.stats[(1, TREE)].steps = arms.MIN_PAIRED
    cold.hold[1] = 0
    assert cold[1] == CHAIN  # no times kept: the chain calibrates
    ch.paired = False  # measured tokens: the chain's own steps give its tokens
    again = kept.renew(keep_times=True)
    for _ in range(arms.MIN_STEPS):
        again.stats[(1, TREE)].add(5, 8.0)
    assert again.stats[(1, CHAIN)].recent and again[1] == CHAIN
