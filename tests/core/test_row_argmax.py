"""core/row_argmax.py: the Triton argmax (CUDA, or the interpreter here) is torch.argmax,
ties, NaN, infinities and signed zeros included."""

import pytest
import torch
from core_helpers import DEV, needs_triton

from ddtree_patcher.patches.ddtree.payload.core import row_argmax


def _cases(g):
    out = []
    for r, v in [(3, 7), (2, 40), (4, 4096), (3, 4097), (2, 9000), (1, 1)]:
        out.append(torch.randn(r, v, generator=g))
        out.append(torch.randint(0, 3, (r, v), generator=g).float())  # ties: the first
    x = torch.randn(9, 300, generator=g)
    x[0] = float("-inf")
    x[1, ::7] = float("nan")  # the first NaN
    x[2] = 0.0
    x[2, 3] = x[2, 5] = -0.0  # -0.0 == +0.0: index 0
    x[3, ::5] = float("inf")
    x[4] = -0.0
    x[5, 100], x[5, 200] = float("inf"), float("nan")  # NaN above +inf
    x[6, 299] = 1e30
    x[7] = -1.0
    x[7, 10], x[7, 11] = -0.0, 0.0  # the max twice, -0.0 first: index 10
    x[8, 50] = -float("nan")  # a NaN with its sign bit set is still above every number
    out.append(x)
    out.append(torch.randn(2, 3, 500, generator=g))  # [..., V]
    return out


@needs_triton
def test_row_argmax_is_torch_argmax():
    g = torch.Generator().manual_seed(5)
    half = torch.bfloat16 if DEV == "cuda" else torch.float16
    for i, x in enumerate(_cases(g)):
        for dt in (torch.float32, half) if i % 3 == 0 else (torch.float32,):
            xx = x.to(dt).to(DEV)
            got = row_argmax(xx, impl="triton")
            assert got.dtype == torch.int64 and got.shape == xx.shape[:-1]
            assert torch.equal(got.cpu(), xx.argmax(-1).cpu()), (tuple(x.shape), dt)
    wide = torch.randn(3, 50, generator=g).to(DEV)
    assert torch.equal(row_argmax(wide[:, 5:45], impl="triton").cpu(),
                       wide[:, 5:45].argmax(-1).cpu())  # a row stride != V
    assert row_argmax(torch.zeros(0, 9, device=DEV), impl="triton").shape == (0,)


def test_row_argmax_auto_and_bad_impl():
    x = torch.randn(4, 33)
    assert torch.equal(row_argmax(x), x.argmax(-1))  # CPU tensors: torch under 'auto'
    with pytest.raises(ValueError, match="unknown impl"):
        row_argmax(x, impl="cuda")
