"""Raw benchmark results live as one deterministic archive per run under bench/results/
(issue #28), bench/RESULTS.md names each of them, and the readers take the archives."""

import importlib.util
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from .conftest import load_bench

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


def _pack_results():
    spec = importlib.util.spec_from_file_location("pack_results",
                                                  ROOT / "bench" / "pack_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _archives():
    found = sorted(RESULTS.glob("*.tar.xz"))
    assert found, "no archives under bench/results"
    return found


def test_no_raw_results_in_the_source_tree():
    tracked = subprocess.run(["git", "ls-files", "bench"], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    if not tracked:  # not a git checkout (an sdist): the folders must be gone anyway
        tracked = [p.relative_to(ROOT).as_posix() for p in (ROOT / "bench").rglob("*")]
    raw = [f for f in tracked if f.startswith(("bench/gpu/results/", "bench/core_results/"))]
    assert not raw, raw[:5]


def test_archives_are_deterministic():
    """One top folder named as the archive, regular files in sorted order, mtime 0,
    owner 0:0 without names, mode 0644: the same files always pack to the same bytes."""
    for path in _archives():
        run = path.name[:-len(".tar.xz")]
        with tarfile.open(path, "r:xz") as tf:
            members = tf.getmembers()
        names = [m.name for m in members]
        assert names == sorted(names), path.name
        for m in members:
            assert m.isfile() and m.name.startswith(f"{run}/"), (path.name, m.name)
            assert (m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) == \
                (0, 0, 0, "", "", 0o644), (path.name, m.name)


def test_packing_again_gives_the_same_bytes(tmp_path):
    pack = _pack_results()
    src = RESULTS / "run4_032.tar.xz"
    folder = pack.extract(str(src), str(tmp_path / "x"))
    a = pack.pack(folder, "run4_032", str(tmp_path / "a"))
    b = pack.pack(folder, "run4_032", str(tmp_path / "b"))
    assert Path(a).read_bytes() == Path(b).read_bytes()
    with tarfile.open(src) as old, tarfile.open(a) as new:
        assert [(m.name, m.size) for m in old] == [(m.name, m.size) for m in new]
        for m in old:
            assert old.extractfile(m).read() == new.extractfile(m.name).read()
    assert pack.read_member(str(src), "run4_032/equality.json")[:1] == b"{"


def test_results_md_names_every_archive_and_only_existing_ones():
    text = (ROOT / "bench" / "RESULTS.md").read_text()
    named = set(re.findall(r"bench/results/([\w.-]+\.tar\.xz)", text))
    assert named == {p.name for p in _archives()}
    assert "bench/gpu/results/" not in text and "bench/core_results" not in text


def test_report_reads_a_packed_run(monkeypatch, capsys):
    report = load_bench("report")
    monkeypatch.setattr(sys, "argv", ["report.py", str(RESULTS / "run3.tar.xz")])
    report.main()
    out = capsys.readouterr().out
    assert "### Equality" in out and "### Step time" in out and "| ddtree64 |" in out
    monkeypatch.setattr(sys, "argv", ["report.py", str(RESULTS / "run12_033.tar.xz") + "/c3"])
    report.main()
    assert "### V2, repeated: end to end" in capsys.readouterr().out
