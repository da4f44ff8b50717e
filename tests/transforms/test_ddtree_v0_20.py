"""ddtree-proposer / ddtree-sampler on the real files of vLLM 0.20.0, 0.20.1, 0.20.2:
every hook lands where the design needs it, steps are idempotent and fail closed, and
apply / revert through the CLI on a real 0.20.2 tree add the CUDA payload and put
everything back byte for byte."""

import ast

import pytest

from ddtree_patcher.patches.ddtree import PROPOSER, SAMPLER, v0_20, v0_32
from ddtree_patcher.patches.framework import AnchorError, function_code
from helpers import snapshot

VERSIONS = ["0.20.0", "0.20.1", "0.20.2"]


def patched_sources(site, version):
    srcs = {}
    for t in (PROPOSER, SAMPLER):
        for e in t.family(version).edits:
            src = srcs.get(e.path) or (site / e.path).read_text()
            assert not e.is_applied(src), e.path
            out = e.apply(src)
            assert e.is_applied(out)
            assert e.apply(out) == out  # idempotent
            srcs[e.path] = out
    for path, src in srcs.items():
        ast.parse(src, path)
    return srcs


def lines_of(code: str) -> list[str]:
    return [x.strip() for x in code.splitlines() if x.strip()]


def after(code: str, anchor: str, hook: str, before: bool = False) -> bool:
    ls = lines_of(code)
    i = next(k for k, x in enumerate(ls) if anchor in x)
    window = ls[max(0, i - 6): i] if before else ls[i: i + 25]
    return any(hook in x for x in window)


@pytest.mark.parametrize("version", VERSIONS)
def test_hooks_on_real_files(pristine, version):
    site = pristine("vllm", version)
    srcs = patched_sources(site, version)
    assert set(srcs) == {v0_20.SPEC, v0_20.VLLM, v0_20.RUNNER, v0_20.INPUT, v0_20.FLASH,
                         v0_20.FLEX, v0_32.METRICS, v0_32.SAMPLING}
    assert "validate_request(params, self.speculative_config)" in srcs[v0_20.INPUT]
    check = function_code(srcs[v0_32.SAMPLING], "SamplingParams._validate_spec_decode")
    assert "return  # DDTree checks its request features itself" in check
    runner = srcs[v0_20.RUNNER]
    init = function_code(runner, "GPUModelRunner.__init__")
    assert "DDTreeProposer(self.vllm_config, self.device, self)" in init
    assert "make_runtime(self)" in init and "self.rejection_sampler = self.ddtree.sampler" in init
    assert after(function_code(runner, "GPUModelRunner._prepare_inputs"),
                 "compute_slot_mapping(", "self.ddtree.prepare(")
    assert after(function_code(runner, "GPUModelRunner.execute_model"),
                 "self._build_attention_metadata(", "self.ddtree.attach(attn_metadata)")
    assert after(function_code(runner, "GPUModelRunner._dummy_run"),
                 "self._build_attention_metadata(", "self.ddtree.attach_dummy(attn_metadata)")
    assert after(function_code(runner, "GPUModelRunner.sample_tokens"),
                 "sampler_output = self._sample(logits, spec_decode_metadata)",
                 "self.ddtree.commit(aux_hidden_states)")
    for path, cls in ((v0_20.FLASH, "FlashAttentionImpl"), (v0_20.FLEX, "FlexAttentionImpl")):
        fwd = function_code(srcs[path], f"{cls}.forward")
        # the tree path comes after the profiling-run exit and before the kernels
        ls = lines_of(fwd)
        hook = next(k for k, x in enumerate(ls) if "tree_attention(" in x and "return" in x)
        none = next(k for k, x in enumerate(ls) if x == "if attn_metadata is None:")
        actual = next(k for k, x in enumerate(ls)
                      if x == "num_actual_tokens = attn_metadata.num_actual_tokens")
        assert none < hook < actual
        assert "attn_metadata.causal" in fwd  # drafter (non-causal) layers keep FA/Flex
    spec = srcs[v0_20.SPEC]
    assert '"ddtree"' in spec and "ddtree_budget: int | None = None" in spec
    assert "ddtree_pre_init(self)" in function_code(spec, "SpeculativeConfig.__post_init__")
    assert "ddtree_vllm_config(self)" in function_code(srcs[v0_20.VLLM],
                                                      "VllmConfig.__post_init__")


@pytest.mark.parametrize("version", ["0.20.2"])
def test_fail_closed(pristine, version):
    site = pristine("vllm", version)
    edits = {e.path: e for e in SAMPLER.family(version).edits}
    src = (site / v0_20.FLASH).read_text()
    gone = src.replace("num_actual_tokens = attn_metadata.num_actual_tokens",
                       "n_tokens = attn_metadata.num_actual_tokens")
    with pytest.raises(AnchorError):
        edits[v0_20.FLASH].apply(gone)
    runner = (site / v0_20.RUNNER).read_text()
    gone = runner.replace("attn_metadata, _ = self._build_attention_metadata(",
                          "attn_metadata, _unused = self._build_attention_metadata(")
    with pytest.raises(AnchorError):
        edits[v0_20.RUNNER].apply(gone)


def test_families_cover_020_and_032():
    for t in (PROPOSER, SAMPLER):
        for v in VERSIONS + ["0.32.0", "0.33.0"]:
            assert t.family(v) is not None
    paths = {e.path for e in SAMPLER.family("0.32.0").edits}
    # 0.32/0.33: CPU, FA and Triton hooks (K|V packed per head, all target rows marked)
    assert {v0_32.CPU_ATTN, v0_32.FLASH, v0_32.TRITON} <= paths
    assert v0_20.FLEX not in paths
    added = {a.path for a in PROPOSER.family("0.20.2").added}
    assert "vllm/v1/spec_decode/ddtree/attention/triton_tree.py" in added
    assert "vllm/v1/spec_decode/ddtree/v1/cuda.py" in added


def test_cli_apply_revert_020(tree, cli):
    site = tree("vllm", "0.20.2")
    def files():  # bytecode of touched files is dropped on purpose (stale pyc)
        return {k: v for k, v in snapshot(site).items() if "__pycache__" not in k}

    before = files()
    cli("apply", "--site-packages", site, "--no-verify", check=0)
    pkg = site / "vllm" / "v1" / "spec_decode" / "ddtree"
    for name in ("attention/triton_tree.py", "v1/cuda.py", "v1/proposer.py", "v1/sampler.py",
                 "core/tree_build.py"):
        assert (pkg / name).exists(), name
    assert "tree_attention(" in (site / v0_20.FLASH).read_text()
    cli("revert", "--site-packages", site, check=0)
    assert files() == before
