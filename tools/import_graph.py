#!/usr/bin/env python3
"""The crate's import graph, file by file, from its `use` lines and `crate::`/`super::` paths.

    tools/import_graph.py            modules, arrows between them, and any circle
    tools/import_graph.py --check    exit 1 when two files (neither the other's parent) import
                                     each other, directly or round a loop

A child naming its parent module (`super::`) is not an arrow: a module and the files it is
made of are one unit. Tests, the simulator and the test drivers are left out: they may reach
anywhere.
"""
import re
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
LEFT_OUT = ("sim/", "bin/", "test_driver.rs", "test_host.rs", "fuzzing.rs", "defects.rs")


def module_dir(f: Path) -> Path:
    """The directory a file's `self::` children live in."""
    return f.parent if f.name in ("mod.rs", "lib.rs") else f.with_suffix("")


def resolve(start: Path, segments: list[str]) -> Path | None:
    """The file a path names: the deepest file or module its segments reach."""
    here, found = start, None
    for seg in segments:
        if (here / f"{seg}.rs").exists():
            found, here = here / f"{seg}.rs", here / seg
        elif (here / seg / "mod.rs").exists():
            found, here = here / seg / "mod.rs", here / seg
        else:
            break
    return found


def expand(tree: str) -> list[str]:
    """`a::{b, c::{d, e}}` -> `a::b`, `a::c::d`, `a::c::e`."""
    tree = tree.strip()
    m = re.match(r"^(.*?)\{(.*)\}$", tree, re.S)
    if not m:
        return [tree]
    prefix, inner = m.group(1), m.group(2)
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
    return [prefix + p for part in parts if part.strip() for p in expand(part.strip())]


def paths_of(text: str) -> list[str]:
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{.*", "", text, flags=re.S)
    out = []
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        out += [p.strip() for p in expand(m.group(1)) if p.strip().startswith(("crate::", "super::", "self::"))]
    out += re.findall(r"\b(?:crate|super)(?:::\w+)+", text)
    return out


def target(f: Path, path: str) -> Path | None:
    segs = [s for s in re.split(r"::", path.split(" as ")[0]) if s]
    base = module_dir(f)
    if segs[0] == "crate":
        return resolve(SRC, segs[1:]) or SRC / "lib.rs"
    if segs[0] == "self":
        return resolve(base, segs[1:])
    while segs and segs[0] == "super":
        segs = segs[1:]
        base = base.parent
    parent = base / "mod.rs" if (base / "mod.rs").exists() else SRC / "lib.rs" if base == SRC else base.with_suffix(".rs")
    return resolve(base, segs) or parent


def is_parent(p: Path, f: Path) -> bool:
    """Whether `p` is a module containing `f` (its mod.rs, or the file of its directory)."""
    d = p.parent if p.name in ("mod.rs", "lib.rs") else p.with_suffix("")
    return d in f.parents


def graph() -> dict[str, set[str]]:
    files = [f for f in SRC.rglob("*.rs") if not str(f.relative_to(SRC)).startswith(LEFT_OUT)]
    files = [f for f in files if not f.name.endswith("tests.rs") and f.name not in ("model.rs",)]
    g: dict[str, set[str]] = {}
    for f in files:
        name = str(f.relative_to(SRC))
        g.setdefault(name, set())
        for p in paths_of(f.read_text()):
            t = target(f, p)
            if t is None or t == f or not t.exists() or is_parent(t, f) or t.name == "lib.rs":
                continue
            tn = str(t.relative_to(SRC))
            if tn.startswith(LEFT_OUT) or tn.endswith("tests.rs"):
                continue
            g[name].add(tn)
    return g


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one file (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    g = graph()
    found = circles(g)
    if "--check" not in sys.argv:
        for name in sorted(g):
            print(f"{name} -> {', '.join(sorted(g[name])) or '(nothing)'}")
        arrows = sum(len(v) for v in g.values())
        print(f"\n{len(g)} files, {arrows} arrows, {len(found)} circles")
    for group in found:
        print("circle: " + " <-> ".join(group))
    return 1 if found and "--check" in sys.argv else 0


if __name__ == "__main__":
    sys.exit(main())
