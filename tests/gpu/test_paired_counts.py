"""core/paired_counts.py: the one-launch paired counts of a tree step equal their torch
reference (the code sched/paired.py ran before), on random steps with every edge the
reference handles: rows without a tree, a chain that matched every known token (the
expected rest past the bonus), an output narrower than the chain, accepted counts past
the chain, slots out of order, subtrees or none, and a row of sums already filled."""

import pytest
import torch

from .conftest import INTERPRET, device, payload_module

pc = payload_module("core.paired_counts")


def random_step(gen, n, chain, depth, width, slots_n, dev):
    """A tree step as sched/paired.py sees it: the top-1 chains by slot, the walk's
    output (the chain's prefix for a random length, then other tokens), accepted counts
    and the accepted verify rows (root 0, then rows 1..)."""
    top1 = torch.randint(1, 50, (slots_n, chain), generator=gen)
    logp = -torch.rand(slots_n, chain, generator=gen) * 2.0
    slots = torch.randperm(slots_n, generator=gen)[:n]
    acc = torch.randint(0, depth + 1, (n,), generator=gen)
    out = torch.full((n, width), -1, dtype=torch.int64)
    rows = torch.full((n, depth + 1), -1, dtype=torch.int64)
    for i in range(n):
        a = int(acc[i])
        m = int(torch.randint(0, min(a + 1, chain) + 1, (1,), generator=gen))
        other = torch.randint(60, 90, (a + 1 - m,), generator=gen).tolist()
        toks = top1[slots[i], :m].tolist() + other
        k = min(len(toks), width)
        out[i, :k] = torch.tensor(toks[:k])
        path = [0] + sorted(torch.randperm(40, generator=gen)[:a].add(1).tolist())
        rows[i, : len(path)] = torch.tensor(path)
    valid = torch.rand(n, generator=gen) > 0.2
    return [t.to(dev) for t in (top1, logp, slots, out, acc.to(torch.int32), valid, rows)]


@pytest.mark.parametrize("chain,depth,width,subs", [
    (15, 15, 16, (16, 32)), (7, 15, 16, ()), (15, 15, 4, (20,)), (1, 3, 4, (2, 5, 9)),
])
def test_the_kernel_equals_its_reference(chain, depth, width, subs):
    dev = device()
    if not pc.use_fused(dev):
        pytest.skip("needs Triton (CUDA or the interpreter)")
    gen = torch.Generator().manual_seed(chain * 100 + width)
    # 40: more rows than the one-warp launch takes (the interpreter is slow at a wide
    # chain's cumulative sum: only with the 1-draft chain)
    for n in (1, 2, 5) + ((40,) if chain == 1 else ()):
        top1, logp, slots, out, acc, valid, rows = random_step(gen, n, chain, depth, width,
                                                               n + 3, dev)
        s = torch.tensor(subs, dtype=torch.int64, device=dev)
        cols = pc.COLS + len(subs)
        ref = torch.rand(n + 4, cols, generator=gen).to(dev)  # a row already filled
        got = ref.clone()
        pc.add_rows_torch(ref, n, slots, top1, logp, chain, out, acc, valid, rows, s)
        pc.add_rows(got, n, slots, top1, logp, chain, out, acc, valid, rows, s)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        assert not torch.equal(ref[n], torch.zeros_like(ref[n]))


def test_an_expected_rest_past_the_bonus_is_counted():
    """The tree accepted 1 draft and the chain matched it and the bonus: the chain's
    count is 2 plus its drafter's expected run past the bonus (sum of the products of
    its top-1 probabilities), on both paths."""
    dev = device()
    top1 = torch.tensor([[5, 6, 7, 8]], device=dev)
    p = torch.tensor([[0.9, 0.8, 0.5, 0.25]], device=dev)
    out = torch.tensor([[5, 6, -1, -1]], device=dev)
    args = (torch.tensor([0], device=dev), top1, p.log(), 4, out,
            torch.tensor([1], device=dev), torch.tensor([True], device=dev))
    want = 2 + 0.5 + 0.5 * 0.25
    for f in (pc.add_rows_torch, pc.add_rows):
        sums = torch.zeros(2, pc.COLS, device=dev)
        f(sums, 1, *args)
        assert sums[1, 2].item() == pytest.approx(want, rel=1e-6), f
        assert sums[1, :2].tolist() == [1.0, 1.0] and sums[0].abs().sum() == 0


def test_the_interpreter_or_cuda_runs_the_kernel():
    assert pc.use_fused(device()) == (pc.HAS_TRITON and (INTERPRET or torch.cuda.is_available()))


def test_the_top1_chain_kept_by_slot_equals_its_reference():
    """keep_top1: a draft's top-1 ids and log-probabilities (clamped to <= 0, -1e4 where
    not finite: -inf, +inf, nan) land in the rows of their slots, the other rows kept
    (fp32, as the speculator keeps them; the interpreter has no bf16 arithmetic)."""
    dtype = torch.float32
    dev = device()
    if not pc.use_fused(dev):
        pytest.skip("needs Triton (CUDA or the interpreter)")
    gen = torch.Generator().manual_seed(3)
    n, L, K, chain = 3, 15, 4, 7
    vals = (torch.randn(n, L, K, generator=gen) * 3).to(dtype)
    vals[0, 2, 0], vals[1, 0, 0], vals[2, 5, 0] = float("-inf"), float("nan"), float("inf")
    lse = (torch.randn(n, L, generator=gen) + 2).to(dtype)
    lse[2, 1] = -5.0  # a log-probability above 0: clamped
    idx = torch.randint(0, 100, (n, L, K), generator=gen)
    slots = torch.tensor([4, 0, 2])
    args = [t.to(dev) for t in (vals, idx, lse, slots)]
    want_ids = torch.full((6, chain), -7, device=dev)
    want_lp = torch.full((6, chain), 9.0, device=dev)
    got_ids, got_lp = want_ids.clone(), want_lp.clone()
    pc.keep_top1_torch(*args, want_ids, want_lp, chain)
    pc.keep_top1(*args, got_ids, got_lp, chain)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=0)
    assert want_lp[2, 5].item() == want_lp[4, 2].item() == want_lp[0, 0].item() == -1e4
    assert want_lp[2, 1].item() == 0.0 and want_lp[1].tolist() == [9.0] * chain


def test_a_kernel_that_fails_to_launch_falls_back_to_the_reference(monkeypatch):
    """A compile error of a kernel (raised at launch, before it writes) turns the kernels
    off with one warning; the step's counts still come out, from the references."""
    import torch

    paired = payload_module("sched.paired")
    dev = device()
    ex = paired.ArmExpect([1], 3, 3, max_reqs=1, device=dev)
    ref = paired.ArmExpect([1], 3, 3, max_reqs=1, device=dev, fused=False)
    calls = []

    def broken(*a, **k):
        calls.append(k.get("fused"))
        if k.get("fused"):
            raise RuntimeError("compile error")
        return pc.add_rows(*a, **k)

    monkeypatch.setattr(paired, "add_rows", broken)
    step = (torch.tensor([0], device=dev), torch.tensor([[5, 6, -1, -1]], device=dev),
            torch.tensor([1], device=dev), torch.tensor([True], device=dev))
    for e in (ex, ref):
        e.top1[0] = torch.tensor([5, 6, 7], device=dev)
        e.verified(1, *step)
    assert ex.fused is False and torch.equal(ex.sums, ref.sums)
    ex.verified(1, *step)  # no second try of the kernel
    assert calls.count(True) == (1 if pc.use_fused(dev) else 0)
