#!/usr/bin/env python3
"""Plots for docs/BENCHMARKS.md, drawn from the benches' own JSON output.

    forkd bench spawn --tag py --json spawn.json
    forkd bench branch --json branch.json
    forkd hub bench --base py --head py-link --json hub-file.json
    forkd hub bench --base py --head py-link --hub serve --json hub-serve.json
    forkd hub bench --lazy py --json hub-lazy.json
    forkd hub bench --propagate py --json hub-propagate.json
    forkd bench gateway --tag gb --direct URL --gateway URL --json gw.json
    scripts/plot-benchmarks.py --spawn spawn.json --branch branch.json \
        --hub hub-file.json --hub hub-serve.json --out docs/img

--spawn writes spawn-sequential.svg (sequential single spawns by source),
spawn-fanout-latency.svg (latency vs N) and spawn-fanout-memory.svg (memory
per pooled child vs N). --branch writes branch-pause.svg (the source's pause
per branch: the busy source's live branches in order against its full
branch, and each chain link by depth) and branch-chain-depth.svg (spawn
latency and stored bytes per link vs chain depth). --hub (once per hub kind
run) writes hub-transfer-time.svg and hub-transfer-bytes.svg (each push and
pull step, full and incremental). --parking (once per run of the spawn
bench, with and without --page-out) writes spawn-parking.svg (RAM per pooled
child, resident and in compressed swap, next to the pool hit, the first
eval and the largest fan-out). --hub-lazy writes hub-lazy.svg (time to a
fresh host's first answer and the bytes fetched before it, lazy vs full
pull, per link, every run and the medians). --hub-propagate writes
hub-propagate.svg (from a push to every node's first answer, split into the
push until it published and what follows, with where the push ended, per
node count, every run and the medians).
--gateway (once per run of the gateway bench) writes gateway.svg (every
sample of a pool-hit spawn and an exec, direct to the node and through the
gateway, per run, with the medians and what the gateway added). Any subset
may be given.
Needs matplotlib (Debian: python3-matplotlib, or `pip install matplotlib` in
a venv). Every figure drawn comes from the reports: nothing is typed in here.
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
    return save(fig, out, "spawn-sequential.svg")


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
    return save(fig, out, "spawn-fanout-latency.svg")


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
    return save(fig, out, "spawn-fanout-memory.svg")


def parking_label(r):
    if not r.get("page_out"):
        return "resident"
    swap = (r.get("swap") or "swap").split(" over ")[0]
    kr = r.get("keep_resident")
    return f"page_out, {swap}" + (f",\nkeep_resident {kr}" if kr is not None else "")


def plot_parking(plt, rs, out):
    """Runs of one snapshot with and without page_out: RAM per pooled child
    at the largest N (resident + compressed swap), the sequential hand-out,
    and the fan-out of that N."""
    rows = [(parking_label(r), r["fanout"][-1], next((x for x in r["sequential"] if x["source"] == "pool hit"), None)) for r in rs if r["fanout"]]
    if not rows:
        return None
    fig, (mem, lat, fan) = plt.subplots(1, 3, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 2, 2]})
    ys = list(range(len(rows)))
    res = [f["pooled_mib_per_child"] for _, f, _ in rows]
    comp = [f.get("compressed_mib_per_child") or 0.0 for _, f, _ in rows]
    mem.barh(ys, res, label="resident (PSS, with its\npage-cache share)")
    mem.barh(ys, comp, left=res, label="in compressed swap")
    for y, a, b in zip(ys, res, comp):
        mem.text(a + b, y, f" {a + b:.1f}", va="center", fontsize=8)
    mem.set_yticks(ys)
    mem.set_yticklabels([l for l, _, _ in rows], fontsize=8)
    mem.invert_yaxis()
    mem.set_xlim(0, max(a + b for a, b in zip(res, comp)) * 1.2)
    mem.set_xlabel(f"RAM per pooled child, MiB (N = {rows[0][1]['n']})", fontsize=9)
    mem.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    hit = [(s["spawn_p50_ms"] if s else 0.0, s["first_eval_p50_ms"] if s else 0.0) for _, _, s in rows]
    lat.barh([y - 0.2 for y in ys], [h for h, _ in hit], height=0.4, label="pool hit p50")
    lat.barh([y + 0.2 for y in ys], [e for _, e in hit], height=0.4, label="first eval p50")
    lat.set_yticks(ys)
    lat.set_yticklabels([])
    lat.invert_yaxis()
    lat.set_xlabel("ms, sequential spawns from a full pool", fontsize=9)
    lat.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    walls = [f["wall_ms"] / 1e3 for _, f, _ in rows]
    fan.barh(ys, walls, color="tab:green")
    for y, w in zip(ys, walls):
        fan.text(w, y, f" {w:.1f}", va="center", fontsize=8)
    fan.set_yticks(ys)
    fan.set_yticklabels([])
    fan.invert_yaxis()
    fan.set_xlim(0, max(walls) * 1.2)
    fan.set_xlabel(f"s, request → all {rows[0][1]['n']} answered", fontsize=9)
    fig.suptitle("Parked children: resident or paged out\n" + subtitle(rs[0]), fontsize=9)
    return save(fig, out, "spawn-parking.svg")


MIB = 1 << 20


def branch_subtitle(r):
    return (
        f"{r['image']}, {r['mem_mib']} MiB, {r['accel'].upper()}, {r['host_cpus']} host CPUs, "
        f"QEMU {r['qemu']}, forkd {r['version']}"
    )


def plot_branch_pause(plt, r, out):
    busy = r["busy"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    live = [x["pause_ms"] for x in busy["live"]]
    left.plot(range(1, len(live) + 1), live, "o-", label="live branch (precopy)")
    full = busy["full"]["pause_ms"]
    left.axhline(full, color="C3", linestyle="--", label=f"full, stop-and-copy: {full:.0f} ms")
    left.axhline(busy["live_pause_p50_ms"], color="C0", linestyle=":", label=f"live p50: {busy['live_pause_p50_ms']:.1f} ms")
    left.set_yscale("log")
    left.set_xlabel("branch number (successive branches of one source)")
    left.set_ylabel("source paused (ms, log scale)")
    left.set_title(f"Busy source (rewrites {r['busy_mib']} MiB in a loop)", fontsize=9)
    left.grid(alpha=0.3, which="both")
    left.legend(fontsize=8)
    chain = r["chain"]
    if chain:
        right.plot([x["depth"] for x in chain], [x["branch"]["pause_ms"] for x in chain], "s-", color="C2")
        right.set_ylim(bottom=0)
    right.set_xlabel("chain depth of the link made")
    right.set_ylabel("source paused (ms)")
    right.set_title("Chain links (a child that wrote one file)", fontsize=9)
    right.grid(alpha=0.3)
    fig.suptitle("BRANCH: how long the source sandbox is paused\n" + branch_subtitle(r), fontsize=9)
    return save(fig, out, "branch-pause.svg")


def plot_branch_depth(plt, r, out):
    depths = r["depths"]
    if not depths:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    for i, d in enumerate(depths):
        ys = [s["ready_ms"] for s in d["spawns"]]
        left.plot([d["depth"]] * len(ys), ys, "o", color="C0", alpha=0.35, label="each spawn" if i == 0 else None)
    xs = [d["depth"] for d in depths]
    left.plot(xs, [d["ready_p50_ms"] for d in depths], "s-", color="C0", label="spawn p50 (agent answered)")
    restored = [sorted(s["restored_ms"] for s in d["spawns"]) for d in depths]
    left.plot(xs, [v[(len(v) - 1) // 2] for v in restored], "^--", color="C1", label="of which state loaded, p50")
    left.set_ylim(bottom=0)
    left.set_xlabel("chain depth of the head spawned from")
    left.set_ylabel("ms from the start of the restore")
    left.set_title(f"Spawn latency vs depth ({len(depths[0]['spawns'])} spawns each)", fontsize=9)
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    xs = [d["depth"] for d in depths]
    ys = [d["link_stored_bytes"] / MIB for d in depths]
    bars = right.bar(xs, ys, color=["C7" if x == 0 else "C2" for x in xs], label="unique vs its parent (the printed table)")
    for b, y in zip(bars, ys):
        right.text(b.get_x() + b.get_width() / 2, y, f"{y:.1f}", ha="center", va="bottom", fontsize=7)
    chain = r["chain"]
    if chain:
        new = [x["branch"]["new_stored_bytes"] / MIB for x in chain]
        right.plot([x["depth"] for x in chain], new, "D", color="C4", markersize=4, label="new to the store when branched")
        ys = ys + new
    right.axhline(r["mem_mib"], color="C3", linestyle="--", label=f"one full memory image ({r['mem_mib']} MiB)")
    right.set_yscale("log")
    right.set_ylim(bottom=min(ys) / 2)
    right.set_xlabel("chain depth (0 = the base snapshot)")
    right.set_ylabel("stored, compressed (MiB, log scale)")
    right.set_title("What each link adds to the store", fontsize=9)
    right.grid(alpha=0.3, axis="y", which="both")
    right.legend(fontsize=8)
    fig.suptitle("Chains of live branches\n" + branch_subtitle(r), fontsize=9)
    return save(fig, out, "branch-chain-depth.svg")


HUB_NAMES = {"file": "file://", "serve": "forkd hub serve (127.0.0.1)", "http": "HTTP hub", "s3": "S3"}


def hub_subtitle(rs):
    r = rs[0]
    return f"base {r['base']} → head {r['head']}, {r['host_cpus']} host CPUs, forkd {r['version']}"


def plot_hub_time(plt, rs, out):
    steps = [s["name"] for s in rs[0]["steps"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    h = 0.8 / len(rs)
    for i, r in enumerate(rs):
        secs = {s["name"]: s["seconds"] for s in r["steps"]}
        ys = [y - 0.4 + h * (i + 0.5) for y in range(len(steps))]
        vals = [secs.get(n, 0) for n in steps]
        ax.barh(ys, vals, height=h, label=f"{HUB_NAMES.get(r['hub_kind'], r['hub_kind'])}, {r['jobs']} jobs")
        for y, v in zip(ys, vals):
            ax.text(v, y, f" {v:.2f} s", va="center", fontsize=7)
    ax.set_yticks(list(range(len(steps))))
    ax.set_yticklabels(steps, fontsize=8)
    ax.invert_yaxis()
    ax.margins(x=0.12)
    ax.set_xlabel("wall time (s)")
    ax.set_title("Hub push and pull time, full vs incremental\n" + hub_subtitle(rs), fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8)
    return save(fig, out, "hub-transfer-time.svg")


def plot_hub_bytes(plt, rs, out):
    r = rs[0]
    steps = r["steps"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ys = range(len(steps))
    stored = [s["stored_bytes"] / MIB for s in steps]
    wire = [s["wire_bytes"] / MIB for s in steps]
    raw = [s["raw_bytes"] / MIB for s in steps]
    ax.barh([y - 0.27 for y in ys], stored, height=0.27, label="chunks moved, stored (compressed)")
    ax.barh(list(ys), wire, height=0.27, label="on the wire (chunks + manifests + records)")
    ax.barh([y + 0.27 for y in ys], raw, height=0.27, label="chunks moved, uncompressed")
    for y, v, s in zip(ys, stored, steps):
        ax.text(v, y - 0.27, f" {v:.1f} MiB, {s['chunks']} chunks", va="center", fontsize=7)
    u = r["unique_stored_bytes"] / MIB
    ax.axvline(u, color="C3", linestyle="--", label=f"head's unique chunks (Store::diff): {u:.1f} MiB")
    ax.set_yticks(list(ys))
    ax.set_yticklabels([s["name"] for s in steps], fontsize=8)
    ax.invert_yaxis()
    ax.margins(x=0.25)
    ax.set_xlabel("MiB")
    moved = lambda x: [(s["name"], s["chunks"], s["stored_bytes"]) for s in x["steps"]]
    kinds = [HUB_NAMES.get(x["hub_kind"], x["hub_kind"]) for x in rs]
    if all(moved(x) == moved(r) for x in rs):
        which = "the same chunks for " + ", ".join(kinds)
    else:
        which = f"{kinds[0]} run; the other hubs moved different chunks"
    ax.set_title(f"Hub: bytes moved per step ({which})\n" + hub_subtitle(rs), fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=7, loc="lower right")
    return save(fig, out, "hub-transfer-bytes.svg")


def plot_hub_lazy(plt, r, out):
    """First answer on a fresh host and bytes fetched before it: lazy vs full, per link."""
    rows = [(s["link"], s["mode"]) for s in r["summary"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ys = list(range(len(rows)))
    labels = [f"{link}, {mode}" for link, mode in rows]
    med = {(s["link"], s["mode"]): s for s in r["summary"]}
    for y, key in zip(ys, rows):
        pts = [x for x in r["runs"] if (x["link"], x["mode"]) == key]
        ax1.scatter([p["first_answer_s"] for p in pts], [y] * len(pts), color="0.5", s=12, zorder=3)
        ax2.scatter([p["bytes_before_answer"] / MIB for p in pts], [y] * len(pts), color="0.5", s=12, zorder=3)
    secs = [med[k]["first_answer_s"] for k in rows]
    mb = [med[k]["bytes_before_answer"] / MIB for k in rows]
    colors = ["C0" if m == "lazy" else "C1" for _, m in rows]
    ax1.barh(ys, secs, color=colors, alpha=0.8)
    for y, v in zip(ys, secs):
        ax1.text(v, y, f" {v:.2f} s", va="center", fontsize=7)
    ax2.barh(ys, mb, color=colors, alpha=0.8)
    stored = r["stored_bytes"] / MIB
    for y, v in zip(ys, mb):
        ax2.text(v, y, f" {v:.1f} MiB ({100 * v / stored:.0f}%)", va="center", fontsize=7)
    ax2.axvline(stored, color="C3", linestyle="--", label=f"snapshot stored: {stored:.1f} MiB")
    ax2.axvline(stored / 4, color="C2", linestyle=":", label="25% of it")
    for ax in (ax1, ax2):
        ax.set_yticks(ys)
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.margins(x=0.3)
        ax.grid(alpha=0.3, axis="x")
    ax1.set_xlabel("pull + first child's answer (s); dots: runs, bars: medians")
    ax2.set_xlabel("bytes fetched from the hub before the answer (MiB)")
    ax2.legend(fontsize=7, loc="lower right")
    fig.suptitle(
        f"A host that never saw {r['tag']}: lazy vs full pull over S3 (s3s-fs); shaped = "
        f"{r['rate_mbit']} Mbit/s + {r['rtt_ms']} ms RTT\npush: {r['push']['requests']} requests, "
        f"{r['push']['packs']} packs; {r['host_cpus']} host CPUs, forkd {r['version']}",
        fontsize=9,
    )
    return save(fig, out, "hub-lazy.svg")


def plot_hub_propagate(plt, r, out):
    """From a push to a child answering on each of N nodes: until the snapshot is published, then the rest."""
    rows = r["summary"]
    fig, ax = plt.subplots(figsize=(8, 4.0))
    ys = list(range(len(rows)))
    # Reports from before pushes published early have no published_s: the push's end.
    published = [s.get("published_s") or s["push_s"] for s in rows]
    after = [s["all_nodes_s"] - p for s, p in zip(rows, published)]
    ax.barh(ys, published, color="C1", alpha=0.8, label="push until the snapshot is published")
    ax.barh(ys, after, left=published, color="C0", alpha=0.8, label="every node's lazy pull and first answer")
    for y, s in zip(ys, rows):
        if s.get("published_s") and s["push_s"] > s["published_s"]:
            ax.plot([s["published_s"], s["push_s"]], [y + 0.3] * 2, color="C1", lw=2)
            ax.text(s["push_s"], y + 0.3, "  push ends", va="center", fontsize=6, color="C1")
    for y, s in zip(ys, rows):
        pts = [x["all_nodes_s"] for x in r["runs"] if x["nodes"] == s["nodes"]]
        ax.scatter(pts, [y] * len(pts), color="0.3", s=12, zorder=3)
        ax.text(max(pts + [s["all_nodes_s"]]), y, f"  {s['all_nodes_s']:.2f} s, {s['bytes_to_nodes'] / MIB:.0f} MiB to the nodes", va="center", fontsize=7)
    ax.set_yticks(ys)
    ax.set_yticklabels([f"{s['nodes']} node{'s' if s['nodes'] > 1 else ''}" for s in rows], fontsize=8)
    ax.invert_yaxis()
    ax.margins(x=0.45)
    ax.grid(alpha=0.3, axis="x")
    ax.set_xlabel("from before the push until the last node's child answered (s); dots: runs, bars: medians")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    ax.set_title(
        f"{r['tag']} ({r['stored_bytes'] / MIB:.0f} MiB stored) to N nodes through S3 (s3s-fs); every link "
        f"{r['rate_mbit']} Mbit/s + {r['rtt_ms']} ms RTT\nnodes pull lazily at once; {r['host_cpus']} host CPUs "
        f"shared by all nodes, forkd {r['version']}",
        fontsize=9,
    )
    return save(fig, out, "hub-propagate.svg")


def plot_gateway(plt, rs, out):
    """Every sample direct and through the gateway, per call and run, with the medians."""
    calls = [row["call"] for row in rs[0]["rows"]]
    fig, axes = plt.subplots(1, len(calls), figsize=(10, 1.2 + 0.9 * len(rs)), squeeze=False)
    for ax, call in zip(axes[0], calls):
        labels = []
        for i, r in enumerate(rs):
            row = next(x for x in r["rows"] if x["call"] == call)
            for j, (path, key, color) in enumerate([("direct", "direct_ms", "C0"), ("gateway", "gateway_ms", "C1")]):
                y = 2 * i + j
                ax.scatter(row[key], [y] * len(row[key]), s=8, alpha=0.5, color=color)
                med = row[f"{path}_p50_ms"]
                ax.plot([med, med], [y - 0.35, y + 0.35], color="k", linewidth=1.5)
                labels.append(f"run {i + 1}, {path}")
            ax.text(
                max(row["direct_ms"] + row["gateway_ms"]), 2 * i + 0.5,
                f" added p50 {row['added_p50_ms']:+.2f} ms", va="center", fontsize=7,
            )
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        ax.margins(x=0.35)
        ax.grid(alpha=0.3, axis="x")
        ax.set_xlabel(f"{call} (ms, client wall clock); bars: medians")
    fig.suptitle(
        f"The cluster gateway's extra hop: {len(rs)} run(s) of n = {rs[0]['rows'][0]['samples']}, "
        f"tag {rs[0]['tag']}, interleaved; {rs[0]['host_cpus']} host CPUs, forkd {rs[0]['version']}",
        fontsize=9,
    )
    return save(fig, out, "gateway.svg")


def save(fig, out, name):
    """Writes `fig` as `out`/`name` (no date in it, so a redraw diffs only
    on real changes); returns the path."""
    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, metadata={"Date": None})
    return path


def check(r, bench, path):
    """Refuses a report of another bench or of a layout this script does not know."""
    if r.get("bench") != bench or r.get("schema") != 1:
        sys.exit(f"{path}: not a schema-1 report of `{bench}` (bench={r.get('bench')!r}, schema={r.get('schema')!r})")
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spawn", help="JSON of `forkd bench spawn --json`")
    ap.add_argument("--parking", action="append", default=[], help="JSON of `forkd bench spawn --json`, with and without --page-out; once per run")
    ap.add_argument("--branch", help="JSON of `forkd bench branch --json`")
    ap.add_argument("--hub", action="append", default=[], help="JSON of `forkd hub bench --json`; once per hub kind")
    ap.add_argument("--hub-lazy", help="JSON of `forkd hub bench --lazy TAG --json`")
    ap.add_argument("--hub-propagate", help="JSON of `forkd hub bench --propagate TAG --json`")
    ap.add_argument("--gateway", action="append", default=[], help="JSON of `forkd bench gateway --json`; once per run")
    ap.add_argument("--out", default="docs/img", help="directory for the SVGs (default docs/img)")
    a = ap.parse_args()
    if not (a.spawn or a.branch or a.hub or a.parking or a.hub_lazy or a.hub_propagate or a.gateway):
        ap.error("nothing to plot: give --spawn, --parking, --branch, --hub, --hub-lazy, --hub-propagate and/or --gateway FILE")
    gateway = [check(load(p), "gateway", p) for p in a.gateway]
    hub_lazy = check(load(a.hub_lazy), "hub-lazy", a.hub_lazy) if a.hub_lazy else None
    hub_propagate = check(load(a.hub_propagate), "hub-propagate", a.hub_propagate) if a.hub_propagate else None
    parking = [load(p) for p in a.parking]
    spawn = load(a.spawn) if a.spawn else None
    branch = check(load(a.branch), "branch", a.branch) if a.branch else None
    hubs = [check(load(p), "hub", p) for p in a.hub]
    if len({(h["base_id"], h["head_id"]) for h in hubs}) > 1:
        sys.exit("--hub reports of different snapshot pairs: give runs of one --base/--head")
    try:
        import matplotlib

        matplotlib.use("Agg")
        matplotlib.rcParams["svg.hashsalt"] = "forkd"  # stable SVG ids: diffs show real changes
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot-benchmarks.py needs matplotlib: apt install python3-matplotlib, or pip install matplotlib in a venv")
    os.makedirs(a.out, exist_ok=True)
    jobs = []
    if spawn:
        jobs += [(f, spawn) for f in (plot_sequential, plot_fanout_latency, plot_fanout_memory)]
    if parking:
        jobs.append((plot_parking, parking))
    if branch:
        jobs += [(f, branch) for f in (plot_branch_pause, plot_branch_depth)]
    if hubs:
        jobs += [(f, hubs) for f in (plot_hub_time, plot_hub_bytes)]
    if hub_lazy:
        jobs.append((plot_hub_lazy, hub_lazy))
    if hub_propagate:
        jobs.append((plot_hub_propagate, hub_propagate))
    if gateway:
        jobs.append((plot_gateway, gateway))
    for f, r in jobs:
        p = f(plt, r, a.out)
        if p:
            print(p)


if __name__ == "__main__":
    main()
