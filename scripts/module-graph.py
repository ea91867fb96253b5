#!/usr/bin/env python3
"""The module graph of Rust crates: which file imports which.

    scripts/module-graph.py poold/node/src poold/rest/src ...

For each crate source dir, every `crate::a::b` and `super::x` path in a file
(comments stripped) is an edge from that file to the file of the longest
module prefix it names. Prints, per crate, the strongly connected components
with more than one file (import circles), each file's layer (0: imports no
other file of the crate; n: imports only layers below n, a circle sharing
one layer), and exits 1 if a circle holds more than two files
(docs/design.md, "Crates": no import circle larger than two files; lower
modules never import higher ones).
"""

import os
import re
import sys


def modules(src):
    """Module path (tuple) -> file, for every .rs file under src."""
    out = {}
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(root, f), src)
            parts = rel[:-3].split(os.sep)
            if parts[-1] in ("lib", "main", "mod"):
                parts = parts[:-1]
            if parts and parts[0] == "bin":
                continue
            out[tuple(parts)] = os.path.join(root, f)
    return out


PATH = re.compile(r"\b(crate|self|super(?:::super)*)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
BARE = re.compile(r"(?<![:\w])([a-z_][a-z0-9_]*)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
INLINE = re.compile(r"\bmod\s+([a-z_][a-z0-9_]*)\s*\{")


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    return "\n".join(line.split("//", 1)[0] for line in text.splitlines())


def expand(tree):
    """`a::{b, c::{d, e}}` -> ["a::b", "a::c::d", "a::c::e"]."""
    tree = tree.strip()
    i = tree.find("{")
    if i < 0:
        return [tree.split(" as ")[0].strip()]
    prefix, inner = tree[:i], tree[i + 1 : tree.rindex("}")]
    parts, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    parts.append(cur)
    return [p for part in parts if part.strip() for p in expand(prefix + part.strip())]


USE = re.compile(r"\buse\s+([^;]+);")


def paths(text):
    """(inline module nesting, head, names) of every path in a file:
    `super` inside an inline `mod tests { .. }` first leaves that module."""
    # One `use` per line, whatever its layout.
    text = USE.sub(lambda m: "use " + " ".join(m.group(1).split()) + ";", text)
    out = []
    depth, inline = 0, []  # inline: (name, depth at which it opened)
    for line in text.splitlines():
        for m in INLINE.finditer(line):
            inline.append((m.group(1), depth))
        found = []
        for u in USE.findall(line):
            found += [p for p in expand(u) if "::" in p]
        rest_of_line = USE.sub("", line)
        found += [h + r for h, r in PATH.findall(rest_of_line)]
        found += [h + r for h, r in BARE.findall(rest_of_line)]
        for p in found:
            names = [n for n in p.split("::") if n and n != "*"]
            head = names[0]
            if head not in ("crate", "self") and not head.startswith("super"):
                names = ["self"] + names
                head = "self"
            ups = 0
            while names and names[0] == "super":
                ups += 1
                names = names[1:]
            if ups:
                head = "super" * ups
            elif names[0] in ("crate", "self"):
                names = names[1:]
            out.append((len(inline), head, tuple(names)))
        for ch in line:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                while inline and inline[-1][1] >= depth:
                    inline.pop()
    return out


def edges(src):
    mods = modules(src)
    out = {m: set() for m in mods}
    for m, f in mods.items():
        for nest, head, names in paths(strip_comments(open(f).read())):
            if head == "crate":
                base = ()
            else:
                ups = head.count("super") - nest
                if ups <= 0:
                    # Within this file (its own inline modules), or a
                    # child module named from this file.
                    base = m if head == "self" or ups == 0 else None
                    if base is None:
                        continue
                else:
                    base = m[: len(m) - ups] if len(m) >= ups else ()
            full = base + names
            if head != "crate" and full[: len(m) + 1] not in mods and full[:len(base)] == m:
                # A bare name that is no child module: a crate or item.
                if head == "self":
                    continue
            for i in range(len(full), -1, -1):
                if full[:i] in mods:
                    target = full[:i]
                    break
            if target != m and not (head == "self" and len(target) <= len(m)):
                out[m].add(target)
    return mods, out


def sccs(graph):
    """Tarjan's strongly connected components."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def name(m):
    return "::".join(m) if m else "(root)"


def main(dirs):
    bad = False
    for src in dirs:
        mods, graph = edges(src)
        comps = sccs(graph)
        comp_of = {v: i for i, c in enumerate(comps) for v in c}
        # Layers over the condensed graph (Tarjan emits sinks first).
        layer = {}
        for i, c in enumerate(comps):
            below = [
                layer[comp_of[w]]
                for v in c
                for w in graph[v]
                if comp_of[w] != i
            ]
            layer[i] = 1 + max(below) if below else 0
        n_edges = sum(len(v) for v in graph.values())
        circles = [sorted(c) for c in comps if len(c) > 1]
        print(f"{src}: {len(mods)} files, {n_edges} imports between them")
        for c in circles:
            flag = "" if len(c) <= 2 else "   <-- larger than two files"
            print(f"  circle of {len(c)}: {', '.join(name(m) for m in c)}{flag}")
            bad |= len(c) > 2
        if not circles:
            print("  no import circles")
        by_layer = {}
        for m in mods:
            by_layer.setdefault(layer[comp_of[m]], []).append(name(m))
        for lv in sorted(by_layer, reverse=True):
            print(f"  layer {lv}: {', '.join(sorted(by_layer[lv]))}")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1:]))
