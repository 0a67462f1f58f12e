"""The benchmark suite: run every ``benchmarks/bench_*.py`` and write one report with plots.

``python -m benchmarks [--quick] [--only core,index] [--out results/]`` measures the machine's
limits first (durable disk write with ``dd ... conv=fdatasync``, cold and warm read, memcpy), so
every number in the report can be read against the ceiling it runs into, then calls each
benchmark module's ``run(quick)`` (the contract is in ``benchmarks/common.py``), and writes
``<out>/REPORT.md`` (summary table, limits, every table with its notes), ``<out>/results.json``
(the raw tables) and a PNG per plotted table. A module that fails is reported with its
traceback and the suite goes on; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import logging
import os
import pkgutil
import platform
import shlex
import sys
import time
import traceback
from typing import Any

from benchmarks import common
from benchmarks.common import (
    MiB,
    bench_dir,
    check_results,
    cpu_probe,
    fmt_bw,
    fmt_seconds,
    machine_limits,
    markdown_table,
    parse_number,
    render,
    shutdown_ranks,
    sized,
)

logger = logging.getLogger("benchmarks")

SUMMARY_COLUMNS = ["scenario", "shardstore", "baseline", "ratio (>1: shardstore ahead)"]


def discover() -> list[str]:
    """Names of the benchmark modules (``bench_<name>`` -> ``<name>``), sorted, core first."""
    import benchmarks

    names = sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules(benchmarks.__path__) if m.name.startswith("bench_"))
    return sorted(names, key=lambda n: (n != "core", n))


def _machine() -> list[list[str]]:
    import torch

    try:
        from importlib.metadata import version

        ss_version = version("shardstore")
    except Exception as e:  # not installed: report why instead of a version
        ss_version = f"unknown ({type(e).__name__})"
    mem = "?"
    try:
        with open("/proc/meminfo") as f:
            mem = f"{int(f.readline().split()[1]) / (1 << 20):.1f} GiB"
    except OSError as e:
        mem = f"unknown ({e.strerror})"
    return [
        ["CPU cores", str(os.cpu_count())],
        ["memory", mem],
        ["kernel", platform.release()],
        ["python", platform.python_version()],
        ["torch", torch.__version__],
        ["shardstore", ss_version],
        ["scratch dir", os.environ.get(common.DIR_ENV) or "system temp dir"],
        ["load average at start", " ".join(f"{x:.2f}" for x in os.getloadavg())],
    ]


def _plot(table: dict[str, Any], spec: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    cols = table["columns"]
    xi = cols.index(spec["x"])
    labels = [str(r[xi]) for r in table["rows"]]
    series = []
    for name in spec["y"]:
        yi = cols.index(name)
        series.append((name, [parse_number(r[yi]) for r in table["rows"]]))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if spec.get("logx"):
        ax.set_xscale("log")
    if spec.get("logy"):
        ax.set_yscale("log")
    if spec.get("kind", "bar") == "line":
        xs = [parse_number(v) for v in labels]
        numeric_x = all(v is not None for v in xs)
        for name, ys in series:
            pts = [(x if numeric_x else i, y) for i, (x, y) in enumerate(zip(xs, ys)) if y is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        if numeric_x:
            ax.set_xticks(xs, labels)
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        else:
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels)
    else:
        width = 0.8 / max(1, len(series))
        for k, (name, ys) in enumerate(series):
            xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
            ax.bar(xs, [y if y is not None else 0 for y in ys], width, label=name)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=15 if max(len(l) for l in labels) > 10 else 0)
    ax.set_xlabel(spec["x"])
    ax.set_ylabel(spec.get("ylabel", ""))
    ax.set_title(table["title"], fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _specs(table: dict[str, Any]) -> list[dict[str, Any]]:
    spec = table.get("plot")
    if spec is None:
        return []
    return spec if isinstance(spec, list) else [spec]


def main(argv: list[str] | None = None) -> int:
    """Run the suite; return the exit status (0 all ran, 1 a benchmark failed, 2 bad usage)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions")
    parser.add_argument("--only", default="", help="comma-separated benchmark names (e.g. core,index)")
    parser.add_argument("--out", default="results", help="folder for REPORT.md, results.json and plots")
    parser.add_argument("--no-plots", action="store_true", help="do not draw PNG plots (no matplotlib needed)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    names = discover()
    if args.only:
        wanted = [n.strip().removeprefix("bench_") for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            print(f"error: unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(names)}", file=sys.stderr)
            return 2
        names = [n for n in names if n in wanted]
    if not args.no_plots:
        try:
            import matplotlib

            logger.debug("plots with matplotlib %s", matplotlib.__version__)
        except ImportError:
            print("error: plots need matplotlib (pip install 'shardstore[bench]'), or pass --no-plots", file=sys.stderr)
            return 2
    os.makedirs(args.out, exist_ok=True)
    command = "python -m benchmarks " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    started = time.perf_counter()
    machine = _machine()

    print("measuring machine limits ...", file=sys.stderr)
    limit_size = sized(args.quick, full=1024 * MiB, quick_size=256 * MiB, smoke=16 * MiB)
    with bench_dir("limits") as d:
        limits = machine_limits(d, limit_size)
    limits["cpu_probe_s"] = cpu_probe()
    limit_rows = [
        ["durable write (dd bs=4M conv=fdatasync)", fmt_bw(limits["disk_write"])],
        ["read, cold page cache (dd)", fmt_bw(limits["read_cold"])],
        ["read, warm page cache (dd)", fmt_bw(limits["read_warm"])],
        ["memcpy (torch copy_, 1 thread per core)", fmt_bw(limits["memcpy"])],
        ["CPU probe: sum(range(10**7)) (idle core ~0.2 s; more = shared CPUs)", fmt_seconds(limits["cpu_probe_s"])],
    ]

    sections: list[str] = []
    summary: list[list[Any]] = []
    raw: dict[str, Any] = {"command": command, "limits": limits, "benchmarks": {}}
    failed: list[str] = []
    try:
        for name in names:
            print(f"running bench_{name} ...", file=sys.stderr)
            t0 = time.perf_counter()
            try:
                module = importlib.import_module(f"benchmarks.bench_{name}")
                tables = check_results(module.run(args.quick), source=f"bench_{name}")
            except Exception:
                failed.append(name)
                tb = traceback.format_exc()
                print(tb, file=sys.stderr)
                sections.append(f"## bench_{name}: FAILED\n\n```\n{tb}```\n")
                raw["benchmarks"][name] = {"error": tb}
                continue
            seconds = time.perf_counter() - t0
            parts = [f"## bench_{name} ({fmt_seconds(seconds)})\n"]
            for i, table in enumerate(tables):
                parts.append(render(table))
                if not args.no_plots:
                    for j, spec in enumerate(_specs(table)):
                        png = f"{name}-{i + 1}{'' if j == 0 else f'-{j + 1}'}.png"
                        _plot(table, spec, os.path.join(args.out, png))
                        parts.append(f"![{table['title']}]({png})\n")
                summary.extend(table.get("summary") or [])
            sections.append("\n".join(parts))
            raw["benchmarks"][name] = {
                "seconds": seconds,
                "tables": [{k: v for k, v in t.items() if not k.startswith("_")} for t in tables],
            }
            print(render(tables[0]) if len(tables) == 1 else "\n".join(render(t) for t in tables))
    finally:
        shutdown_ranks()

    total = time.perf_counter() - started
    machine.append(["load average at end", " ".join(f"{x:.2f}" for x in os.getloadavg())])
    now = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    report = [
        "# shardstore benchmark report",
        "",
        f"Generated {now} by `{command}` in {fmt_seconds(total)}"
        + (" (quick mode)" if args.quick else "")
        + (" (smoke sizes: SHARDSTORE_BENCH_SMOKE is set)" if common.is_smoke() else "")
        + ".",
        "",
        "Every comparison is measured in the same run, the cases alternated and the median quoted; on a "
        "shared machine the ratios are what counts, not the absolute rates.",
        "",
        "## Summary",
        "",
        markdown_table(SUMMARY_COLUMNS, summary) if summary else "(no benchmark reported a summary row)",
        "",
        "## Machine",
        "",
        markdown_table(["", ""], machine),
        "",
        "## Machine limits (same run)",
        "",
        markdown_table(["limit", "measured"], limit_rows),
        "",
    ]
    if failed:
        report += [f"**Failed:** {', '.join('bench_' + n for n in failed)} (tracebacks below).", ""]
    report += sections
    path = os.path.join(args.out, "REPORT.md")
    with open(path, "w") as f:
        f.write("\n".join(report).rstrip() + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(raw, f, indent=1, default=str)
    print(f"wrote {path} ({fmt_seconds(total)})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
