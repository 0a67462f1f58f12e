"""Smoke test of the benchmark suite: every ``benchmarks/bench_*.py`` runs at tiny sizes.

Benchmarks are not timed tests, but they must keep working as the code under them changes. Each
benchmark module found in ``benchmarks/`` is run with ``SHARDSTORE_BENCH_SMOKE=1`` (tiny sizes,
one repetition, at most 2 rank processes; the contract is in ``benchmarks/common.py``), and its
result is checked against the ``run()`` contract. The benchmarks themselves check that what they
load equals what they saved, so a wrong load fails here too. The suite's entry point is run once
to check the report it writes.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import common  # noqa: E402
from benchmarks.__main__ import discover, main  # noqa: E402

BENCHMARKS = discover()


@pytest.fixture(scope="module", autouse=True)
def smoke_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Tiny sizes for every benchmark, scratch data in a temp dir, rank workers stopped after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(common.SMOKE_ENV, "1")
        mp.setenv(common.DIR_ENV, str(tmp_path_factory.mktemp("bench")))
        yield
        common.shutdown_ranks()


def test_core_benchmarks_are_discovered() -> None:
    assert {"core", "index", "reshard"} <= set(BENCHMARKS)
    assert BENCHMARKS[0] == "core"


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_runs_at_smoke_size(name: str) -> None:
    module = importlib.import_module(f"benchmarks.bench_{name}")
    tables = common.check_results(module.run(True), source=f"bench_{name}")
    for table in tables:
        assert table["title"] and table["rows"]
        text = common.render(table)
        assert text.startswith(f"### {table['title']}")
        assert text.count("\n|") == len(table["rows"]) + 2  # header, separator, one line per row
        spec = table.get("plot")
        for s in spec if isinstance(spec, list) else ([spec] if spec else []):
            assert s["x"] in table["columns"], s
            assert set(s["y"]) <= set(table["columns"]), s
        for row in table.get("summary") or []:
            assert len(row) == 4, row


def test_suite_writes_report_and_plots(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "results"
    assert main(["--quick", "--only", "index", "--out", str(out)]) == 0
    report = (out / "REPORT.md").read_text()
    for heading in ("# shardstore benchmark report", "## Summary", "## Machine limits (same run)", "## bench_index"):
        assert heading in report
    assert "durable write (dd bs=4M conv=fdatasync)" in report
    assert "index 16 ranks x 10 tensors, build+parse" in report
    raw = json.loads((out / "results.json").read_text())
    assert raw["limits"]["disk_write"] > 0 and raw["limits"]["memcpy"] > 0
    assert raw["benchmarks"]["index"]["tables"][0]["rows"]
    png = out / "index-1.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![" in report and "index-1.png" in report


def test_suite_rejects_unknown_benchmark(tmp_path, capsys) -> None:
    assert main(["--only", "nosuch", "--out", str(tmp_path), "--no-plots"]) == 2
    assert "unknown benchmark(s) nosuch" in capsys.readouterr().err


def test_alternate_rotates_order_and_uses_reported_times() -> None:
    calls: list[str] = []
    times = common.alternate(
        {"a": lambda: calls.append("a") or 1.5, "b": lambda: calls.append("b")}, reps=3, warmup=1
    )
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert times["a"] == [1.5, 1.5, 1.5]
    assert len(times["b"]) == 3 and all(t >= 0 for t in times["b"])


def test_table_helpers() -> None:
    table = common.markdown_table(["case", "rate", "ratio"], [["x", "1.5 GB/s", "2.00x"], ["y", "12.25 GB/s", "0.50x"]])
    lines = table.splitlines()
    assert lines[0] == "| case |       rate | ratio |"
    assert lines[1] == "|------|-----------:|------:|"
    assert lines[3] == "| y    | 12.25 GB/s | 0.50x |"
    assert common.parse_number("512 MiB") == 512 * common.MiB
    assert common.parse_number("12.5 ms") == pytest.approx(0.0125)
    assert common.parse_number("-") is None
    with pytest.raises(ValueError, match="row 0 has 1 cells, expected 2"):
        common.check_results({"title": "t", "columns": ["a", "b"], "rows": [["x"]], "notes": []}, source="t")


def test_limits_and_cache_eviction(tmp_path) -> None:
    assert common.disk_write_limit(str(tmp_path), 4 * common.MiB) > 0
    assert common.read_limit(str(tmp_path), 4 * common.MiB, cold=True) > 0
    assert list(tmp_path.iterdir()) == []  # the dd scratch files are removed
    f = tmp_path / "x.bin"
    f.write_bytes(b"\1" * (1 << 20))
    common.evict(str(tmp_path))
    assert f.read_bytes() == b"\1" * (1 << 20)
