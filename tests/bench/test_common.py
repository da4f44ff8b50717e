"""bench/gpu/common.py's helpers that reach into a live engine, against the real
payload classes in a stand-in engine (a broken helper costs a whole device call:
run 9's e2e cells died in reset_arms after an ArmExpect change)."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

COMMON = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "common.py"


def _common():
    spec = importlib.util.spec_from_file_location("bench_common", COMMON)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reset_arms_renews_both_halves():
    from tests.gpu.conftest import payload_module

    arms, v2_arms = payload_module("arms"), payload_module("v2_arms")
    C = _common()
    lookup = arms.ArmLookup([0, 64, 64], 15)
    lookup.stats[(1, 64)].add(5, 0.008)
    ex = v2_arms.ArmExpect([1, 2], 15, 15, 4, "cpu")
    ex.sums[1] = 3.0
    sched = SimpleNamespace(dynamic_sd_lookup=lookup)
    spec = SimpleNamespace(expect=ex)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(
        engine_core=SimpleNamespace(engine_core=SimpleNamespace(scheduler=sched)),
        model_executor=SimpleNamespace(driver_worker=SimpleNamespace(
            worker=SimpleNamespace(model_runner=SimpleNamespace(speculator=spec))))))
    assert C.arms_of(llm) is lookup
    C.reset_arms(llm)
    fresh = sched.dynamic_sd_lookup
    assert fresh is not lookup and list(fresh) == [0, 64, 64] and fresh.chain == 15
    assert fresh.stats[(1, 64)].steps == 0
    assert spec.expect is ex and float(ex.sums.abs().sum()) == 0
