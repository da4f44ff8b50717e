"""dflash-layer-offset on the real files of the real wheels."""

from types import SimpleNamespace

import pytest

from ddtree_patcher.patches.dflash_layer_offset import TRANSFORM, v0_20
from ddtree_patcher.patches.framework import AnchorError
from helpers import load_function

RUNNER, ALGOS = v0_20.RUNNER, v0_20.ALGOS


def read(tree, rel):
    return (tree / rel).read_text()


@pytest.mark.parametrize("version", ["0.20.0", "0.20.1", "0.20.2"])
def test_before_after_on_real_files(pristine, version):
    site = pristine("vllm", version)
    edits = {e.path: e for e in TRANSFORM.family(version).edits}
    for rel, old, new in [
        (RUNNER, 'layer_ids = dflash_config.get("target_layer_ids")',
         'layer_ids = [i + 1 for i in (dflash_config.get("target_layer_ids") or [])]'),
        (ALGOS, '"target_layer_ids": aux_layer_ids,',
         '"target_layer_ids": [i - 1 for i in aux_layer_ids],'),
    ]:
        src = read(site, rel)
        assert not edits[rel].is_applied(src)
        out = edits[rel].apply(src)
        assert edits[rel].is_applied(out)
        # exactly one line changes, and it is the expected one
        a, b = src.splitlines(), out.splitlines()
        assert len(a) == len(b)
        changed = [(x, y) for x, y in zip(a, b) if x != y]
        assert [(x.strip(), y.strip()) for x, y in changed] == [(old, new)]
        assert edits[rel].apply(out) == out  # idempotent


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_upstream_detected(pristine, version):
    site = pristine("vllm", version)
    fam = TRANSFORM.family(version)
    assert fam.upstream
    for e in fam.edits:
        assert e.is_applied(read(site, e.path))


def test_anchor_missing_and_duplicated(pristine):
    site = pristine("vllm", "0.20.2")
    e = {e.path: e for e in TRANSFORM.family("0.20.2").edits}
    src = read(site, RUNNER)
    gone = src.replace('layer_ids = dflash_config.get("target_layer_ids")', "layer_ids = None")
    with pytest.raises(AnchorError):
        e[RUNNER].apply(gone)
    twice = src.replace('layer_ids = dflash_config.get("target_layer_ids")',
                        'layer_ids = dflash_config.get("target_layer_ids")\n'
                        '                layer_ids = dflash_config.get("target_layer_ids")')
    with pytest.raises(AnchorError):
        e[RUNNER].apply(twice)
    renamed = src.replace("def _get_eagle3_aux_layers_from_config", "def _aux_layers")
    with pytest.raises(AnchorError):
        e[RUNNER].apply(renamed)
    asrc = read(site, ALGOS)
    with pytest.raises(AnchorError):
        e[ALGOS].apply(asrc.replace('"target_layer_ids": aux_layer_ids', '"ids": aux_layer_ids'))


def _runner_self(dflash_ids):
    hf = SimpleNamespace(dflash_config={"mask_token_id": 7, "target_layer_ids": dflash_ids})
    return SimpleNamespace(speculative_config=SimpleNamespace(
        draft_model_config=SimpleNamespace(hf_config=hf)))


@pytest.mark.parametrize("version", ["0.20.2", "0.32.0"])
def test_functional_layer_ids(tree, version):
    """Run the real (patched or upstream) functions: runner asks for k+1, loader stores
    aux-1, and the two compose to the identity."""
    site = tree("vllm", version)
    fam = TRANSFORM.family(version)
    src = {e.path: (read(site, e.path) if fam.upstream else e.apply(read(site, e.path)))
           for e in fam.edits}
    fn = load_function(src[RUNNER], "GPUModelRunner._get_eagle3_aux_layers_from_config")
    assert fn(_runner_self([1, 3])) == (2, 4)
    update = load_function(src[ALGOS], "update_dflash")
    cfg = {}
    update({"aux_hidden_state_layer_ids": [2, 4], "mask_token_id": 9}, cfg)
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3]
    # unpatched 0.20.2 reads the previous layer: the bug the transform fixes
    if not fam.upstream:
        old = load_function(read(site, RUNNER), "GPUModelRunner._get_eagle3_aux_layers_from_config")
        assert old(_runner_self([1, 3])) == (1, 3)
