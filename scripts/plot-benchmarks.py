#!/usr/bin/env python3
"""Plots for docs/BENCHMARKS.md, drawn from the benches' own JSON output.

    forkd bench spawn --tag py --json spawn.json
    scripts/plot-benchmarks.py --spawn spawn.json --out docs/img

writes spawn-sequential.svg (sequential single spawns by source),
spawn-fanout-latency.svg (latency vs N) and spawn-fanout-memory.svg
(memory per pooled child vs N). Needs matplotlib (Debian: python3-matplotlib,
or `pip install matplotlib` in a venv). Every figure drawn comes from the
report: nothing is typed in here.
"""

import argparse
import json
import os
import sys


def load(path):
    with open(path) as f:
        return json.load(f)


def subtitle(r):
    return f"{r['image']} ({r['tag']}), {r['accel'].upper()}, {r['host_cpus']} host CPUs, forkd {r['version']}"


def plot_sequential(plt, r, out):
    rows = [x for x in r["sequential"] if x.get("spawn_p50_ms") is not None]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = [x["source"] for x in rows]
    p50 = [x["spawn_p50_ms"] for x in rows]
    p99 = [x["spawn_p99_ms"] for x in rows]
    ys = range(len(rows))
    ax.barh([y + 0.2 for y in ys], p50, height=0.4, label="p50")
    ax.barh([y - 0.2 for y in ys], p99, height=0.4, label="p99")
    for y, v in zip(ys, p50):
        ax.text(v, y + 0.2, f" {v:.0f} ms" if v >= 10 else f" {v:.1f} ms", va="center", fontsize=8)
    ax.set_yticks(list(ys))
    ax.set_yticklabels(names)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("request → agent answered (ms, log scale)")
    ax.set_title("Sequential single spawns\n" + subtitle(r), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out, "spawn-sequential.svg")
    fig.savefig(path, metadata={"Date": None})
    return path


def plot_fanout_latency(plt, r, out):
    rows = r["fanout"]
    if not rows:
        return None
    n = [x["n"] for x in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(n, [x["wall_ms"] for x in rows], "o-", label="wall: all N answered the probe")
    ax.plot(n, [x["spawn_p50_ms"] for x in rows], "s--", label="per-child spawn p50")
    ax.plot(n, [x["spawn_p99_ms"] for x in rows], "^--", label="per-child spawn p99")
    ax.set_xlabel("N children in one request (full pool)")
    ax.set_ylabel("ms")
    ax.set_title("Fan-out latency vs N\n" + subtitle(r), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out, "spawn-fanout-latency.svg")
    fig.savefig(path, metadata={"Date": None})
    return path


def plot_fanout_memory(plt, r, out):
    rows = r["fanout"]
    if not rows:
        return None
    n = [x["n"] for x in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(n, [x["pooled_mib_per_child"] for x in rows], "o-", label="per child, with its share of the page cache")
    ax.plot(n, [x["pooled_private_mib_per_child"] for x in rows], "s--", label="per child, its own pages only")
    ax.set_xlabel("N paused children in the pool")
    ax.set_ylabel("MiB (PSS)")
    ax.set_ylim(bottom=0)
    ax.set_title("Host memory per pooled child vs N\n" + subtitle(r), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out, "spawn-fanout-memory.svg")
    fig.savefig(path, metadata={"Date": None})
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spawn", help="JSON of `forkd bench spawn --json`")
    ap.add_argument("--out", default="docs/img", help="directory for the SVGs (default docs/img)")
    a = ap.parse_args()
    if not a.spawn:
        ap.error("nothing to plot: give --spawn FILE")
    try:
        import matplotlib

        matplotlib.use("Agg")
        matplotlib.rcParams["svg.hashsalt"] = "forkd"  # stable SVG ids: diffs show real changes
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot-benchmarks.py needs matplotlib: apt install python3-matplotlib, or pip install matplotlib in a venv")
    os.makedirs(a.out, exist_ok=True)
    r = load(a.spawn)
    for f in (plot_sequential, plot_fanout_latency, plot_fanout_memory):
        p = f(plt, r, a.out)
        if p:
            print(p)


if __name__ == "__main__":
    main()
