"""payload/v1/grammar.py's tree walk and the V1 runtime's prune, without vLLM: a stand-in
grammar (a set of allowed token strings per prefix) over a hand-made tree."""

import torch

from .conftest import payload_module

grammar = payload_module("v1.grammar")
runtime = payload_module("v1.runtime")


class Grammar:
    """Accepts a token when the text so far + the token stays a prefix of ``allowed``
    (a tiny regular language); rollback undoes accepted tokens."""

    def __init__(self, allowed: list[str]):
        self.allowed, self.text = allowed, []

    def is_terminated(self):
        return False

    def _ok(self, t):
        s = "".join(self.text) + str(t)
        return any(a.startswith(s) for a in self.allowed)

    def validate_tokens(self, ts):
        return [t for t in ts[:1] if self._ok(t)]

    def accept_tokens(self, req_id, ts):
        self.text += [str(t) for t in ts]
        return True

    def rollback(self, n):
        del self.text[len(self.text) - n:]


# pop order: node j's parent is parents[j] (-1: the root)
TOKENS = [1, 2, 3, 4, 5, 6, 7]
PARENTS = [-1, -1, 0, 1, 0, 2, 1]  # 1 and 2 are the root's children; 3 is under 2 ...


def _path(tokens, parents, j):
    out = []
    while j >= 0:
        out.append(tokens[j])
        j = parents[j]
    return out[::-1]


def test_walk_accepts_only_paths_the_grammar_allows():
    g = Grammar(["135", "15", "27"])
    ok = grammar.walk(g, "r", TOKENS, PARENTS)
    assert ok == [True, True, True, False, True, False, True]
    assert g.text == []  # the grammar ends where it began
    seen = []
    grammar.walk(g, "r", TOKENS, PARENTS, visit=lambda j: seen.append((j, "".join(g.text))))
    assert {j: text for j, text in seen} == {
        j: "".join(map(str, _path(TOKENS, PARENTS, j))) for j in (0, 1, 2, 4, 6)}


def test_prune_reindexes_the_kept_nodes():
    rt = runtime.DDTreeRuntime.__new__(runtime.DDTreeRuntime)
    tok = torch.tensor(TOKENS + [0])  # a stored tree may be wider than the drafts
    par = torch.tensor(PARENTS + [-1])
    dep = torch.tensor([1, 1, 2, 2, 2, 3, 2, 1])
    rt.trees = {"r": (tok, par, dep)}
    keep = [0, 1, 2, 4, 6]  # node 3 (under 1) and 5 (under 2) forbidden
    assert rt.prune("r", keep)
    t, p, d = rt.trees["r"]
    assert t.tolist() == [1, 2, 3, 5, 7] and d.tolist() == [1, 1, 2, 2, 2]
    for new, old in enumerate(keep):  # every kept node keeps its path
        assert _path(t.tolist(), p.tolist(), new) == _path(TOKENS, PARENTS, old)
    assert rt.tree_of("r")[0].tolist() == [1, 2, 3, 5, 7]
    # a node whose parent is not kept is refused (nothing changes)
    rt.trees = {"r": (tok, par, dep)}
    assert not rt.prune("r", [0, 2, 3])
    assert rt.trees["r"][0] is tok
    assert not rt.prune("missing", [0])


def test_tree_drafts_carry_their_parents_through_pickling():
    """A worker in another process hands its drafts to the scheduler pickled (vLLM's
    multiprocessing executor): the parents must survive, and a list is still a list."""
    import pickle

    d = grammar.TreeDrafts(TOKENS, PARENTS)
    back = pickle.loads(pickle.dumps(d, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == TOKENS and back.parents == PARENTS and isinstance(back, list)
    assert grammar._carried(back, TOKENS[:4]) == PARENTS[:4]
    del back[3:]  # vLLM trims drafts in place (update_draft_token_ids_in_output)
    assert grammar._carried(back, TOKENS[:3]) == PARENTS[:3]
    assert grammar._carried(TOKENS, TOKENS) is None  # a plain list carries nothing
    assert grammar._carried(grammar.TreeDrafts([1, 2], [-1, 1]), [1, 2]) is None  # bad


def test_with_trees_wraps_structured_requests_only():
    from types import SimpleNamespace

    rt = runtime.DDTreeRuntime.__new__(runtime.DDTreeRuntime)
    rt.trees = {"s": (torch.tensor(TOKENS), torch.tensor(PARENTS), torch.zeros(7)),
                "p": (torch.tensor(TOKENS), torch.tensor(PARENTS), torch.zeros(7))}
    structured = SimpleNamespace(sampling_params=SimpleNamespace(structured_outputs=object()))
    plain = SimpleNamespace(sampling_params=SimpleNamespace(structured_outputs=None))
    rt.runner = SimpleNamespace(requests={"s": structured, "p": plain, "x": structured})
    out = rt.with_trees(["s", "p", "x"], [TOKENS[:5], TOKENS[:5], [9, 9]])
    assert out[0].parents == PARENTS[:5] and out[0] == TOKENS[:5]
    assert not hasattr(out[1], "parents") and not hasattr(out[2], "parents")


def test_prune_row_cuts_a_built_tree_in_place():
    """core.prune_row (the CUDA V1 runtime's prune): every field of the kept nodes'
    row matches the tree a build would give for them: tokens, re-indexed parents,
    depths, scores, offsets, the ancestor mask (pads: root + self), num_nodes; the
    other requests' rows are untouched; a set that is not a tree changes nothing."""
    core = payload_module("core")
    torch.manual_seed(3)
    draft = torch.randn(2, 4, 12) * 2
    tree = core.build_tree(draft, 8, 8)
    before = {k: getattr(tree, k).clone() for k in
              ("tokens", "parents", "depths", "scores", "ancestor_mask", "position_offsets",
               "num_nodes")}
    par = tree.parents[0].tolist()
    drop = next(j for j in range(8) if par[j] >= 0)  # a node with a parent node
    kill = {drop} | {j for j in range(8) if par[j] == drop}
    for j in range(8):  # and its subtree
        if par[j] in kill:
            kill.add(j)
    keep = [j for j in range(8) if j not in kill]
    assert core.prune_row(tree, 0, keep)
    k = len(keep)
    assert int(tree.num_nodes[0]) == k
    assert tree.tokens[0, :k].tolist() == before["tokens"][0, keep].tolist()
    assert tree.depths[0, :k].tolist() == before["depths"][0, keep].tolist()
    assert torch.equal(tree.scores[0, :k], before["scores"][0, keep])
    for new, old in enumerate(keep):  # every kept node keeps its path
        assert _path(tree.tokens[0].tolist(), tree.parents[0].tolist(), new) == \
            _path(before["tokens"][0].tolist(), par, old)
    rows = [0] + [1 + j for j in keep]
    assert torch.equal(tree.ancestor_mask[0, : k + 1, : k + 1],
                       before["ancestor_mask"][0][rows][:, rows])
    pad = tree.ancestor_mask[0, k + 1:]
    assert pad[:, 0].all() and int(pad.sum()) == 2 * (8 - k)  # root + self
    assert tree.position_offsets[0, 1: k + 1].tolist() == tree.depths[0, :k].tolist()
    assert tree.tokens[0, k:].eq(0).all() and tree.parents[0, k:].eq(-1).all()
    assert tree.scores[0, k:].eq(float("-inf")).all()
    for name, old in before.items():  # request 1: untouched
        assert torch.equal(getattr(tree, name)[1], old[1]), name
    snap = tree.tokens.clone()
    child = next(j for j in range(k) if tree.parents[0, j] >= 0)
    assert not core.prune_row(tree, 0, [child])  # its parent is gone: not a tree
    assert torch.equal(tree.tokens, snap)


def test_cuda_runtime_prunes_the_proposers_tree():
    """The CUDA V1 runtime prunes the row of its proposer's last tree (was: the prefix
    only); tree_of then reads the pruned tree; an unknown request is not pruned."""
    core = payload_module("core")
    cuda = payload_module("v1.cuda")
    rt = cuda.CudaDDTreeRuntime.__new__(cuda.CudaDDTreeRuntime)
    rt._latest = None
    assert not rt.prune("r", [0])
    tree = core.build_tree(torch.randn(1, 3, 10) * 2, 5, 5)
    rt._latest = ({"r": 0}, tree)
    keep = [0, 1]
    want = tree.tokens[0, keep].tolist()
    assert rt.prune("r", keep)
    assert rt.tree_of("r")[0][:2].tolist() == want
    assert not rt.prune("other", [0])
