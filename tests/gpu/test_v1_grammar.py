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
