import sys, time, traceback
sys.path.insert(0, "tests")
import torch
from gpu.conftest import payload_module
v2a = payload_module("v2_arms")
from ddtree_patcher.core import build_tree_from_topk
dev = "cuda"
ex = v2a.ArmExpect([1, 2], 15, 15, 32, torch.device(dev))
vals = torch.randn(1, 15, 64, device=dev); idx = torch.arange(64, device=dev).expand(1, 15, 64).clone()
lse = torch.logsumexp(vals, -1) + 3
tree = build_tree_from_topk(vals, idx, 64, 64, lse)
slots = torch.tensor([0], device=dev)
acc = torch.tensor([2], device=dev); nodes = torch.tensor([64], device=dev); valid = torch.tensor([True], device=dev)
fs = {"draft_tree": lambda: ex.draft(1, vals, idx, lse, slots, tree),
      "draft_chain": lambda: ex.draft(1, vals, idx, lse, slots),
      "verified_tree": lambda: ex.verified(slots, acc, False, num_nodes=nodes, valid=valid),
      "verified_chain": lambda: ex.verified(slots, acc, True, k_chain=15),
      "build": lambda: build_tree_from_topk(vals, idx, 64, 64, lse)}
for f in fs.values():
    for _ in range(10): f()
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")
for name, f in fs.items():
    try:
        for _ in range(9): f()
        print(name, "no sync")
    except Exception as e:
        print(name, "SYNC:", "".join(traceback.format_exc().splitlines(True)[-8:]))
torch.cuda.set_sync_debug_mode(0)
for name, f in fs.items():
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(50): f()
    h = (time.perf_counter() - t) / 50 * 1e3
    torch.cuda.synchronize(); t2 = (time.perf_counter() - t) / 50 * 1e3
    print(f"{name}: host {h:.3f} ms, with gpu {t2:.3f} ms")
