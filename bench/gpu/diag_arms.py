"""Host cost and host syncs of the tree-vs-chain choice's worker half (v2_arms.py) on
CUDA: each call under torch's sync debug mode ("error"), then its host and GPU time.

    python bench/gpu/diag_arms.py
"""
import sys
import time
import traceback

sys.path.insert(0, "tests")
import torch  # noqa: E402
from gpu.conftest import payload_module  # noqa: E402

v2a = payload_module("sched.paired")
dev = "cuda"
n, L, K, C = 2, 15, 64, 15
ex = v2a.ArmExpect([1, 2], C, L, 32, torch.device(dev))
idx = torch.randint(0, 151936, (n, L, K), device=dev)
vals = torch.randn(n, L, K, device=dev).sort(-1, descending=True).values
lse = torch.logsumexp(vals, -1) + 1
slots = torch.tensor([3, 0], device=dev)
out = torch.full((n, L + 1), -1, dtype=torch.int64, device=dev)
out[:, :4] = idx[:, :4, 0]
acc = torch.tensor([3, 3], device=dev)
valid = torch.ones(n, dtype=torch.bool, device=dev)
fs = {"draft (tree step)": lambda: ex.draft(vals, idx, lse, slots),
      "verified (tree step)": lambda: ex.verified(n, slots, out, acc, valid)}
for f in fs.values():
    for _ in range(10):
        f()
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")
for name, f in fs.items():
    try:
        for _ in range(9):
            f()
        print(name, "no sync")
    except Exception:
        print(name, "SYNC:", "".join(traceback.format_exc().splitlines(True)[-8:]))
torch.cuda.set_sync_debug_mode(0)
for name, f in fs.items():
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50):
        f()
    h = (time.perf_counter() - t) / 50 * 1e3
    torch.cuda.synchronize()
    t2 = (time.perf_counter() - t) / 50 * 1e3
    print(f"{name}: host {h:.3f} ms, with gpu {t2:.3f} ms")
