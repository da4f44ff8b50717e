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
