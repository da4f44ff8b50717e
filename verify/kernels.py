"""Kernel checks against independent Python references, on fresh random inputs.

Takes the DDTree core *as installed in vLLM* (vllm.v1.spec_decode.ddtree.core) so it
checks the copy that serves.  On CUDA both backends (Triton and torch) are checked;
on the CPU the torch path (and Triton under TRITON_INTERPRET=1 when available).
"""

from __future__ import annotations

import importlib.util
import os
import random


def load_oracle(core):
    """The heapq oracle (patches/ddtree/reference/heap.py, copied next to this file
    by verify_client; never installed into vLLM), loaded as a module of the core under
    test so that its relative imports (quantisation) resolve to that core."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heap_reference.py")
    spec = importlib.util.spec_from_file_location(core.__name__ + "._verify_oracle", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _backends(core, device: str) -> list[str]:
    out = ["torch"]
    if device == "cuda" and core.HAS_TRITON:
        out.append("triton")
    return out


def check_build(core, oracle, device: str, seed: int) -> str:
    import torch

    g = torch.Generator().manual_seed(seed)
    cases = 0
    for n, L, v, bmax in ((3, 4, 40, 16), (2, 1, 30, 8), (4, 6, 64, 48), (2, 3, 5, 15)):
        lp = torch.log_softmax(torch.randn(n, L, v, generator=g) * 4, -1)
        budget = torch.randint(1, bmax + 1, (n,), generator=g)
        for backend in _backends(core, device):
            tree = core.build_tree(lp.to(device), budget.to(device), bmax, logprobs=True,
                                   backend=backend)
            for i in range(n):
                want = [(t, p, d) for t, p, d, _ in oracle.reference_tree(lp[i], int(budget[i]))]
                k = int(tree.num_nodes[i])
                got = list(zip(tree.tokens[i, :k].tolist(), tree.parents[i, :k].tolist(),
                               tree.depths[i, :k].tolist()))
                if got != want:
                    raise AssertionError(f"tree build ({backend}) differs from the heap "
                                         f"reference (seed {seed}, case {n}x{L}x{v} B={bmax})")
            cases += 1
    return f"tree build == heapq reference ({cases} batches)"


def _py_walk(tree, i, choose):
    """Reference walk of request i: choose(row, children) -> (child index | None, token)."""
    k = int(tree.num_nodes[i])
    par = tree.parents[i, :k].tolist()
    tok = tree.tokens[i, :k].tolist()
    row, out, rows = 0, [], [0]
    while True:
        kids = [j for j in range(k) if par[j] == row - 1]
        c, t = choose(row, [(j, tok[j]) for j in kids])
        out.append(t)
        if c is None:
            return rows, out
        rows.append(c + 1)
        row = c + 1


def _random_tree(core, device, g, n=4, L=4, v=12, bmax=10):
    import torch

    lp = torch.log_softmax(torch.randn(n, L, v, generator=g) * 2, -1)
    budget = torch.randint(1, bmax + 1, (n,), generator=g)
    return core.build_tree(lp.to(device), budget.to(device), bmax, logprobs=True,
                           backend="torch")


def check_walks(core, device: str, seed: int) -> str:
    import torch

    g = torch.Generator().manual_seed(seed)
    checked = 0
    for _ in range(5):
        tree = _random_tree(core, device, g)
        n, bmax, v = tree.tokens.shape[0], tree.tokens.shape[1], 12
        # targets biased towards the tree's tokens so that deep paths get accepted
        logits = torch.randn(n, bmax + 1, v, generator=g)
        logits.scatter_add_(2, torch.cat([tree.tokens.cpu(), tree.tokens.cpu()[:, :1]], 1)
                            .unsqueeze(2), torch.full((n, bmax + 1, 1), 3.0))
        logits = logits.to(device)
        argmax = logits.argmax(-1)
        probs = torch.softmax(logits.float(), -1)
        u = torch.rand(n, tree.max_depth + 1, generator=g).to(device)
        for backend in _backends(core, device):
            gr = core.walk_greedy(argmax, tree, backend=backend)
            sa = core.walk_sampled(probs, tree, u, backend=backend)
            for i in range(n):
                am = argmax[i].tolist()

                def greedy(row, kids):
                    for j, t in kids:
                        if t == am[row]:
                            return j, t
                    return None, am[row]

                m = core.masses(probs[i]).tolist()
                depth = [0]

                def sampled(row, kids):
                    total = sum(m[row])
                    t = min(int(float(u[i, depth[0]]) * float(total)), total - 1)
                    depth[0] += 1
                    acc = 0
                    ids = {tok for _, tok in kids}
                    for j, tok in kids:
                        acc += m[row][tok]
                        if t < acc:
                            return j, tok
                    for tok in range(len(m[row])):
                        if tok in ids:
                            continue
                        acc += m[row][tok]
                        if t < acc:
                            return None, tok
                    return None, len(m[row]) - 1

                for res, rule, name in ((gr, greedy, "greedy"), (sa, sampled, "sampled")):
                    rows, toks = _py_walk(tree, i, rule)
                    a = int(res.num_accepted[i])
                    if res.accepted_rows[i, : a + 1].tolist() != rows or \
                            res.output_tokens[i, : a + 1].tolist() != toks:
                        raise AssertionError(f"{name} tree walk ({backend}) differs from the "
                                             f"reference (seed {seed}, request {i})")
                checked += 1
    return f"greedy and sampled walks == reference ({checked} trees)"


def check_compaction(core, device: str, seed: int) -> str:
    import torch

    g = torch.Generator().manual_seed(seed)
    nb, bs, h, d, n = 12, 4, 2, 8, 3
    for backend in _backends(core, device):
        kv = torch.randn(nb, 2, bs, h, d, generator=g).to(device)
        table = torch.randperm(nb, generator=g)[: n * 4].view(n, 4).to(torch.int32).to(device)
        start = torch.tensor([1, 5, 0]).to(device)
        rows = torch.tensor([[0, 2, 5, -1], [0, 1, 3, 4], [0, -1, -1, -1]]).to(device)
        nacc = torch.tensor([2, 3, 0]).to(device)
        want = kv.clone()

        def slot(i, pos):
            b = int(table[i, pos // bs])
            return b, pos % bs

        for i in range(n):
            for j in range(1, int(nacc[i]) + 1):
                sb, so = slot(i, int(start[i]) + int(rows[i, j]))
                db, do = slot(i, int(start[i]) + j)
                want[db, :, do] = kv[sb, :, so]
        got = kv.clone()
        core.compact_kv([got], table, bs, start, rows, nacc, "kv_in_block", backend=backend)
        if not torch.equal(got, want):
            raise AssertionError(f"KV compaction ({backend}) differs from the reference "
                                 f"(seed {seed})")
    return "KV compaction == reference"


def _paired_py(top1, logp, slots, out, acc, valid, rows, subs, chain):
    """The tree-vs-chain choice's counts of one tree step, row by row in Python: tree
    accepted, rows, chain accepted (its leading matches of the walk's known tokens, then
    the drafter's expected run where it matched them all), rows, the squares and the
    product, the rows' squared weights, then each subtree's leading accepted rows."""
    import math

    cols = [0.0] * (8 + len(subs))
    for i, slot in enumerate(slots):
        a, w = acc[i], min(len(out[i]), chain)
        lead = 0
        while lead < w and lead <= a and top1[slot][lead] == out[i][lead]:
            lead += 1
        ch = float(lead)
        if lead == a + 1 < chain:
            cum, c = [], 0.0
            for x in logp[slot][:chain]:
                c += x
                cum.append(c)
            base = cum[min(a, chain - 1)]
            ch += sum(math.exp(cum[j] - base) for j in range(a + 1, chain))
        row = [a, 1, ch, 1, a * a, ch * ch, a * ch, 1]
        for s in subs:
            k = 0
            while k + 1 < len(rows[i]) and 0 < rows[i][k + 1] <= s:
                k += 1
            row.append(k)
        if valid[i]:
            cols = [x + y for x, y in zip(cols, row)]
    return cols


def check_paired_counts(core, device: str, seed: int) -> str:
    """core/paired_counts.py (the choice's counts of a tree step, V2 runner) against
    _paired_py, each backend."""
    import torch

    pc = core.paired_counts
    g = torch.Generator().manual_seed(seed)
    chain, n, slots_n = 5, 3, 6
    top1 = torch.randint(1, 6, (slots_n, chain), generator=g)
    logp = -torch.rand(slots_n, chain, generator=g)
    slots = torch.randperm(slots_n, generator=g)[:n]
    acc = torch.tensor([0, 2, 5])
    out = torch.full((n, 6), -1, dtype=torch.int64)
    for i in range(n):  # the chain's prefix, then random tokens: the known a + 1 (row 0:
        # the chain matched all of them, so its expected run past the bonus counts)
        m = 1 if i == 0 else int(torch.randint(0, min(int(acc[i]) + 1, chain) + 1, (1,),
                                                generator=g))
        toks = top1[slots[i], :m].tolist() + [9] * (int(acc[i]) + 1 - m)
        out[i, :len(toks)] = torch.tensor(toks)
    rows = torch.tensor([[0, 1, -1, -1, -1, -1], [0, 2, 7, -1, -1, -1], [0, 1, 3, 4, 9, 12]])
    valid = torch.tensor([True, True, True])
    subs = [4, 8]
    want = _paired_py(top1.tolist(), logp.tolist(), slots.tolist(), out.tolist(),
                      acc.tolist(), valid.tolist(), rows.tolist(), subs, chain)
    for backend in _backends(core, device):
        sums = torch.zeros(n + 1, 8 + len(subs), device=device)
        args = [t.to(device) for t in (slots, top1, logp)]
        pc.add_rows(sums, n, *args, chain, out.to(device), acc.to(device), valid.to(device),
                    rows.to(device), torch.tensor(subs, device=device),
                    fused=backend == "triton")
        got = sums[n].tolist()
        if any(abs(x - y) > 1e-4 * max(1.0, abs(y)) for x, y in zip(got, want)) or \
                sums[:n].abs().sum().item() != 0:
            raise AssertionError(f"paired counts ({backend}) differ from the reference "
                                 f"(seed {seed}): {got} vs {want}")
    return "paired counts == reference"


def run(core, device: str | None = None, seed: int | None = None, *, oracle
        ) -> tuple[bool, str]:
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    seed = seed if seed is not None else random.randrange(1 << 30)
    msgs = [check_build(core, oracle, device, seed), check_walks(core, device, seed + 1),
            check_compaction(core, device, seed + 2), check_paired_counts(core, device, seed + 3)]
    return True, f"{device}, seed {seed}: " + "; ".join(msgs)
