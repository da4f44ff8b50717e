"""Each verify check fails on the fault it exists for, with a message that says what is
wrong (integrity through the real CLI on real trees; kernels with a core made wrong on
purpose)."""

import types

import pytest

import ddtree_patcher.patches.ddtree.payload.core as core
from ddtree_patcher.patches.ddtree.reference import heap as heap_reference
from ddtree_patcher.verify import kernels

SPEC_PY = "vllm/config/speculative.py"
ADDED = "vllm/v1/spec_decode/ddtree/v1/sampler.py"


@pytest.fixture
def patched(tree, cli):
    site = tree("vllm", "0.33.0")
    cli("apply", "--no-verify", "--site-packages", site, check=0)
    return site


def verify(cli, site, code):
    r = cli("verify", "--json", "--site-packages", site, check=code)
    return r.json


def test_clean_patch_passes_and_says_what_was_not_checked(patched, cli):
    """A bare tree has no interpreter: imports, kernels and the engine run are skipped,
    and a skipped check is never reported as passed."""
    j = verify(cli, patched, 0)
    status = {c["check"]: c["status"] for c in j["checks"]}
    assert status == {"integrity": "passed", "imports": "skipped", "kernels": "skipped",
                      "engine": "skipped"}
    assert j["ok"] and not j["complete"] and j["skipped"] == ["imports", "kernels", "engine"]
    for c in j["checks"]:
        assert c["ok"] is (c["status"] == "passed") and "seconds" in c
    assert "all checks passed" not in j["summary"]
    assert "NOT checked: imports, kernels, engine" in j["summary"]
    text = cli("verify", "--site-packages", patched, check=0).out
    assert "all checks passed" not in text and "NOT checked" in text
    assert "skip" in text


def test_tampered_patched_file(patched, cli):
    p = patched / SPEC_PY
    p.write_text(p.read_text().replace("ddtree_pre_init(self)", "pass"))
    j = verify(cli, patched, 1)
    assert not j["ok"] and j["failed"][0]["check"] == "integrity"
    assert f"{SPEC_PY}: differs from the patched content" in j["failed"][0]["message"]
    assert any("ddtree-patch revert" in c for c in j["recovery"])
    assert any("--force-reinstall --no-deps vllm==0.33.0" in c for c in j["recovery"])
    r = cli("verify", "--site-packages", patched, check=1)
    assert "FAIL" in r.out and "to recover:" in r.out
    assert "next: `ddtree-patch revert --site-packages" in r.err and j["next"]


def test_missing_added_module(patched, cli):
    (patched / ADDED).unlink()
    j = verify(cli, patched, 1)
    assert f"{ADDED}: missing" in j["failed"][0]["message"]


def test_planted_stale_bytecode(patched, cli):
    cache = (patched / SPEC_PY).parent / "__pycache__"
    cache.mkdir(exist_ok=True)
    pyc = cache / "speculative.cpython-311.pyc"
    # a timestamp pyc that claims another source mtime/size: Python would run it
    pyc.write_bytes(b"\x00" * 4 + b"\x00\x00\x00\x00" + b"\x01\x00\x00\x00" * 2 + b"junk")
    j = verify(cli, patched, 1)
    assert "stale bytecode" in j["failed"][0]["message"]


def test_unpatched_vllm_file_changed(patched, cli):
    p = patched / "vllm" / "envs.py"
    p.write_text(p.read_text() + "\n# changed\n")
    j = verify(cli, patched, 1)
    assert "vllm/envs.py: differs from vLLM's RECORD" in j["failed"][0]["message"]


def _wrong(core_mod, **over):
    shim = types.SimpleNamespace(**{k: getattr(core_mod, k) for k in dir(core_mod)
                                    if not k.startswith("__")})
    for k, v in over.items():
        setattr(shim, k, v)
    return shim


def test_kernel_checks_pass_on_the_real_core():
    ok, msg = kernels.run(core, "cpu", seed=1234, oracle=heap_reference)
    assert ok and "seed 1234" in msg


def test_wrong_greedy_walk_is_caught():
    def bad_walk(target, tree, backend="auto"):  # accepts nothing, ever
        res = core.walk_greedy(target, tree, backend=backend)
        rows = res.accepted_rows.clone()
        toks = res.output_tokens.clone()
        rows[:, 1:] = -1
        toks[:, 0] = target[:, 0]
        toks[:, 1:] = -1
        return core.WalkResult(rows, toks, res.num_accepted * 0)

    with pytest.raises(AssertionError, match="greedy tree walk .* differs"):
        kernels.run(_wrong(core, walk_greedy=bad_walk), "cpu", seed=3, oracle=heap_reference)


def test_biased_sampled_walk_is_caught():
    def biased(probs, tree, uniforms, backend="auto"):  # skews every uniform upwards
        return core.walk_sampled(probs, tree, uniforms.sqrt(), backend=backend)

    with pytest.raises(AssertionError, match="sampled tree walk .* differs"):
        kernels.run(_wrong(core, walk_sampled=biased), "cpu", seed=5, oracle=heap_reference)


def test_wrong_tree_build_is_caught():
    def shallow(lp, budget, bmax, logprobs=False, backend="auto"):
        t = core.build_tree(lp, budget, bmax, logprobs=logprobs, backend=backend)
        t.tokens = t.tokens.flip(1)
        return t

    with pytest.raises(AssertionError, match="tree build .* differs from the heap"):
        kernels.run(_wrong(core, build_tree=shallow), "cpu", seed=7, oracle=heap_reference)


def test_wrong_compaction_is_caught():
    def lazy(kv_caches, *a, **k):  # moves nothing
        return None

    with pytest.raises(AssertionError, match="KV compaction .* differs"):
        kernels.run(_wrong(core, compact_kv=lazy), "cpu", seed=9, oracle=heap_reference)


def test_oracle_is_loaded_next_to_the_installed_core(tmp_path, monkeypatch):
    """vLLM gets the core without the heap oracle; verify carries its own copy and
    loads it as a module of the core under test (as the runner does in the target env)."""
    import shutil
    import sys
    from pathlib import Path

    src = Path(core.__file__).parent
    shutil.copytree(src, tmp_path / "vendored_core",
                    ignore=shutil.ignore_patterns("__pycache__"))
    verify_copy = tmp_path / "verify_copy"
    shutil.copytree(Path(kernels.__file__).parent, verify_copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(heap_reference.__file__, verify_copy / "heap_reference.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    installed = importlib.import_module("vendored_core")
    vk = importlib.import_module("verify_copy.kernels")
    with pytest.raises(AttributeError):
        installed.heap_build  # noqa: B018 - not shipped
    ok, msg = vk.run(installed, "cpu", seed=11, oracle=vk.load_oracle(installed))
    assert ok and "tree build == heapq reference" in msg
    sys.modules.pop("vendored_core", None)


def test_wrong_paired_counts_are_caught():
    """The choice's counts (core/paired_counts.py) against verify's row-by-row Python
    reference: a chain count that ignores the expected run past the bonus is caught."""
    pc = core.paired_counts

    def no_rest(sums, n, slots, top1, logp, chain, out, acc, valid, rows=None, subs=None,
                fused=None):
        pc.add_rows(sums, n, slots, top1, logp.new_full(logp.shape, -1e4), chain, out, acc,
                    valid, rows, subs, fused=fused)

    shim = types.SimpleNamespace(add_rows=no_rest)
    with pytest.raises(AssertionError, match="paired counts .* differ"):
        kernels.run(_wrong(core, paired_counts=shim), "cpu", seed=11, oracle=heap_reference)
