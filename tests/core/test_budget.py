"""The cost-aware budget controller (core/budget.py): cost tables, the expected
acceptance of candidate budgets from real trees, the choice on hand-computable cases,
monotonicity in the batch size, online calibration, and the proposer's step."""

import json
import math
import random
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ddtree_patcher.patches.ddtree.payload.core import build_tree, vocab_topk
from ddtree_patcher.patches.ddtree.reference.heap import heap_build, reference_tree
from ddtree_patcher.patches.ddtree.payload.core.budget import (
    H200_VLLM_0_20_2,
    BudgetController,
    CostTable,
    build_controlled,
    control_mode,
    default_budgets,
    expected_by_depth,
)
from ddtree_patcher.patches.ddtree.payload.core.tree_build import canonical_topk, chain_scores


def packed_result(run: str, name: str, tmp_path: Path) -> Path:
    """bench/results/<run>.tar.xz's <run>/<name> (an H200 run's raw file), as a file."""
    archive = Path(__file__).resolve().parents[2] / "bench" / "results" / f"{run}.tar.xz"
    with tarfile.open(archive, "r:xz") as tf:
        out = tmp_path / name
        out.write_bytes(tf.extractfile(f"{run}/{name}").read())
    return out


def tree_of(scores, depths):
    """A batch of trees given by pop-order scores (log q) and depths [N, W]."""
    s = torch.tensor(scores, dtype=torch.float32)
    return SimpleNamespace(scores=s.log() if (s > 0).all() else s,
                           depths=torch.tensor(depths, dtype=torch.int64))


def flat_table(ms_by_q: dict, chain=None, ns=(1, 2)):
    return CostTable({n: dict(ms_by_q) for n in ns}, chain)


# ---------------------------------------------------------------------- cost table


def test_cost_table_interpolates_and_is_monotone_in_q():
    t = CostTable({1: {17: 10.0, 33: 9.0, 65: 12.0}, 4: {17: 14.0, 33: 16.0, 65: 22.0}},
                  {1: 8.0, 4: 9.0})
    assert t.tree_ms(1, 33) == 10.0  # 9.0 < 10.0 at q = 17: made non-decreasing
    assert t.tree_ms(1, 25) == 10.0 and t.tree_ms(1, 49) == 11.0
    assert t.tree_ms(4, 129) == pytest.approx(22.0 + 6.0 * 64 / 32)  # extrapolated in q
    assert t.tree_ms(2, 17) == pytest.approx(10.0 + 4.0 / 3)  # interpolated in N
    assert t.tree_ms(7, 17) == pytest.approx(18.0)  # extrapolated in N
    assert t.chain_ms(2, 16) == pytest.approx(8.0 + 1 / 3)
    assert CostTable({1: {17: 5.0}}).chain_ms(1, 16) == 5.0  # no chain row: a tree of that q
    with pytest.raises(ValueError, match="full grid"):
        CostTable({1: {17: 1.0, 33: 2.0}, 4: {17: 1.0}})


def test_cost_table_json_and_device_lookup(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(H200_VLLM_0_20_2))  # JSON turns the int keys into strings
    a, b = CostTable.load(path), CostTable.load(H200_VLLM_0_20_2)
    for n, q in [(1, 65), (4, 17), (16, 257), (8, 40), (64, 129)]:
        assert a.tree_ms(n, q) == b.tree_ms(n, q)
        assert a.chain_ms(n, 16) == b.chain_ms(n, 16)
    assert CostTable.for_device("NVIDIA H200").tree_ms(1, 65) == 10.35
    with pytest.raises(ValueError, match="ddtree_cost_table"):
        CostTable.for_device("NVIDIA A10G")
    monkeypatch.setenv("VLLM_DDTREE_COST_TABLE", str(path))  # read at configuration only
    with pytest.raises(ValueError, match="ddtree_cost_table"):
        CostTable.for_device("NVIDIA A10G")
    assert CostTable.for_device("NVIDIA A10G", str(path)).tree_ms(4, 33) == 12.20


def test_control_mode_and_default_budgets():
    assert control_mode(SimpleNamespace()) == "off"
    assert control_mode(SimpleNamespace(ddtree_budget_control="auto")) == "auto"
    with pytest.raises(ValueError, match="ddtree_budget_control"):
        control_mode(SimpleNamespace(ddtree_budget_control="on"))
    assert default_budgets(64) == [16, 32, 64]
    assert default_budgets(100) == [16, 32, 64, 100]
    assert default_budgets(8) == [8]
    with pytest.raises(ValueError, match="budgets"):
        BudgetController(flat_table({2: 1.0}), 8, 4, budgets=[16])


# --------------------------------------------------------- expected acceptance


def test_expected_is_the_sum_of_node_probabilities_of_the_budget_tree():
    """sum of exp(score) over the first b nodes of the built tree = E_Q[accepted] of
    the heap reference's budget-b tree (brute force over its nodes), for every b."""
    g = torch.Generator().manual_seed(3)
    lp = torch.log_softmax(torch.randn(3, 5, 30, generator=g) * 2, -1)
    tree = build_tree(lp, 40, 40, logprobs=True, backend="torch")
    for n in range(3):
        sc = tree.scores[n].double()
        assert (sc[1:] <= sc[:-1]).all()  # pop order = non-increasing score
        for b in (1, 4, 15, 40):
            nodes = reference_tree(lp[n], b)
            q = torch.exp(lp[n].double())
            brute = 0.0
            for i in range(len(nodes)):  # Q(path to node i) = product of q_d(token)
                p, j = 1.0, i
                while j >= 0:
                    tok, par, d, _ = nodes[j]
                    p *= float(q[d - 1, tok])
                    j = par
                brute += p
            assert float(torch.exp(sc[:b]).sum()) == pytest.approx(brute, rel=1e-6)
    by_depth = expected_by_depth(tree.scores, tree.depths, 40, 5)
    assert torch.allclose(by_depth.sum(1), torch.exp(tree.scores).sum(1), rtol=1e-6)
    assert (by_depth[:, 1] <= 1 + 1e-6).all()  # disjoint paths: a probability


def test_choice_by_hand():
    # one request; nodes in pop order with probabilities 0.9, 0.5, 0.45, 0.1
    tree = tree_of([[0.9, 0.5, 0.45, 0.1]], [[1, 2, 1, 2]])
    ctl = BudgetController(flat_table({2: 10.0, 3: 11.0, 5: 14.0}), 4, 2, budgets=[1, 2, 4],
                           chain=False)
    assert ctl.expected(tree.scores, tree.depths) == pytest.approx([0.9, 1.4, 1.95])
    c = ctl.choose(tree)  # rates 1.9/10, 2.4/11, 2.95/14
    assert (c.budget, c.chain) == (2, False)
    assert c.expected_tokens == pytest.approx(2.4) and c.cost_ms == 11.0
    # a cheaper big tree: 2.95 / 12 beats 2.4 / 11
    ctl = BudgetController(flat_table({2: 10.0, 3: 11.0, 5: 12.0}), 4, 2, budgets=[1, 2, 4],
                           chain=False)
    assert ctl.choose(tree).budget == 4
    # the chain (0.9, then 0.9 * 0.5) at 9 ms: 2.35 / 9 = 0.261 beats every tree
    chain = torch.tensor([[0.9, 0.45]]).log()
    ctl = BudgetController(flat_table({2: 10.0, 3: 11.0, 5: 12.0}, chain={1: 9.0, 2: 9.0}), 4, 2,
                           budgets=[1, 2, 4])
    c = ctl.choose(tree, chain)
    assert c.chain and c.budget == 2 and c.label == "chain"
    assert c.expected_tokens == pytest.approx(1 + 0.9 + 0.45)
    assert ctl.counts == {"chain": 1}
    # equal rates: the cheaper candidate wins
    ctl = BudgetController(flat_table({2: 10.0, 5: 20.0}), 4, 2, budgets=[1, 4], chain=False)
    two = tree_of([[0.5, 0.5, 0.5, 0.5]], [[1, 1, 1, 1]])  # 1.5 / 10 vs 3.0 / 20
    assert ctl.choose(two).budget == 1


def test_bigger_batch_never_chooses_a_bigger_budget():
    """With a batch-linear cost c0 + N * g(q) (g increasing) and the same per-request
    acceptance curve, the chosen budget is non-increasing in N (Topkis)."""
    rng = random.Random(0)
    budgets = [1, 2, 4, 8, 16, 32, 64]
    for trial in range(40):
        # a concave, increasing E(b): node probabilities sorted decreasing
        p = sorted((rng.random() ** 2 for _ in range(64)), reverse=True)
        c0 = rng.uniform(1, 20)
        slope = rng.uniform(0.001, 0.1)
        curv = rng.uniform(0, 0.002)
        ns = [1, 2, 4, 8, 16, 32, 64, 128]
        table = CostTable({n: {b + 1: c0 + n * (0.5 + slope * b + curv * b * b) for b in budgets}
                           for n in ns})
        ctl = BudgetController(table, 64, 64, budgets=budgets, chain=False)
        last = None
        for n in ns:
            tree = SimpleNamespace(scores=torch.tensor([p] * n).log(),
                                   depths=torch.ones(n, 64, dtype=torch.int64))
            b = ctl.choose(tree).budget
            assert last is None or b <= last, (trial, n, b, last)
            last = b


@pytest.mark.parametrize("boost, picks", [
    ((9.0, 8.0, 7.0), ["64", "32", "16", "16"]),  # three plausible tokens per depth
    ((11.0, 7.0, 6.0), ["64", "chain", "chain", "chain"]),  # a strong top-1, some branching
    ((12.0, 0.0, 0.0), ["chain"] * 4),  # the top-1 is all there is: branching never pays
])
def test_h200_table_picks(boost, picks):
    """On the shipped H200 table with a calibrated drafter (c_d = 1), batch 1/4/16/32:
    smaller trees as the batch grows, the chain when branching does not pay."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 15, 2000, generator=g)
    x[..., :3] += torch.tensor(boost)
    lp = torch.log_softmax(x, -1)
    ctl = BudgetController(CostTable.load(H200_VLLM_0_20_2), 64, 15)
    vals, idx, _ = vocab_topk(lp, 64)
    tree = build_tree(lp, 64, 64, logprobs=True)
    cs = chain_scores(vals, idx)
    got = []
    for n in (1, 4, 16, 32):
        batch = SimpleNamespace(scores=tree.scores.expand(n, -1), depths=tree.depths.expand(n, -1))
        got.append(ctl.choose(batch, cs.expand(n, -1)).label)
    assert got == picks


# -------------------------------------------------------------------- calibration


def test_calibration_converges_to_the_true_acceptance():
    """The drafter claims Q(A >= d) = 0.9^d; the target accepts each depth with
    probability 0.6 (given the previous): c_d -> (0.6 / 0.9)^d."""
    torch.manual_seed(0)
    L, n = 6, 8
    q = 0.9
    scores = torch.tensor([[d * math.log(q) for d in range(1, L + 1)]] * n)
    depths = torch.arange(1, L + 1).expand(n, L)
    ctl = BudgetController(flat_table({L + 1: 1.0}), L, L, budgets=[L], decay=0.99)
    assert torch.allclose(ctl.calibration()[1:], torch.ones(L))
    # robust start: one step of total failure moves c_1 only part of the way
    ctl.observe(scores, depths, torch.full((n,), L), torch.zeros(n, dtype=torch.int64))
    assert 0.1 < float(ctl.calibration()[1]) < 0.5
    for _ in range(1500):
        acc = torch.zeros(n, dtype=torch.int64)
        alive = torch.ones(n, dtype=torch.bool)
        for d in range(L):
            alive &= torch.rand(n) < 0.6
            acc += alive.long()
        ctl.observe(scores, depths, torch.full((n,), L), acc)
    c = ctl.calibration()[1:]
    exp = torch.tensor([(0.6 / q) ** d for d in range(1, L + 1)])
    assert torch.allclose(c, exp, rtol=0.15), (c, exp)
    # calibrated expectation = the true E[A]
    e = ctl.expected(scores[:1], depths[:1])[0]
    assert e == pytest.approx(sum(0.6 ** d for d in range(1, L + 1)), rel=0.1)


def test_observe_rows_skips_requests_without_a_tree():
    tree = tree_of([[0.5, 0.25], [0.5, 0.25]], [[1, 2], [1, 2]])
    ctl = BudgetController(flat_table({3: 1.0}), 2, 2, budgets=[2], prior=1.0)
    ctl.observe_rows(tree, torch.tensor([1, -1]), torch.tensor([2, 2]), torch.tensor([2, 0]))
    # only row 1 counted: depth 1 predicted 0.5, observed 1 -> (1 + 1) / (1 + 0.5)
    assert float(ctl.calibration()[1]) == pytest.approx(2 / 1.5)
    assert float(ctl.calibration()[2]) == pytest.approx(2 / 1.25)
    # nodes beyond num_nodes are not predicted
    ctl2 = BudgetController(flat_table({3: 1.0}), 2, 2, budgets=[2], prior=1.0)
    ctl2.observe(tree.scores[:1], tree.depths[:1], torch.tensor([1]), torch.tensor([1]))
    assert float(ctl2.calibration()[2]) == pytest.approx(1.0)
    assert ctl2.metrics()["calibration"][0] == pytest.approx(2 / 1.5, abs=1e-4)


# -------------------------------------------------------------- the proposer's step


def test_build_controlled_truncates_or_switches_to_the_chain():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4, 50, generator=g) * 3
    full = build_tree(logits, 16, 16)
    # cost favours the smallest tree
    ctl = BudgetController(flat_table({5: 1.0, 9: 5.0, 17: 9.0}, ns=(1, 3)), 16, 4,
                           budgets=[4, 8, 16], chain=False)
    tree, tokens, choice = build_controlled(logits, ctl)
    assert choice.budget == 4 and tokens.shape == (3, 4)
    assert torch.equal(tokens, full.tokens[:, :4]) and torch.equal(tree.parents, full.parents)
    # the chain is cheapest: the drafts are the argmax per depth
    ctl = BudgetController(flat_table({5: 1.0, 9: 5.0, 17: 9.0}, chain={1: 0.5, 3: 0.5},
                                      ns=(1, 3)), 16, 4, budgets=[4, 8, 16])
    tree, tokens, choice = build_controlled(logits, ctl)
    assert choice.chain and torch.equal(tokens, logits.argmax(-1))
    assert tree.parents[:, :4].tolist() == [[-1, 0, 1, 2]] * 3 and tree.tokens.shape == (3, 16)
    # the oracle agrees on what the tree's first nodes are
    vals, idx, lse = vocab_topk(logits, 16)
    q, t = canonical_topk(vals, idx, lse)
    for n in range(3):
        ref = heap_build(q[n].tolist(), t[n].tolist(), 4)
        assert [x[0] for x in ref] == full.tokens[n, :4].tolist()


def test_build_controlled_with_a_builder():
    from ddtree_patcher.patches.ddtree.payload.core.graphed import GraphedBuild

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 4, 50, generator=g) * 3
    ctl = BudgetController(flat_table({5: 1.0, 9: 5.0, 17: 9.0}, ns=(1, 3)), 16, 4,
                           budgets=[4, 8, 16], chain=True)
    a = build_controlled(logits, ctl)
    b = build_controlled(logits, ctl, builder=GraphedBuild(16, with_chain=True))
    assert a[2] == b[2] and torch.equal(a[1], b[1])


def test_cost_table_from_step_bench(tmp_path):
    """The shipped H200 table is what step_bench.py measured in run 3."""
    run3 = packed_result("run3", "step_bench.json", tmp_path)
    t = CostTable.from_step_bench(run3)
    r2 = lambda d: {k: round(v, 2) if isinstance(v, float) else r2(v) for k, v in d.items()}  # noqa: E731
    assert r2(t["tree"]) == H200_VLLM_0_20_2["tree"] and r2(t["chain"]) == H200_VLLM_0_20_2["chain"]
    # a batch size without every tree size is left out of the grid
    partial = {"ddtree16": {"steps": {"1": {"step_ms": 2.0}, "4": {"step_ms": 3.0}}},
               "ddtree64": {"steps": {"1": {"step_ms": 4.0}}},
               "chain15": {"steps": {"1": {"step_ms": 1.5}}}, "nospec": {"steps": {}}}
    t = CostTable.from_step_bench(partial)
    assert t["tree"] == {1: {17: 2.0, 65: 4.0}} and t["chain"] == {1: 1.5}
    assert CostTable.load(t).tree_ms(1, 33) == 2.0 + 2.0 * 16 / 48


def test_batch_schedule_picks_the_best_budget_per_batch_size():
    """Trees cost nothing extra for one request and grow steeply with the batch: the
    schedule goes from the big tree to the small one, in vLLM's range format, and says
    where the chain would be faster."""
    from ddtree_patcher.patches.ddtree.payload.core.budget import batch_schedule

    table = CostTable({1: {17: 10.0, 65: 10.0}, 8: {17: 12.0, 65: 40.0}},
                      chain={1: 9.0, 8: 10.0})
    out = batch_schedule(table, {16: 4.0, 64: 6.0}, 10)
    assert out["schedule"] == [[1, 2, 64], [3, 10, 16]] and out["ddtree_chain_budget"] is None
    assert out["speculative_config"]["ddtree_chain_budget"] == 0  # trees only, pinned
    # with the chain's tau the chain competes: where it is faster, chain steps (k = 15)
    out = batch_schedule(table, {16: 4.0, 64: 6.0}, 10, chain_tau=3.6)
    rows = {r["n"]: r for r in out["rows"]}
    assert rows[1]["vs_chain"] == round((6.0 / 10.0) / (3.6 / 9.0), 4)  # 1.5
    assert not rows[1]["chain"] and rows[1]["budget"] == 64
    assert rows[10]["chain"] and rows[10]["budget"] == 15 and rows[10]["vs_chain"] < 1
    first_chain = min(n for n, r in rows.items() if r["chain"])
    assert out["schedule"][-1] == [first_chain, 10, 15]
    assert out["ddtree_chain_budget"] == 15
    assert out["speculative_config"] == {"num_speculative_tokens": 64,
                                         "num_speculative_tokens_per_batch_size":
                                         out["schedule"], "ddtree_chain_budget": 15}
    assert all(r["budget"] in (16, 64) for r in rows.values() if not r["chain"])
    with pytest.raises(ValueError, match="must exceed"):  # trees <= the chain: chains
        batch_schedule(table, {8: 4.0}, 3, chain_tau=3.6)
    assert batch_schedule(table, {16: 4.0}, 3)["schedule"] == [[1, 3, 16]]
    for bad in ({}, {0: 3.0}, {16: 0.0}):
        with pytest.raises(ValueError):
            batch_schedule(table, bad, 4)


def test_schedule_cli_on_the_run6_v2_step_table(capsys, tmp_path):
    """The measured V2 step table of run 6 with p80-like acceptance: B = 64 for one or
    two requests, chain steps from where trees stop paying; errors exit 2."""
    from ddtree_patcher.patches.ddtree.payload.core.budget import main

    res = packed_result("run6_032", "v2_step_bench.json", tmp_path)
    assert main(["schedule", str(res), "--tau", "16=4.7,32=5.2,64=6.0", "--chain-tau", "4.5",
                 "--max-batch", "16"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schedule"][0] == [1, 2, 64] and out["schedule"][-1][1:] == [16, 15]
    assert out["ddtree_chain_budget"] == 15
    assert out["rows"][0]["vs_chain"] > 1 > out["rows"][-1]["vs_chain"]
    assert not out["rows"][0]["chain"] and out["rows"][-1]["chain"]
    assert main(["schedule", str(res), "--tau", "16=x"]) == 2
    assert "error:" in capsys.readouterr().err
