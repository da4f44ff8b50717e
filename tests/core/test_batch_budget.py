"""core/batch_budget.py: DDTree trees as vLLM's adaptive verification sees drafts.  The
confidences' running product is each node's path probability; the admission is the best
allocation of a total node budget (against a brute-force optimum); and vLLM's own
admission kernel (the function from the real 0.32.0 / 0.33.0 wheels) run on those
confidences keeps the same nodes, each request a prefix of its pop order (a tree)."""

import ast

import pytest
import torch

from ddtree_patcher.patches.ddtree.payload.core import build_tree
from ddtree_patcher.patches.ddtree.payload.core.batch_budget import admit, survival_confidences
from tests.wheels import installed_tree

ADMISSION = "vllm/v1/worker/gpu/spec_decode/adaptive_verification.py"


def trees(seed: int, budgets=(16, 9, 3, 0, 16), L=5, V=32, B=16):
    g = torch.Generator().manual_seed(seed)
    # a confident request (sharp logits), unsure ones (flat), and in between
    temps = torch.tensor([0.3, 1.0, 2.0, 1.0, 4.0])[: len(budgets)].view(-1, 1, 1)
    draft = torch.randn(len(budgets), L, V, generator=g) / temps
    return build_tree(draft, torch.tensor(budgets), B, backend="torch", topk="torch")


def vllm_admission(version: str):
    """vLLM's _assign_draft_token_budget, compiled from the real wheel's source."""
    path = installed_tree("vllm", version) / ADMISSION
    mod = ast.parse(path.read_text())
    fn = next(n for n in mod.body if isinstance(n, ast.FunctionDef)
              and n.name == "_assign_draft_token_budget")
    ns = {"torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), ns)
    return ns["_assign_draft_token_budget"]


def best_sum(scores, num_nodes, total):
    """Brute force: the largest sum of path probabilities over prefixes with `total`
    nodes in all (dynamic programming over requests)."""
    p = torch.exp(scores.double())
    best = {0: 0.0}
    for r in range(scores.shape[0]):
        pre = [0.0] + torch.cumsum(p[r, : int(num_nodes[r])], 0).tolist()
        nxt = {}
        for t, v in best.items():
            for c, s in enumerate(pre):
                nxt[t + c] = max(nxt.get(t + c, -1.0), v + s)
        best = nxt
    return best[total]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_confidences_running_product_is_the_path_probability(seed):
    t = trees(seed)
    conf = survival_confidences(t.scores, t.num_nodes)
    assert conf.dtype == torch.float32 and float(conf.min()) >= 0 and float(conf.max()) <= 1
    live = torch.arange(16) < t.num_nodes.view(-1, 1)
    surv = conf.cumprod(1)
    torch.testing.assert_close(surv[live], torch.exp(t.scores[live]), rtol=2e-5, atol=0)
    assert bool((conf[~live] == 0).all())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_admit_is_the_best_allocation_and_keeps_trees(seed):
    t = trees(seed)
    p = torch.exp(t.scores.double())
    for total in range(0, int(t.num_nodes.sum()) + 2):
        kept = admit(t.scores, t.num_nodes, total)
        assert int(kept.sum()) == min(total, int(t.num_nodes.sum()))
        assert bool((kept <= t.num_nodes).all())
        got = sum(float(p[r, : int(kept[r])].sum()) for r in range(len(kept)))
        assert got == pytest.approx(best_sum(t.scores, t.num_nodes, int(kept.sum())), rel=1e-9)
        for r in range(len(kept)):  # a prefix of the pop order is a tree: parents first
            par = t.parents[r, : int(kept[r])]
            assert bool((par < torch.arange(int(kept[r]))).all())
    # nodes go where they are likeliest accepted: the confident request (sharp logits)
    # keeps the most, the flattest none, although both built trees of 16
    kept = admit(t.scores, t.num_nodes, 16)
    assert int(kept[0]) == int(kept.max()) >= 8 and int(kept[4]) == 0


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_vllm_admission_on_tree_confidences_keeps_the_best_nodes(version):
    assign = vllm_admission(version)
    for seed in range(3):
        t = trees(seed)
        conf = survival_confidences(t.scores, t.num_nodes)
        n = conf.shape[0]
        for total in range(1, int(t.num_nodes.sum())):
            cap = t.num_nodes.to(torch.int32).clone()
            assign(conf, torch.arange(n), cap, total, conf.shape[1])
            assert cap.tolist() == admit(t.scores, t.num_nodes, total).tolist(), (seed, total)


# ---- choose_total: the batch-wide budget's choice, given trees and step costs

from ddtree_patcher.patches.ddtree.payload.core.batch_budget import (  # noqa: E402
    choose_total, cost_of_table)
from ddtree_patcher.patches.ddtree.payload.core.budget import CostTable  # noqa: E402


def sure_and_unsure(L=8, V=64, B=16):
    """Request 0's drafter is sure at every depth (p ~ 0.95), request 1's is flat."""
    sure = torch.full((L, V), -9.0)
    sure[:, 0] = 3.0
    flat = torch.zeros(L, V)
    flat[:, :4] = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    flat[:, 4:] = -30.0
    return build_tree(torch.stack([sure, flat]).log_softmax(-1), torch.tensor([B, B]), B,
                      backend="torch", topk="torch")


def test_a_sure_request_gets_a_chain_an_unsure_one_siblings():
    t = sure_and_unsure()
    pick = choose_total(t.scores, t.depths, t.num_nodes, [10], lambda n, rows: 1.0)
    c0, c1 = pick.counts.tolist()
    assert c0 + c1 == 10
    kept0 = t.depths[0, :c0].tolist()
    assert kept0 == list(range(1, c0 + 1)), "the sure request keeps a chain"
    assert c0 >= 6 and c1 >= 1
    assert all(d == 1 for d in t.depths[1, :c1].tolist()[:3]), "the unsure one: siblings"


def test_expected_tokens_are_the_admitted_path_probabilities():
    t = trees(3)
    for total in (0, 7, 20, 44):
        pick = choose_total(t.scores, t.depths, t.num_nodes, [total], lambda n, r: 1.0)
        counts = admit(t.scores, t.num_nodes, total)
        assert torch.equal(pick.counts, counts)
        live = torch.arange(t.scores.shape[1]) < counts.view(-1, 1)
        want = t.scores.shape[0] + float(torch.where(live, t.scores.exp(), 0.0).sum())
        assert pick.expected_tokens == pytest.approx(want, rel=1e-5)
    # a calibration of c_d = 0.5 halves every depth's expected acceptance
    half = torch.full((6,), 0.5)
    p1 = choose_total(t.scores, t.depths, t.num_nodes, [20], lambda n, r: 1.0)
    p2 = choose_total(t.scores, t.depths, t.num_nodes, [20], lambda n, r: 1.0, calib=half)
    n = t.scores.shape[0]
    assert p2.expected_tokens - n == pytest.approx(0.5 * (p1.expected_tokens - n), rel=1e-5)


def test_the_choice_is_the_brute_force_best_over_the_totals():
    t = trees(5)
    totals = [0, 4, 8, 16, 24, 32, 48]
    for cost in (lambda n, rows: 1.0,                       # free rows: the most nodes
                 lambda n, rows: 1.0 + 0.2 * rows,           # steep: few nodes
                 lambda n, rows: 5.0 + 0.01 * rows ** 1.5):  # in between
        pick = choose_total(t.scores, t.depths, t.num_nodes, totals, cost)
        each = [choose_total(t.scores, t.depths, t.num_nodes, [x], cost) for x in totals]
        best = max(c.tokens_per_ms for c in each)
        assert pick.tokens_per_ms == pytest.approx(best)
        assert pick.total == min(c.total for c in each
                                 if c.tokens_per_ms >= best * (1 - 1e-9))
    free = choose_total(t.scores, t.depths, t.num_nodes, totals, lambda n, r: 1.0)
    steep = choose_total(t.scores, t.depths, t.num_nodes, totals, lambda n, r: 1.0 + r)
    assert free.total == 48 and steep.total == 0


def test_costs_from_a_measured_table_and_bad_input():
    table = CostTable({1: {17: 10.0, 65: 12.0}, 4: {17: 11.0, 65: 16.0}})
    cost = cost_of_table(table)
    assert cost(4, 4 * 17) == pytest.approx(11.0)
    assert cost(4, 4 * 41) == pytest.approx(13.5)
    t = trees(1)
    pick = choose_total(t.scores, t.depths, t.num_nodes, [16, 64], cost)
    assert pick.total in (16, 64) and pick.cost_ms == pytest.approx(
        cost(t.scores.shape[0], t.scores.shape[0] + pick.total))
    with pytest.raises(ValueError, match="no candidate"):
        choose_total(t.scores, t.depths, t.num_nodes, [], cost)
    with pytest.raises(ValueError, match="negative"):
        choose_total(t.scores, t.depths, t.num_nodes, [-1], cost)
