"""bench/gpu/common.py's helpers that reach into a live engine, against the real
payload classes in a stand-in engine (a broken helper costs a whole device call:
run 9's e2e cells died in reset_arms after an ArmExpect change)."""

from types import SimpleNamespace

import pytest

from .conftest import load_bench

torch = pytest.importorskip("torch")


def _common():
    return load_bench("common")


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


def _step_bench():
    return load_bench("step_bench")


def test_the_synthetic_drafter_is_the_same_for_every_config():
    """Ranks belong to the true tokens: the same text gets the same drafter whatever the
    batch it is drafted in (so configs differ only by what they draft); its top-1 is
    right as often as the profile says."""
    sb = _step_bench()
    V = 2000
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(0))
    fs = sb.FastSynthetic(perm, [0.8, 0.1, 0.04])
    meta = torch.empty(1, 1, V)
    one = fs.logits(None, {"next_token_ids": torch.tensor([5])}, 1, 6, meta)
    two = fs.logits(None, {"next_token_ids": torch.tensor([9, 5])}, 2, 6, meta)
    assert torch.equal(one.argmax(-1), two[1:].argmax(-1))
    assert torch.equal(one.topk(3, -1).indices, two[1:].topk(3, -1).indices)
    t = torch.arange(V)
    top1 = fs.logits(None, {"next_token_ids": t}, V, 1, meta).argmax(-1)[:, 0]
    assert float((top1 == perm[t]).float().mean()) == pytest.approx(0.8, abs=0.03)


def test_config_names_of_the_step_bench():
    sb = _step_bench()
    cg = sb.parse("ddtree64autocgasync")
    assert cg["cg"] and cg["auto"] and cg["async_sched"] and cg["k"] == 64 and cg["chain"] == 15
    assert cg["cg"] == "1" and sb.parse("ddtree64autoasync")["cg"] is None  # the default
    assert cg["per_batch"] == [[1, 1, 64], [2, 2, 32], [3, 1 << 16, 15]]  # DDTree's V2 default
    assert sb.parse("ddtree16autoasync")["per_batch"] == [[1, 2, 16], [3, 1 << 16, 15]]
    off = sb.parse("ddtree64autonocgasync")
    assert off["cg"] == "0" and off["auto"] and off["k"] == 64
    assert sb.parse("ddtree64chainasync")["per_batch"] == [[1, 2, 64], [3, 1024, 15]]
    warm = sb.parse("ddtree64autowarmnocgasync")
    assert warm["warm"] and warm["auto"] and warm["cg"] == "0" and warm["k"] == 64
    assert sb.parse("ddtree64autowarmasync")["warm"] and not cg["warm"]
    bg = sb.parse("ddtree64autowarmbgcgasync")
    assert bg["bg"] == "1" and bg["warm"] and bg["cg"] == "1" and bg["k"] == 64
    assert cg["bg"] is None  # the default (on)
    assert sb.parse("ddtree32bg") == dict(sb.parse("ddtree32"), bg="1")
    nobg = sb.parse("ddtree64autonobgasync")
    assert nobg["bg"] == "0" and nobg["auto"] and nobg["k"] == 64 and nobg["cg"] is None
    assert sb.parse("ddtree64autowarmnobgnocgasync")["bg"] == "0"
