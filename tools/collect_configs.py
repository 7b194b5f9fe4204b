#!/usr/bin/env python3
"""Collects every plugin configuration the project has shipped or documented, from git history.

For each commit of `main`, oldest first, reads README.md, docs/**/*.md, envoy/**, tests/**/*.py,
bench/** (and examples/, deploy/, istio/ if any) and takes out what the Wasm filter gets as its
`configuration`: JSON in Markdown, the StringValue `value:` in Envoy YAML, Istio `pluginConfig:`,
dict literals and JSON strings in Python. Kept: objects whose keys are all top-level plugin
fields (matched by any version of src/config.rs), and `{}`. Writes one file per distinct
configuration to tests/config_corpus/ plus its INDEX.md; prints a summary and what it skipped.
Append-only: existing corpus files keep their name and number and are never deleted.

    python3 tools/collect_configs.py [--ref main]      (stdlib; uses PyYAML if importable)
"""
import ast, json, operator, os, re, subprocess, sys
from collections import Counter, defaultdict

try:
    import yaml  # for Istio's pluginConfig and YAML in Markdown; JSON in `value: |` needs none
except ImportError:
    yaml = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "config_corpus")
SOURCES = re.compile(r"^(README\.md|docs/.*\.md|(envoy|examples|deploy|istio)/.*\.(ya?ml|json|md)"
                     r"|(tests|examples|deploy|istio)/.*\.py|bench/.*\.(ya?ml|py|json))$")
notes = []  # (path, reason, snippet): what the file being read had but could not give


def git(*args):
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=True).stdout


def known_fields(commits):
    """Top-level names of every version of src/config.rs: the `"x" =>` arms directly under
    `match f {` (Config::parse) and `match name {` (Policy::set: base-policy fields are top-level
    too). Fields only ever grow in this union, so an old configuration stays recognised."""
    fields, seen = set(), set()
    for c in commits:
        blob = git("ls-tree", c, "src/config.rs").split()
        if not blob or blob[2] in seen:
            continue
        seen.add(blob[2])
        arm = None
        for line in git("show", f"{c}:src/config.rs").splitlines():
            indent, m = len(line) - len(line.lstrip()), re.match(r"^(\s*)match (f|name) \{$", line)
            if m:
                arm = len(m.group(1)) + 4  # values of nested matches ("reject" =>) are deeper
            elif arm is not None and line.strip().startswith("}") and indent < arm:
                arm = None
            elif arm is not None and indent == arm:
                fields.update(re.findall(r'^\s*"([a-z_]+)"\s*=>', line))
    return fields


def is_config(obj, fields):
    return isinstance(obj, dict) and all(isinstance(k, str) for k in obj) and set(obj) <= fields


def json_objects(text):
    """Every outermost non-empty JSON object in free text (fenced, inline, console lines)."""
    dec, i = json.JSONDecoder(), text.find("{")
    while i >= 0:
        try:
            obj, end = dec.raw_decode(text, i)
            if obj:  # a bare `{}` in prose is YAML's `grpc_health_check: {}`, not a config
                yield obj
            i = text.find("{", end)  # skip what it contains: inner objects are parts, not configs
        except ValueError:
            i = text.find("{", i + 1)


def string_values(text, path):
    """The JSON of Envoy's StringValue: the indented block after `value: |`, or a quoted one."""
    lines = text.splitlines()
    for n, line in enumerate(lines):
        m = re.match(r"^(\s*)value:\s*(\|[-+]?|'(.*)'|(\".*\"))\s*$", line)
        if not m:
            continue
        block = []
        for nxt in lines[n + 1:] if m.group(2).startswith("|") else []:
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= len(m.group(1)):
                break
            block.append(nxt)
        raw = "\n".join(block) if block else m.group(3) or m.group(4) or ""
        try:
            if not block:  # YAML quoting: '' is a quote in '...'; "..." escapes like JSON
                raw = raw.replace("''", "'") if m.group(3) is not None else json.loads(raw)
            yield json.loads(raw)
        except ValueError:
            if raw.lstrip().startswith("{"):
                notes.append((path, "StringValue text is not JSON", " ".join(raw.split())[:60]))


def yaml_configs(text, path):
    """Istio `pluginConfig:` mappings, and YAML documents that are themselves a config."""
    if yaml is None:
        if "pluginConfig:" in text:
            notes.append((path, "pluginConfig skipped: PyYAML not importable", ""))
        return
    try:
        stack = list(yaml.safe_load_all(text))
    except yaml.YAMLError:
        return  # a fragment: string_values() still reads its `value: |`
    yield from (d for d in stack if isinstance(d, dict) and d)  # e.g. docs' `scope_headers: []`
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pluginConfig"), dict):
                yield node["pluginConfig"]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.LShift: operator.lshift,
       ast.Mod: operator.mod, ast.FloorDiv: operator.floordiv, ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate(node, consts):
    """ast.literal_eval, plus constant arithmetic (64 << 20), module-level constants and f-strings
    over them: all fixed values. A value bound at run time (test parameters, fixtures, ports,
    `**spread`) raises ValueError: that template has no one value to record."""
    if isinstance(node, ast.Constant) and not isinstance(node.value, bytes):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [evaluate(e, consts) for e in node.elts]
    if isinstance(node, ast.Dict):
        if None in node.keys:
            raise ValueError("`**` spread of a runtime dict")
        return {evaluate(k, consts): evaluate(v, consts) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.Name) and node.id in consts:
        return consts[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](evaluate(node.left, consts), evaluate(node.right, consts))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
        return OPS[type(node.op)](evaluate(node.operand, consts))
    if isinstance(node, ast.JoinedStr):
        return "".join(str(evaluate(v.value if isinstance(v, ast.FormattedValue) else v, consts))
                       for v in node.values)
    raise ValueError(f"runtime value `{ast.unparse(node)[:40]}`")


def config_context(parent):
    """Where `{}` is a configuration: make_envoy({}, ...), fleet_config({}), plugin_config = {}."""
    if isinstance(parent, ast.Call):
        return any(w in ast.unparse(parent.func).lower() for w in ("envoy", "config"))
    names = [ast.unparse(t) for t in getattr(parent, "targets", [])] + [getattr(parent, "arg", None) or ""]
    return isinstance(parent, (ast.Assign, ast.keyword)) and any("config" in n.lower() for n in names)


def python_configs(text, path, fields):
    try:
        tree = ast.parse(text)
    except SyntaxError:
        notes.append((path, "Python does not parse", ""))
        return
    consts = {}  # NAME = <fixed value> at module level, e.g. LEASE_MS = 3000, MIB = 1 << 20
    for st in tree.body:
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            try:
                consts[st.targets[0].id] = evaluate(st.value, consts)
            except (ValueError, TypeError, ArithmeticError):
                pass

    def visit(node, parent):
        if isinstance(node, ast.Dict):
            if not node.keys:
                if config_context(parent):  # elsewhere `{}` is headers, kwargs, counters...
                    yield {}
                return
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            if keys and all(isinstance(k, str) for k in keys) and set(keys) <= fields:
                try:
                    yield evaluate(node, consts)
                except (ValueError, TypeError, ArithmeticError) as e:
                    notes.append((path, f"template, {e}", ast.unparse(node)[:70]))
                return  # its inner dicts (store, rules) are parts, not configs
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.lstrip().startswith("{"):
                yield from json_objects(node.value)
            if "value:" in node.value:  # Envoy YAML kept in a Python string
                yield from string_values(node.value, path)
        for child in ast.iter_child_nodes(node):
            yield from visit(child, node)

    yield from visit(tree, None)


def extract(path, text, fields):
    if path.endswith(".py"):
        yield from python_configs(text, path, fields)
        return
    yield from json_objects(text) if path.endswith((".md", ".json")) else ()
    if path.endswith(".md"):
        for lang, body in re.findall(r"^ *```(\w*)\n(.*?)^ *```", text, re.S | re.M):
            if lang in ("yaml", "yml", ""):
                yield from string_values(body, path)
            if lang in ("yaml", "yml"):
                yield from yaml_configs(body, path)
    else:
        yield from string_values(text, path)
        yield from yaml_configs(text, path)


def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def main():
    ref = sys.argv[sys.argv.index("--ref") + 1] if "--ref" in sys.argv else "main"
    # The commits of `git rev-list --reverse <ref>`, in that order, with short hash and date.
    commits = [line.split() for line in git("log", "--reverse", "--format=%H %h %as", ref).splitlines()]
    fields = known_fields([c[0] for c in commits])
    first, seen_in, paths, cache, skipped = {}, defaultdict(set), defaultdict(set), {}, Counter()
    for full, short, date in commits:
        for entry in git("ls-tree", "-r", full).splitlines():
            meta, path = entry.split("\t", 1)
            if not SOURCES.match(path):
                continue
            blob = meta.split()[2]
            if blob not in cache:  # most files are unchanged from one commit to the next
                notes.clear()
                text = git("show", f"{full}:{path}")
                cache[blob] = ([o for o in extract(path, text, fields) if is_config(o, fields)], set(notes))
            skipped.update(cache[blob][1])  # counted per commit, like the configurations
            for obj in cache[blob][0]:
                norm = canonical(obj)
                first.setdefault(norm, (short, date, path, obj))
                seen_in[norm].add(short)
                paths[norm].add(path)

    os.makedirs(OUT, exist_ok=True)
    files = {}  # canonical config -> its file; files already in the corpus keep name and number
    for name in sorted(os.listdir(OUT)):
        if re.match(r"^\d{3,}-.*\.json$", name):
            with open(os.path.join(OUT, name)) as f:
                files.setdefault(canonical(json.load(f)), name)
    number, old = max([int(n.split("-")[0]) for n in files.values()], default=0), len(files)
    for norm, (short, _, path, obj) in first.items():
        if norm not in files:
            number += 1
            slug = re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")[:40].rstrip("-")
            files[norm] = f"{number:03d}-{short}-{slug}.json"
            with open(os.path.join(OUT, files[norm]), "w") as f:
                f.write(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")

    # Configurations documented outside the repository's history (an earlier interface's
    # documentation, an issue's report): `SOURCES` names where each came from.
    sources = {}
    if os.path.exists(os.path.join(OUT, "SOURCES")):
        with open(os.path.join(OUT, "SOURCES")) as f:
            sources = dict(line.rstrip("\n").split(" ", 1) for line in f if line.strip() and not line.startswith("#"))
    rows, etcd = [], 0
    for norm, name in sorted(files.items(), key=lambda kv: int(kv[1].split("-")[0])):
        store = json.loads(norm).get("store")
        store = "etcd" if isinstance(store, dict) and store.get("kind") == "etcd" else "shared"
        etcd += store == "etcd"
        outside = sources.get(name, f"(not in the history of {ref})")
        short, date, path, _ = first.get(norm, ("-", "-", outside, None))
        rows.append(f"| [{name}]({name}) | {short} | {date} | {path} | {store} | {len(seen_in[norm])} "
                    f"| {len(paths[norm])} |")
    with open(os.path.join(OUT, "INDEX.md"), "w") as f:
        f.write(f"""# Plugin configuration corpus

Every plugin configuration (the JSON the Wasm filter gets as its `configuration`) shipped or
documented since the first commit, in README.md, docs/, envoy/ (Envoy and Istio), tests/ and
bench/: one file per distinct configuration, exactly as found (some are invalid on purpose).
Store `etcd` needs a real etcd. `python3 tools/collect_configs.py` regenerates it from `main`;
each release adds its new configurations, and none is ever removed or renumbered. Configurations
built at run time (test parameters, `**` merges) are not here: the script lists them as skipped.
`REFUSED` lists those no release loaded (a test's inputs for refusals), with the field each
refusal names; `SOURCES` names where those documented outside this history come from. `make
unit` parses each (`config::tests::every_configuration_of_the_corpus_loads`);
`tests/test_config_corpus.py` runs each in Envoy: a claim and a replay.

| file | first commit | date | source path | store | commits seen in | paths seen in |
|---|---|---|---|---|---|---|
""" + "\n".join(rows) + "\n")

    kinds = Counter(first[n][2].split("/")[0] for n in first)
    print(f"{len(files)} configurations ({len(files) - old} new); {len(commits)} commits of {ref}, "
          f"{commits[0][1]} ({commits[0][2]}) to {commits[-1][1]} ({commits[-1][2]})")
    print(f"first found in: {dict(kinds)}; etcd store: {etcd}; fields: {' '.join(sorted(fields))}")
    for (path, reason, snippet), n in sorted(skipped.items()):
        print(f"skipped, in {n} commits: {path}: {reason}: {snippet}")


if __name__ == "__main__":
    main()
