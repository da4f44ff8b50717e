"""bench/arms_realpair.py on hand-made drafter outputs (no model): a tree accepts through a
sibling where the chain stops, a decode moves through its text by what each step
emitted, and the choice's trace replays against what its arms realized."""

import importlib.util
import math
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load():
    spec = importlib.util.spec_from_file_location("arms_realpair", BENCH / "arms_realpair.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def text(positions: int, L: int, V: int, second_at: set, seed: int = 0):
    """A continuation of `positions` anchors: the drafter's top-1 at every depth is the
    truth, except at the positions in second_at where depth 1's truth is its top-2."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.randint(1, V, (positions, L), generator=g)
    lps = torch.full((positions, L, V), math.log(0.02 / (V - 2)))
    other = (truth + 1) % V
    lps.scatter_(-1, truth.unsqueeze(-1), math.log(0.7))
    lps.scatter_(-1, other.unsqueeze(-1), math.log(0.28))
    for p in second_at:  # the truth ranks second at depth 1
        lps[p, 0, truth[p, 0]] = math.log(0.28)
        lps[p, 0, other[p, 0]] = math.log(0.7)
    return lps, truth


def test_the_tree_accepts_through_a_sibling_where_the_chain_stops():
    m = load()
    L, V = 6, 40
    lps, truth = text(10, L, V, second_at={3})
    t = m._arms_of(lps, truth, budget=32, chain=L)
    assert t["chain_acc"][3] == 0 and t["tree_acc"][3] >= 2  # via the sibling
    others = [p for p in range(10) if p != 3]
    assert (t["chain_acc"][others] == L).all() and (t["tree_acc"][others] == L).all()
    # the walk's output along the continuation: the accepted tokens, then the bonus
    a = int(t["tree_acc"][3])
    assert t["out"][3, :a].tolist() == truth[3, :a].tolist()


def test_decodes_move_through_the_text_and_the_replay_reads_the_choice():
    m = load()
    L, V, C, B = 6, 40, 6, 32
    texts = [m._arms_of(*text(200, L, V, second_at=set(range(0, 200, 2)), seed=s), B, C)
             for s in range(2)]
    # every other anchor stops the chain at once: always-chain emits 1 and L + 1 by turns
    tok, ms, lk = m.cell(texts, [0], "chain", (10.0, 9.0), B, C)
    steps = ms / 9.0
    assert lk is None and 195 <= tok <= 200 + L and 1.0 < tok / steps < L + 1
    tok_t, ms_t, _ = m.cell(texts, [0], "tree", (10.0, 9.0), B, C)
    assert tok_t / (ms_t / 10.0) > tok / steps  # the tree takes the siblings
    tok_c, ms_c, lookup = m.cell(texts, [0, 1], "choice", (10.0, 9.0), B, C)
    assert lookup is not None and lookup.trace
    sys.path.insert(0, str(BENCH / "gpu"))
    import arms_replay

    rep = arms_replay.replay(list(lookup.trace))
    tree = rep[(2, B)]
    assert tree["steps"] > 0 and tree["expected"] is not None
    assert abs(tree["ratio"] - 1) < 0.5
