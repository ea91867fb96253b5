#!/usr/bin/env python3
"""Tears down the child networks of VMs recorded in test data dirs.

A test run killed mid-way (Ctrl-C, a CI timeout) leaves its children's
network namespaces and root-side links behind: they outlive the data dir,
which the next run deletes, and the network tests then see them as leaks.
For every `run/vms/*/vm.json` under the data dirs given, this deletes the
recorded namespace and, only while that namespace still existed, its host
link `fkh<slot>` and the link's `host_allow` elements (once poold tore a
namespace down, the slot may belong to another daemon's child). The same
rule as the test harness's teardown (tests/src/daemon.rs).

    scripts/reset-test-networks.py DATA_DIR...
"""
import glob
import json
import os
import subprocess
import sys


def run(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


def host_allow_elements(link):
    out = run("nft", "-j", "list", "set", "inet", "forkd", "host_allow")
    if out.returncode != 0:
        return []
    found = []
    for item in json.loads(out.stdout).get("nftables", []):
        for elem in item.get("set", {}).get("elem", []):
            concat = elem.get("concat") if isinstance(elem, dict) else None
            if concat and concat[0] == link:
                found.append(concat[1])
    return found


def addr(a):
    if isinstance(a, dict) and "prefix" in a:
        return f'{a["prefix"]["addr"]}/{a["prefix"]["len"]}'
    if isinstance(a, dict) and "range" in a:
        return f'{a["range"][0]}-{a["range"][1]}'
    return str(a)


def main(dirs):
    for d in dirs:
        for rec in glob.glob(os.path.join(d, "run", "vms", "*", "vm.json")):
            try:
                with open(rec) as f:
                    net = json.load(f).get("net") or {}
            except (OSError, ValueError):
                continue
            ns, slot = net.get("netns"), net.get("slot")
            if not ns or not os.path.exists(f"/run/netns/{ns}"):
                continue
            run("ip", "netns", "del", ns)
            if slot is None:
                continue
            link = f"fkh{slot}"
            run("ip", "link", "del", link)
            for a in host_allow_elements(link):
                run("nft", "delete", "element", "inet", "forkd", "host_allow",
                    "{", f'"{link}" . {addr(a)}', "}")
            print(f"removed the network of a killed run's VM: {ns} ({link})")


if __name__ == "__main__":
    main(sys.argv[1:])
