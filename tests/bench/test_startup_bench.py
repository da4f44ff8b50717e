"""bench/gpu/startup_bench.py: what it reads from vLLM's start-up log (lines of run 19's
logs, vLLM 0.33.0) and the table it prints (a broken parser costs a device call)."""

from .conftest import load_bench

LOG = """\
(MainProcess pid=3584) INFO 12-06 05:27:52 [core.py:139] Initializing a V1 LLM engine (v0.33.0) with config: model='/tmp/gdn27b_models/target', compilation_config={'mode': 0, 'cudagraph_capture_sizes': [16, 32, 48, 64], 'cudagraph_mode': 'FULL_DECODE_ONLY'}
(MainProcess pid=3584) INFO 12-06 05:27:58 [gpu_model_runner.py:4100] Model loading took 53.53 GiB memory and 4.365669 s
(MainProcess pid=3584) INFO 12-06 05:27:59 [gpu_model_runner.py:4100] drafter: 'cudagraph_capture_sizes': []
(MainProcess pid=3584) INFO 12-06 05:28:10 [model_runner.py:1168] Graph capturing finished in 3 secs, took 0.58 GiB
(MainProcess pid=3584) INFO 12-06 05:28:21 [model_runner.py:1168] Graph capturing finished in 11 secs, took 1.67 GiB
(MainProcess pid=3584) INFO 12-06 05:28:21 [core.py:412] init engine (profile, create kv cache, warmup model) took 21.90 s
"""


def test_parse_log_reads_captures_init_and_sizes():
    r = load_bench("startup_bench").parse_log(LOG)
    assert r == {"captures": 2, "capture_s": 14, "capture_gib": 2.25, "init_engine_s": 21.9,
                 "load_s": 4.37, "capture_sizes": 4}


def test_parse_log_of_an_engine_that_never_started():
    r = load_bench("startup_bench").parse_log("Traceback (most recent call last):\n")
    assert r["captures"] == 0 and r["init_engine_s"] is None and r["capture_sizes"] is None


def test_table_warm_medians_ratio_and_cold_starts():
    S = load_bench("startup_bench")
    rec = lambda cfg, n, cache, s: {"config": cfg, "max_num_seqs": n, "cache": cache,
                                    "start_s": s, "rc": 0, "capture_s": 5,
                                    "capture_gib": 0.5, "capture_sizes": 8}
    records = [rec("chain", 1, "cold", 30.0), rec("tree", 1, "cold", 90.0),
               rec("chain", 1, "warm", 10.0), rec("tree", 1, "warm", 14.0),
               rec("chain", 1, "warm", 12.0), rec("tree", 1, "warm", 16.0),
               dict(rec("tree", 8, "warm", None), rc="timeout")]
    t = S.table(records).splitlines()
    assert t[2].startswith("| chain | 1 | 11.0 (10.0-12.0) | 1.00 |") and t[2].endswith("| 30.0 |")
    assert t[4].startswith("| tree | 1 | 15.0 (14.0-16.0) | 1.36 |") and t[4].endswith("| 90.0 |")
    assert "failed: timeout" in t[5]


def test_compiled_counts_cubins_by_kernel(tmp_path):
    S = load_bench("startup_bench")
    for d, name in (("a1", "_verify_kernel"), ("a2", "_verify_kernel"), ("b", "_walk")):
        (tmp_path / d).mkdir()
        (tmp_path / d / f"{name}.cubin").write_bytes(b"")
        (tmp_path / d / f"{name}.json").write_text("{}")
    assert S.compiled(str(tmp_path)) == {"_verify_kernel": 2, "_walk": 1}
    assert S.compiled(str(tmp_path / "missing")) == {}


def test_a_child_past_its_timeout_is_recorded_not_raised(tmp_path, monkeypatch):
    """subprocess.TimeoutExpired carries bytes (even with text=True) or None: the
    record says "timeout", with what the child printed, and the run goes on."""
    import subprocess

    S = load_bench("startup_bench")

    def late(*a, **k):
        raise subprocess.TimeoutExpired(a[0], 1, output=b"Graph capturing finished in 3 "
                                        b"secs, took 0.5 GiB\n", stderr=None)

    monkeypatch.setattr(S.subprocess, "run", late)
    rec = S.run(str(tmp_path), "ddtree64autoasync", 8, 1, str(tmp_path / "cache"))
    assert rec["rc"] == "timeout" and rec["start_s"] is None and rec["captures"] == 1
    assert rec["cache"] == "cold" and rec["compiled_total"] == 0
