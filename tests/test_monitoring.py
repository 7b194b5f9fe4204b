"""The shipped alerts and dashboard (deploy/prometheus, deploy/grafana) stay true to the plugin:
promtool checks and unit-tests the rules, every metric they name is one src/metrics.rs defines
(counters counted with rate/increase, gauges read as they are), every metric that means trouble
has its alert and its section in docs/operations.md, and a real Envoy exports the names used.

Run: .venv/bin/pytest -q tests/test_monitoring.py (needs promtool: `make tools` installs it).
"""

import json
import os
import re
import shutil
import subprocess
import time

import pytest
import yaml

import e2e_util
from harness import METRICS_LAG_S, REPO_ROOT, request

RULES = os.path.join(REPO_ROOT, "deploy", "prometheus", "idempotency-rules.yaml")
RULE_TESTS = os.path.join(REPO_ROOT, "deploy", "prometheus", "idempotency-rules.test.yaml")
DASHBOARD = os.path.join(REPO_ROOT, "deploy", "grafana", "idempotency-dashboard.json")
OPERATIONS = os.path.join(REPO_ROOT, "docs", "operations.md")

# What means trouble, each with its alert (the rules may alert on more).
ALERTING = {"owner_lost", "expired_takeover", "store_full", "store_error", "store_no_space",
            "response_not_stored", "scope_missing", "effective_retention_ms", "evicted_below_share",
            "share_full", "completion_unacknowledged"}

# PromQL words that are not metric names.
PROMQL_WORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
                "group_right", "bool", "offset", "inf", "nan"}


def read(path):
    with open(path) as f:
        return f.read()


def plugin_metrics():
    """{name: "counter" | "gauge"} from src/metrics.rs, as /stats/prometheus names them."""
    source = read(os.path.join(REPO_ROOT, "src", "metrics.rs"))
    counters, gauges = source.split("pub enum Gauge", 1)
    kinds = {}
    for part, kind in ((counters, "counter"), (gauges, "gauge")):
        for name in re.findall(r'=> "idempotency\.([a-z_]+)"', part):
            kinds[f"idempotency_{name}"] = kind
    assert sum(k == "counter" for k in kinds.values()) > 20 and "idempotency_stored_bytes" in kinds, kinds
    return kinds


def promtool():
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: `make tools` installs it (Debian's prometheus package)",
                    pytrace=False)
    return path


def alerts():
    groups = yaml.safe_load(read(RULES))["groups"]
    return [rule for group in groups for rule in group["rules"]]


def dashboard_exprs():
    board = json.loads(read(DASHBOARD))
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def metric_names(expr):
    """The metric names of a PromQL expression: identifiers that are not functions, keywords,
    label names or Grafana variables."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)        # string literals
    expr = re.sub(r"\$\{?\w+\}?", "1", expr)                # Grafana variables
    expr = re.sub(r"\{[^}]*\}", "", expr)                   # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)                  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?", expr):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in PROMQL_WORDS or re.fullmatch(r"\d+(ms|s|m|h|d|w|y)", word):
            continue
        names.add(word)
    return names


def rate_arguments(expr):
    """Metric names inside rate(), irate() or increase()."""
    return set(re.findall(r"\b(?:rate|irate|increase)\(\s*(\w+)", expr))


def run(cmd, cwd):
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)
    return out.returncode, out.stdout + out.stderr


def test_promtool_check_rules():
    code, output = run([promtool(), "check", "rules", RULES], REPO_ROOT)
    print(output)
    assert code == 0, output
    assert f"SUCCESS: {len(alerts())} rules found" in output, output


def test_promtool_test_rules():
    code, output = run([promtool(), "test", "rules", os.path.basename(RULE_TESTS)], os.path.dirname(RULE_TESTS))
    print(output)
    assert code == 0, output
    assert "SUCCESS" in output and "FAILED" not in output, output


def test_every_alert_is_unit_tested_firing_and_quiet():
    tests = yaml.safe_load(read(RULE_TESTS))["tests"]
    fired, quiet = set(), set()
    for test in tests:
        for case in test.get("alert_rule_test", []):
            (fired if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = {rule["alert"] for rule in alerts()}
    assert names - fired == set(), f"alerts no test fires: {sorted(names - fired)}"
    assert names - quiet == set(), f"alerts no test keeps quiet: {sorted(names - quiet)}"


def test_every_alert_has_for_severity_what_to_do_and_its_section():
    doc = read(OPERATIONS)
    for rule in alerts():
        name = rule["alert"]
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for", ""))), f"{name}: no for:"
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], name
        anchor = name.lower()
        assert notes["runbook"] == f"docs/operations.md#{anchor}", name
        assert f"section \"{name}\"" in notes["description"], name
        assert re.search(rf"^### {name}$", doc, re.M), f"docs/operations.md has no section ### {name}"


def test_rules_and_dashboard_name_only_the_plugins_metrics():
    kinds = plugin_metrics()
    exprs = [("rule " + r["alert"], str(r["expr"])) for r in alerts()]
    exprs += [("dashboard", e) for e in dashboard_exprs()]
    assert len(exprs) > 20
    for where, expr in exprs:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        unknown = names - set(kinds)
        assert not unknown, f"{where}: not metrics of the plugin: {sorted(unknown)} in {expr!r}"
        for name in rate_arguments(expr):
            assert kinds.get(name) == "counter", f"{where}: rate/increase of gauge {name}"
        for name in names - rate_arguments(expr):
            assert kinds[name] == "gauge", f"{where}: counter {name} read without rate/increase"


def test_every_trouble_metric_has_an_alert():
    kinds = plugin_metrics()
    alerted = set()
    for rule in alerts():
        alerted |= {n.removeprefix("idempotency_") for n in metric_names(str(rule["expr"]))}
    assert {f"idempotency_{n}" for n in ALERTING} <= set(kinds), "a name in ALERTING is not the plugin's"
    missing = ALERTING - alerted
    assert not missing, f"no alert on: {sorted(missing)}"


def test_dashboard_panels_and_their_queries_parse(tmp_path):
    board = json.loads(read(DASHBOARD))
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    titles = " ".join(p["title"].lower() for p in board["panels"])
    for what in ("by outcome", "conflicts per replay", "effective retention", "entries", "stored bytes",
                 "store errors", "heaviest caller", "write budget"):
        assert what in titles, f"no panel for {what}"
    variables = {v["name"] for v in board["templating"]["list"]}
    for expr in dashboard_exprs():
        for var in re.findall(r"\$(\w+)", expr):
            assert var in variables or var.startswith("__"), f"undefined variable ${var} in {expr!r}"
    # promtool parses each query as the expression of a recording rule, Grafana's variables
    # replaced by what they stand for.
    def concrete(expr):
        expr = expr.replace("$__rate_interval", "5m").replace("$write_budget_bytes", "268435456")
        return expr.replace('"$instance"', '".*"')
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{i}", "expr": concrete(e)} for i, e in enumerate(dashboard_exprs())]}]}
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump(rules))
    code, output = run([promtool(), "check", "rules", str(path)], str(tmp_path))
    assert code == 0, output


def test_envoy_exports_the_names_the_rules_use(wasm, upstream, make_envoy):
    """The names as a real Envoy shows them in /stats/prometheus: `idempotency_<name>` (Envoy
    strips the custom stat namespace `wasmcustom` and its own `envoy_` prefix), counters
    without `_total`, each of the type the rules treat it as."""
    envoy = make_envoy({}, upstream.port, concurrency=1)
    key = e2e_util.new_key("monitoring")
    assert e2e_util.post(envoy.port, key).status == 201
    assert e2e_util.post(envoy.port, key).header("idempotent-replayed") == "true"
    time.sleep(METRICS_LAG_S)  # the plugin writes its counters from its tick
    text = request(envoy.admin_port, "GET", "/stats/prometheus").text
    exported = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    kinds = plugin_metrics()
    missing = {n: k for n, k in kinds.items() if exported.get(n) != k}
    assert not missing, (f"not exported as idempotency_<name> of that type: {missing}; "
                         f"Envoy's names: {sorted(n for n in exported if 'idempotency' in n)}")
    values = dict(re.findall(r"^(idempotency_\w+)\{\} (\S+)$", text, re.M))
    assert values.get("idempotency_claimed") == "1" and values.get("idempotency_replayed") == "1", values
