"""DDTreeConfig (payload/settings.py): the speculative_config keys, parsed and validated
once per engine; keys refused where they do not apply; the deprecated environment
variables (payload/envs.py) mapped onto the keys, each with one warning; one parser
for every yes/no value.  No vLLM needed."""

import copy
import pickle
import re
from types import SimpleNamespace

import pytest

from .conftest import payload_module

settings = payload_module("settings")
envs = payload_module("envs")
OLD = list(envs.DEPRECATED)


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    """No deprecated variable set, no warning given yet; warnings recorded."""
    for name in OLD:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(envs, "_warned", set())
    said = []
    monkeypatch.setattr(envs, "log", lambda name, msg, *a, warn=False: said.append(
        (msg % a, warn)))
    return said


def spec(**keys):
    return SimpleNamespace(**{"ddtree_budget": 8, "ddtree_depth": 4, **keys})


def build(v2=True, tp=1, **keys):
    return settings.build(spec(**keys), v2, tp)


def test_defaults():
    for v2 in (False, True):
        cfg = build(v2)
        assert (cfg.budget, cfg.depth, cfg.v2) == (8, 4, v2)
        assert cfg.split_attn == "auto" and cfg.build_graphs and cfg.chain_graphs
        assert cfg.budget_control == "off" and cfg.chain_budget == 0
        assert cfg.arms is None and cfg.cost_table is None and cfg.budgets is None


def test_keys_are_parsed():
    assert build(ddtree_split_attn=" ON ").split_attn == "on"
    assert build(False, ddtree_split_attn="off").split_attn == "off"  # V1 on CUDA too
    assert not build(ddtree_build_graphs=False).build_graphs
    assert not build(ddtree_chain_graphs="no").chain_graphs
    cfg = build(ddtree_budget_control="auto", ddtree_chain_budget=3, ddtree_arms=[1, 2])
    assert (cfg.budget_control, cfg.chain_budget, cfg.arms) == ("auto", 3, (1, 2))
    cfg = build(False, ddtree_budget_control="auto", ddtree_budgets=[2, 4],
                ddtree_cost_table="/t.json")
    assert cfg.budgets == (2, 4) and cfg.cost_table == "/t.json"
    assert build(ddtree_synthetic="/s.json").synthetic == "/s.json"


@pytest.mark.parametrize("v2,keys,match", [
    (True, {"ddtree_split_attn": "yes"}, "ddtree_split_attn must be one of auto, on, off"),
    (True, {"ddtree_build_graphs": "sometimes"}, "ddtree_build_graphs must be one of"),
    (True, {"ddtree_budget_control": "auto", "ddtree_arms": [4]}, "ddtree_arms must be"),
    # keys refused where they do not apply
    (False, {"ddtree_build_graphs": True}, "ddtree_build_graphs applies to vLLM's V2"),
    (False, {"ddtree_chain_graphs": False}, "ddtree_chain_graphs applies to vLLM's V2"),
    (False, {"ddtree_chain_budget": 3}, "ddtree_chain_budget runs on vLLM's V2"),
    (False, {"ddtree_budget_control": "auto", "ddtree_arms": [1, 2]}, "drop it"),
    (True, {"ddtree_arms": [1, 2]}, "ddtree_arms pins the tree-vs-chain choice"),
    (True, {"ddtree_budget_control": "auto", "ddtree_cost_table": "/t"}, "V1 runner"),
    (False, {"ddtree_cost_table": "/t"}, "ddtree_cost_table is the step-cost table"),
    (True, {"ddtree_budgets": [4]}, "drop ddtree_budgets"),
])
def test_bad_or_misplaced_keys_are_refused(v2, keys, match):
    with pytest.raises(ValueError, match=match):
        build(v2, **keys)


@pytest.mark.parametrize("name,value,v2,field,want", [
    ("VLLM_DDTREE_SPLIT_ATTN", "1", True, "split_attn", "on"),
    ("VLLM_DDTREE_SPLIT_ATTN", "yes", False, "split_attn", "on"),  # was "never" before
    ("VLLM_DDTREE_SPLIT_ATTN", "0", True, "split_attn", "off"),
    ("VLLM_DDTREE_SPLIT_ATTN", "AUTO", True, "split_attn", "auto"),
    ("VLLM_DDTREE_BUILD_GRAPHS", " 0 ", True, "build_graphs", False),
    ("VLLM_DDTREE_BUILD_GRAPHS", "1", True, "build_graphs", True),
    ("VLLM_DDTREE_CHAIN_GRAPHS", "0", True, "chain_graphs", False),
    ("VLLM_DDTREE_CHAIN_GRAPHS", "1", True, "chain_graphs", True),
    ("VLLM_DDTREE_BUILD_GRAPHS", "0", False, "build_graphs", True),  # V1: not read
    ("VLLM_DDTREE_CHAIN_GRAPHS", "false", True, "chain_graphs", False),  # was "on"
    ("VLLM_DDTREE_ARMS", "1,2", True, "arms", None),  # without the choice: unused
    ("VLLM_DDTREE_COST_TABLE", "/old.json", True, "cost_table", None),  # V2: unused
])
def test_deprecated_variables_fill_their_keys(monkeypatch, _clean, name, value, v2, field,
                                              want):
    monkeypatch.setenv(name, value)
    assert getattr(build(v2), field) == want
    key = envs.DEPRECATED[name]
    assert _clean == [(f"{name} is deprecated and goes away in the next release: use "
                       f"{key} (docs/configuration.md)", True)]


def test_a_key_wins_over_its_variable_and_each_warns_once(monkeypatch, _clean):
    monkeypatch.setenv("VLLM_DDTREE_SPLIT_ATTN", "1")
    monkeypatch.setenv("VLLM_DDTREE_ARMS", "1,2")
    monkeypatch.setenv("VLLM_DDTREE_COST_TABLE", "/old.json")
    assert build(ddtree_split_attn="off").split_attn == "off"
    assert build(ddtree_budget_control="auto").arms == (1, 2)
    assert build(ddtree_budget_control="auto", ddtree_arms=[3, 4]).arms == (3, 4)
    assert build(False, ddtree_budget_control="auto").cost_table == "/old.json"
    assert build(False, ddtree_budget_control="auto",
                 ddtree_cost_table="/new.json").cost_table == "/new.json"
    assert sorted(m.split()[0] for m, _ in _clean) == [
        "VLLM_DDTREE_ARMS", "VLLM_DDTREE_COST_TABLE", "VLLM_DDTREE_SPLIT_ATTN"]


@pytest.mark.parametrize("name,value,match", [
    ("VLLM_DDTREE_SPLIT_ATTN", "sometimes", "VLLM_DDTREE_SPLIT_ATTN must be one of"),
    ("VLLM_DDTREE_BUILD_GRAPHS", "2", "VLLM_DDTREE_BUILD_GRAPHS must be one of"),
    ("VLLM_DDTREE_ARMS", "4", "VLLM_DDTREE_ARMS must be"),
])
def test_a_bad_deprecated_value_is_a_configuration_error(monkeypatch, name, value, match):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        build(ddtree_budget_control="auto")


def test_one_parser_for_yes_and_no():
    for v in ("1", "true", "Yes", " ON ", True):
        assert envs.flag(v, "x") is True
    for v in ("0", "false", "NO", "off", False):
        assert envs.flag(v, "x") is False
    for v in ("", "2", "maybe"):
        with pytest.raises(ValueError, match="x must be one of"):
            envs.flag(v, "x")


def test_the_config_is_frozen_travels_and_owns_its_channel():
    cfg = build()
    with pytest.raises(AttributeError):
        cfg.budget = 4
    assert build().channel is not cfg.channel  # one channel per engine configuration
    s = spec(ddtree_config=cfg)
    assert copy.copy(s).ddtree_config.channel is cfg.channel  # V2's draft spec: shared
    again = pickle.loads(pickle.dumps(cfg))  # another process: its own copy
    assert again == cfg and again.channel is not cfg.channel
    assert settings.of(s) is cfg
    with pytest.raises(RuntimeError, match="no ddtree_config"):
        settings.of(spec())
    assert settings.enabled(s) and not settings.enabled(None)
    assert not settings.enabled(SimpleNamespace(ddtree_budget=None))


def test_keys_need_method_ddtree():
    cfg = payload_module("config")
    for key in cfg.KEYS:
        s = SimpleNamespace(method="dflash", **{key: 1})
        with pytest.raises(ValueError, match=f"{key} needs method='ddtree'"):
            cfg.ddtree_pre_init(s)
    with pytest.raises(ValueError, match="ddtree_config is set by DDTree itself"):
        cfg.ddtree_pre_init(SimpleNamespace(method="ddtree", ddtree_config=object()))


def _params(**kw):
    plain = dict(logprobs=None, presence_penalty=0.0, frequency_penalty=0.0,
                 repetition_penalty=1.0, bad_words=None, logit_bias=None,
                 allowed_token_ids=None, min_tokens=0, min_p=0.0, structured_outputs=None,
                 thinking_token_budget=None, logprob_token_ids=None)
    return SimpleNamespace(**{**plain, **kw})


def test_request_features_by_runner():
    """V1 serves logprobs, penalties, bad words, logit bias, allowed tokens, min_tokens,
    min_p and structured outputs per tree node, V2 all of them too;
    an engine whose runner is unknown refuses them all, each by name; thinking budgets
    and logprob_token_ids stay refused."""
    config = payload_module("config")
    v1, v2 = (SimpleNamespace(ddtree_config=build(v)) for v in (False, True))
    served = dict(logprobs=2, presence_penalty=0.5, repetition_penalty=1.2,
                  bad_words=["w5"], logit_bias={5: 1.0}, allowed_token_ids=[5],
                  min_tokens=3, min_p=0.1, structured_outputs=object())
    for key, value in served.items():
        config.validate_request(_params(**{key: value}), v1)
        with pytest.raises(ValueError, match="this engine") as e:
            config.validate_request(_params(**{key: value}), None)
        assert key.split("_")[0] in str(e.value)
        config.validate_request(_params(**{key: value}), v2)
    for key, value in dict(thinking_token_budget=5, logprob_token_ids=[5]).items():
        for spec_ in (v1, v2):
            with pytest.raises(ValueError, match=key.replace("_", ".")):
                config.validate_request(_params(**{key: value}), spec_)
    with pytest.raises(ValueError, match="logprobs=-1"):
        config.validate_request(_params(logprobs=-1), v1)
    config.validate_request(_params(logprobs=-1), v2)  # V2: as its chain does
    config.validate_request(_params(), v2)  # plain sampling everywhere


def test_structured_outputs_refused_on_0_20(monkeypatch):
    """vLLM 0.20.x has no grammar hook (v1/grammar.py hooks 0.32 / 0.33 only): there
    the V1 runner keeps refusing structured outputs by name."""
    import sys
    from types import ModuleType

    config = payload_module("config")
    v1 = SimpleNamespace(ddtree_config=build(False))
    old = ModuleType("vllm")
    old.__version__ = "0.20.2"
    monkeypatch.setitem(sys.modules, "vllm", old)
    with pytest.raises(ValueError, match="structured outputs on the V1 runner"):
        config.validate_request(_params(structured_outputs=object()), v1)
    config.validate_request(_params(min_p=0.1), v1)  # the rest is served there too


# ---- VLLM_DDTREE_ATTN_TUNING: the tree kernel's launch table, checked at configuration

@pytest.mark.parametrize("text,match", [
    ("{not json", "cannot read a JSON launch table"),
    ("[]", "non-empty JSON list"),
    ('{"max_rows": 96}', "non-empty JSON list"),
    ('[{"block_q": 8}]', "entry 0 must be an object with max_rows"),
    ('[{"max_rows": 96, "blockq": 8}]', "unknown keys \\['blockq'\\]"),
    ('[{"max_rows": 96}, {"max_rows": 512, "splits": 0}]', "entry 1 splits must be an integer"),
    ('[{"max_rows": 96, "block_n": 48}]', "block_n must be a power of two"),
    ('[{"max_rows": 96, "block_n": 8}]', "block_n must be >= 16"),
    ('[{"max_rows": 96, "num_warps": true}]', "num_warps must be an integer"),
    ('[{"max_rows": 96, "two_loops": 1}]', "two_loops must be true or false"),
    ('[{"max_rows": 96, "combine_warps": 6}]', "combine_warps must be a power of two"),
    ('[{"max_rows": 96, "combine_rows": 24}]', "combine_rows must be a power of two"),
])
def test_a_bad_launch_table_is_a_configuration_error(monkeypatch, tmp_path, text, match):
    f = tmp_path / "t.json"
    f.write_text(text)
    monkeypatch.setenv(envs.ATTN_TUNING, str(f))
    with pytest.raises(ValueError, match=re.escape(f"VLLM_DDTREE_ATTN_TUNING={f}: ") + ".*"
                       + match):
        build()


def test_a_missing_launch_table_is_a_configuration_error(monkeypatch, tmp_path):
    monkeypatch.setenv(envs.ATTN_TUNING, str(tmp_path / "nothing.json"))
    with pytest.raises(ValueError, match="cannot read a JSON launch table"):
        build()


def test_a_good_launch_table_is_what_the_kernel_reads(monkeypatch, tmp_path):
    table = [{"max_rows": 96, "block_q": 8, "block_n": 16, "splits": 4, "two_loops": True,
              "num_stages": 5, "maxnreg": 168, "fused_combine": True, "combine_warps": 8,
              "combine_rows": 16},
             {"max_rows": 4096}]
    f = tmp_path / "t.json"
    f.write_text(__import__("json").dumps(table))
    monkeypatch.setenv(envs.ATTN_TUNING, str(f))
    build()  # accepted
    tt = payload_module("attention.triton_tree")
    monkeypatch.setattr(tt, "_loaded", {})
    assert tt.tuning() == table
    assert tt.pick_config(65) == table[0] and tt.pick_config(97) == table[1]
    assert tt.pick_config(5000) == {}
