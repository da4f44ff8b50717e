"""DDTree hooks for the V2 model runner of vLLM 0.32.0 and 0.33.0 (vllm/v1/worker/gpu/).

Each hook is a few lines calling into the added package (v2/speculator.py,
v2/runtime.py, v2/sampler.py, v2/step.py); all inert unless method='ddtree' runs on the
V2 runner: VLLM_USE_V2_MODEL_RUNNER picks it, and where vLLM chooses, ``v1_runner
.VLLM_EDIT`` allows it on CUDA (payload/config.py: ddtree_v2_enabled):

* ``init_speculator``: the DFlash drafter becomes a DDTreeSpeculator (L mask queries,
  trees built on the device, stored by request-state slot; its ``propose`` first
  commits the verified step: positions back, path rows first, KV compacted);
* ``GPUModelRunner.load_model``: the runtime (V2DDTree) is built right after the
  rejection sampler, whose place its tree sampler takes;
* ``GPUModelRunner.execute_model``: after ``prepare_attn`` computed the slot mappings
  from linear positions, tree positions and the TreeState rows are written;
* ``DefaultModelState.prepare_attn``: the target's attention metadata of verify steps
  and of every FULL CUDA-graph capture is marked (``md.ddtree``) for the backends'
  tree-attention hooks;
* ``CudaGraphManager._init_candidates``: the target's FULL decode graphs also for the
  chain arm's query length (1 + C), which vLLM's schedule may not hold
  (v2/chain_graphs.py: target_query_lens);
* ``Scheduler``: with ddtree_budget_control='auto' on V2, the lookup of drafts per batch
  size becomes an ``ArmLookup`` (sched/arms.py: the tree or the chain, by tokens/s from
  measured step times and both arms' tokens measured on the same tree steps) and every
  step output reaches its ``observe``.
"""

from __future__ import annotations

from functools import partial

from ...framework import Step, file_edit, insert_at_start
from ..hooks import RUNTIME, hook, on

SPEC_INIT = "vllm/v1/worker/gpu/spec_decode/__init__.py"
RUNNER = "vllm/v1/worker/gpu/model_runner.py"
STATE = "vllm/v1/worker/gpu/model_states/default.py"
SCHED = "vllm/v1/core/sched/scheduler.py"
GRAPHS = "vllm/v1/worker/gpu/cudagraph_utils.py"

SPECULATOR_EDIT = file_edit(SPEC_INIT, [
    hook("init_speculator", "return DDTreeSpeculator(vllm_config, device)",
         guard="speculative_config.use_ddtree()",
         imports=("v2.speculator", "DDTreeSpeculator"),
         at=lambda c: c.strip() == "return DFlashSpeculator(vllm_config, device)",
         before=True),
], "V2 runner: the DFlash drafter -> DDTreeSpeculator when method='ddtree'")

RUNNER_EDIT = file_edit(RUNNER, [
    hook("GPUModelRunner.load_model",
         "self.ddtree = make_runtime(self)\n"
         "self.rejection_sampler = self.ddtree.sampler\n",
         guard="self.speculative_config.use_ddtree()",
         imports=("v2.runtime", "make_runtime"),
         at=lambda c: c.strip().startswith("self.rejection_sampler = RejectionSampler(")),
    hook("GPUModelRunner.execute_model", "self.ddtree.prepare(input_batch)", guard=RUNTIME,
         at=lambda c: c.strip() == "block_tables, slot_mappings = "
                                   "self.prepare_attn(input_batch)"),
], "V2 runner: tree sampler, tree positions and tree masks of verify steps")

STATE_EDIT = file_edit(STATE, [
    hook("DefaultModelState.prepare_attn",
         "self.ddtree.mark(input_batch, attn_metadata, for_capture)", guard=RUNTIME,
         at=lambda c: c.lstrip().startswith("attn_metadata = build_attn_metadata(")),
], "V2 runner: tree attention for verify steps and FULL CUDA-graph captures")

SCHEDULER_EDIT = file_edit(SCHED, [
    hook("Scheduler.__init__",
         "self.dynamic_sd_lookup = wrap_lookup(self, self.dynamic_sd_lookup)",
         guard=on("speculative_config"), imports=("sched.arms", "wrap_lookup"),
         at=lambda c: c.lstrip().startswith(
             "self.dynamic_sd_lookup = build_dynamic_sd_schedule_lookup(")),
    Step("Scheduler.update_from_output", partial(
        insert_at_start, qualname="Scheduler.update_from_output",
        code="observe = getattr(self.dynamic_sd_lookup, 'observe', None)\n"
             "if observe is not None:\n"
             "    observe(scheduler_output, model_runner_output)\n"),
        "observe(scheduler_output, model_runner_output)"),
], "V2 runner, ddtree_budget_control='auto': the tree or the chain per batch size, "
   "by tokens/s (measured step times, the drafter's expected tokens)")

GRAPHS_EDIT = file_edit(GRAPHS, [
    hook("CudaGraphManager._init_candidates",
         "decode_query_lens = target_query_lens(\n"
         "    self, decode_query_lens, num_new_sampled_tokens_per_step)\n",
         guard=on("speculative_config"), imports=("v2.chain_graphs", "target_query_lens"),
         at=lambda c: c.strip().startswith("decode_query_lens = sorted("),
         marker="target_query_lens("),
], "V2 runner, ddtree_budget_control='auto': the target's FULL graphs for chain-arm "
   "steps at the tree batch sizes")

PROPOSER_EDITS = (SPECULATOR_EDIT, SCHEDULER_EDIT, GRAPHS_EDIT)
SAMPLER_EDITS = (RUNNER_EDIT, STATE_EDIT)
