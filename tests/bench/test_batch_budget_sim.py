"""bench/batch_budget_sim.py's simulation on hand-made trees (no model): the batch-wide
allocation never accepts less than B per request at the same rows when one request is
sure and the other unsure, and the rows it prints hold every cell."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_sim():
    sys.path.insert(0, str(BENCH / "realpair"))
    spec = importlib.util.spec_from_file_location("batch_budget_sim",
                                                  BENCH / "batch_budget_sim.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def anchor(p_first: float, depth: int, width: int, accepted: int):
    """A chain-shaped best-first tree: node j at depth j + 1 with path probability
    p_first ** (j + 1) (the first `depth` nodes), siblings after it far less likely;
    the truth follows the chain for `accepted` nodes."""
    lp = torch.full((width,), float("-inf"))
    dep = torch.zeros(width, dtype=torch.int64)
    for j in range(min(depth, width)):
        lp[j] = (j + 1) * torch.log(torch.tensor(p_first))
        dep[j] = j + 1
    return lp, dep, min(depth, width), list(range(accepted))


def test_sure_requests_take_the_nodes_unsure_ones_cannot_use():
    sim = load_sim()
    sure = anchor(0.97, 12, 16, accepted=12)   # wants 12 nodes, accepts them all
    unsure = anchor(0.2, 12, 16, accepted=0)  # its nodes are never accepted
    data = [sure, unsure]
    rows = sim.simulate(data, [2], [4], rounds=2, batches=40,
                        cost_ms=lambda n, rows: 1.0 + 0.01 * rows)
    cell = next(r for r in rows if r.get("budget") == 4)
    assert all(w >= f for f, w in zip(cell["fixed"], cell["batch_wide"]))
    assert max(cell["gain"]) > 1.0
    choice = next(r for r in rows if "choice_vs_best_fixed" in r)
    assert len(choice["choice_vs_best_fixed"]) == 2
    assert all(x > 0 for x in choice["choice_vs_best_fixed"])


def test_equal_requests_gain_nothing():
    sim = load_sim()
    data = [anchor(0.9, 8, 16, accepted=3)]
    rows = sim.simulate(data, [4], [4], rounds=1, batches=10,
                        cost_ms=lambda n, rows: 1.0)
    cell = next(r for r in rows if r.get("budget") == 4)
    assert cell["gain"] == [pytest.approx(1.0)]
