"""The greedy walk's target argmax over the vocabulary, on the device (impl='triton').

torch.argmax over the verify rows of a tree step (64 rows of 151,936 bf16 logits at 1
request on the 8B shape) took 34 us on the H100 where reading them takes ~6 (run 26):
its reduction spreads a row over few programs.  Here a row is spread over chunks:

  part:   grid (rows, chunks of CH tokens): the chunk's best as one int64,
          (ordered float bits << 32) | (2**32 - 1 - token id);
  final:  grid (rows,): the largest of the row's chunk keys -> the token id.

The rule is torch.argmax's: the first index of the maximum, NaN above every number
(the first NaN wins, whatever its sign bit), -0.0 equal to +0.0.  Two launches, no host
sync (graph-capturable).
"""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON, interpreting, next_pow2, tl, triton

CH = 4096  # tokens per chunk
# 'auto' under the engine: "torch" (measured) or "triton" (not yet timed on a GPU; the
# device benches set it to compare the two in one engine)
AUTO = "torch"


def row_argmax(x: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """int64 [...]: the argmax of x [..., V] over its last dim (torch.argmax's rule).
    impl: 'auto' (AUTO on CUDA, else torch), 'triton' (CUDA, or CPU under
    TRITON_INTERPRET=1), 'torch'."""
    if impl == "auto":
        impl = AUTO if HAS_TRITON and x.is_cuda else "torch"
    if impl == "torch":
        return x.argmax(-1)
    if impl != "triton":
        raise ValueError(f"unknown impl {impl!r}")
    if not HAS_TRITON or not (x.is_cuda or interpreting()):
        raise RuntimeError("impl='triton' needs triton and CUDA tensors (or TRITON_INTERPRET=1)")
    v = x.shape[-1]
    if not 1 <= v < (1 << 31):
        raise ValueError(f"the last dim must be 1..2**31 - 1, got {v}")
    rows = x.reshape(-1, v)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    nr = rows.shape[0]
    out = torch.empty(nr, dtype=torch.int64, device=x.device)
    if nr:
        ch = min(CH, max(16, next_pow2(v)))
        nch = triton.cdiv(v, ch)
        keys = torch.empty(nr, nch, dtype=torch.int64, device=x.device)
        _part_kernel[(nr, nch)](rows, keys, rows.stride(0), v, nch, CH=ch, num_warps=4)
        _final_kernel[(nr,)](keys, out, nch, NCHP=max(2, next_pow2(nch)), num_warps=1)
    return out.view(x.shape[:-1])


if HAS_TRITON:

    @triton.jit
    def _part_kernel(x_ptr, key_ptr, stride_row, V, NCH, CH: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        v = c * CH + tl.arange(0, CH)
        x = tl.load(x_ptr + row * stride_row + v, mask=v < V, other=float("-inf")).to(tl.float32)
        x = tl.where(x == 0.0, 0.0, x)  # -0.0 -> +0.0
        b = x.to(tl.int32, bitcast=True)
        o = b ^ ((b >> 31) & 0x7FFFFFFF)  # float order as int order
        o = tl.where(x != x, 2147483647, o)  # NaN above +inf
        low = (tl.full([CH], 1, tl.int64) << 32) - 1  # 2**32 - 1, as int64
        key = (o.to(tl.int64) << 32) | (low - v.to(tl.int64))
        key = tl.where(v < V, key, -9223372036854775808)
        tl.store(key_ptr + row * NCH + c, tl.max(key, 0))

    @triton.jit
    def _final_kernel(key_ptr, out_ptr, NCH, NCHP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, NCHP)
        k = tl.max(tl.load(key_ptr + row * NCH + c, mask=c < NCH,
                           other=-9223372036854775808), 0)
        low = (tl.full([], 1, tl.int64) << 32) - 1
        tl.store(out_ptr + row, low - (k & low))
