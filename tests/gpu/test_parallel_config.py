"""What DDTree accepts of vLLM's parallelism (payload/config.py): tensor parallelism
runs; pipeline, data, expert and context parallelism and micro-batching are refused
with a message that says what to do.  Stand-in configs carry the fields vLLM's
ParallelConfig has (0.20.x to 0.33.0); the engine tier refuses one for real."""

import sys
import types
from types import SimpleNamespace

import pytest

from .conftest import payload_module


def _par(**kw):
    base = dict(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1,
                enable_expert_parallel=False, enable_eplb=False, enable_dbo=False,
                ubatch_size=0, decode_context_parallel_size=1,
                prefill_context_parallel_size=1)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tensor_parallel_is_accepted(tp):
    payload_module("config").refuse_parallelism(_par(tensor_parallel_size=tp))


@pytest.mark.parametrize("fields, words", [
    ({"pipeline_parallel_size": 2}, "pipeline parallelism"),
    ({"data_parallel_size": 2}, "data parallelism"),
    ({"enable_expert_parallel": True}, "expert parallelism"),
    ({"enable_eplb": True}, "expert parallelism"),
    ({"enable_dbo": True}, "micro-batching"),
    ({"ubatch_size": 2}, "micro-batching"),
    ({"decode_context_parallel_size": 2}, "decode_context_parallel_size=2"),
    ({"prefill_context_parallel_size": 2}, "prefill_context_parallel_size=2"),
])
def test_other_parallelism_is_refused(fields, words):
    with pytest.raises(ValueError) as e:
        payload_module("config").refuse_parallelism(_par(tensor_parallel_size=2, **fields))
    msg = str(e.value)
    assert "method='ddtree'" in msg and words in msg
    if "micro" not in words:  # and it says what does work
        assert "tensor parallelism (--tensor-parallel-size) is supported" in msg


def test_engine_config_hook_refuses(monkeypatch):
    """ddtree_vllm_config (the VllmConfig.__post_init__ hook) applies the refusals;
    an older ParallelConfig without the newer fields is fine."""
    envs = types.ModuleType("vllm.envs")
    envs.VLLM_USE_V2_MODEL_RUNNER = False
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.envs", envs)
    cfg = payload_module("config")

    def vllm_config(par):
        return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=None),
                               parallel_config=par, model_config=None)

    cfg.ddtree_vllm_config(vllm_config(SimpleNamespace(
        tensor_parallel_size=2, pipeline_parallel_size=1)))
    with pytest.raises(ValueError, match="data parallelism"):
        cfg.ddtree_vllm_config(vllm_config(_par(data_parallel_size=4)))


@pytest.mark.parametrize("mode, budgets, error", [
    (None, None, None), ("off", None, None), ("auto", None, None), ("auto", [4, 16], None),
    ("on", None, "must be 'off' or 'auto'"), ("off", [4], "needs ddtree_budget_control"),
    ("auto", [0, 4], "in 1..16"), ("auto", [32], "in 1..16"), ("auto", [], "in 1..16"),
])
def test_budget_control_knobs(mode, budgets, error):
    spec = SimpleNamespace(ddtree_budget=16, ddtree_budget_control=mode,
                           ddtree_budgets=budgets)
    check = payload_module("config").check_budget_control
    if error is None:
        check(spec)
    else:
        with pytest.raises(ValueError, match=error):
            check(spec)


def test_budget_control_under_tp_needs_one_cost_table(monkeypatch):
    """Each rank would otherwise take the table of its own GPU's name: under TP the
    controller runs only with one table for every rank (ddtree_cost_table, which travels
    in the engine's config; the deprecated VLLM_DDTREE_COST_TABLE still fills it)."""
    envs = types.ModuleType("vllm.envs")
    envs.VLLM_USE_V2_MODEL_RUNNER = False
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.envs", envs)
    cfg = payload_module("config")
    spec = SimpleNamespace(ddtree_budget=8, ddtree_depth=4, ddtree_budget_control="auto")
    vc = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=None),
                         parallel_config=_par(tensor_parallel_size=2), model_config=None,
                         speculative_config=spec)
    monkeypatch.delenv("VLLM_DDTREE_COST_TABLE", raising=False)
    with pytest.raises(ValueError, match="ddtree_cost_table"):
        cfg.ddtree_vllm_config(vc)
    spec.ddtree_cost_table = "/tmp/table.json"
    cfg.ddtree_vllm_config(vc)
    assert spec.ddtree_config.cost_table == "/tmp/table.json"
    spec.ddtree_cost_table = None
    monkeypatch.setenv("VLLM_DDTREE_COST_TABLE", "/tmp/old.json")
    cfg.ddtree_vllm_config(vc)
    assert spec.ddtree_config.cost_table == "/tmp/old.json"
    vc.parallel_config = _par()
    monkeypatch.delenv("VLLM_DDTREE_COST_TABLE")
    cfg.ddtree_vllm_config(vc)  # one rank: its own table
    assert spec.ddtree_config.cost_table is None


def test_the_v2_runtime_names_the_same_kinds():
    """One list of refusals: config.py raises the first, the V2 runtime's check_runner
    names every kind (tests/engine/test_v2_helpers.py runs it)."""
    unsupported = payload_module("config").unsupported_parallelism
    par = _par(pipeline_parallel_size=2, enable_dbo=True, decode_context_parallel_size=2,
               prefill_context_parallel_size=2)
    assert [k for k, _ in unsupported(par)] == [
        "pipeline parallelism", "micro-batching (DBO)", "context parallelism (PCP/DCP)",
        "context parallelism (PCP/DCP)"]
    assert unsupported(SimpleNamespace(use_ubatching=True))[0][0] == "micro-batching (DBO)"
    assert unsupported(_par(tensor_parallel_size=8)) == []
