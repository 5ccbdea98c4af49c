"""config/grafana-dashboard.json: well formed, and every metric it queries is in /metrics.

Prometheus stores the sample names of the text exposition: a counter
``x`` as ``x_total``, a histogram ``h`` as ``h_bucket``, ``h_sum`` and
``h_count``. So a query must name one of those exactly, and the test
compares each name against the sample names of a live node's ``/metrics``
(the KV store and gossip on, as the daemon runs them, after one request so
the per-reason counters have a sample). It also checks the labels the
queries match on or group by, the values of exact matchers, and that
``rate()`` and friends only see counters and histogram parts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mooncaked.daemon import Node

DASHBOARD = Path(__file__).resolve().parents[2] / "config" / "grafana-dashboard.json"
# Labels Prometheus adds to every series when it scrapes a target.
TARGET_LABELS = frozenset({"instance", "job"})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_METRIC = re.compile(r"\bmooncaked_[A-Za-z0-9_:]*")
_SELECTOR = re.compile(r"\b(mooncaked_[A-Za-z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_RATE_ARG = re.compile(r"\b(?:rate|irate|increase)\s*\(\s*(mooncaked_[A-Za-z0-9_:]*)")
_HISTOGRAM_PARTS = ("_bucket", "_sum", "_count")


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])  # a collapsed row holds its panels


def queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and query variable."""
    out = []
    for p in panels(dash):
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r} target {t['refId']}", t["expr"]))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]
            out.append((f"variable {v['name']!r}", q["query"] if isinstance(q, dict) else q))
    return out


@dataclass
class Exposition:
    # Sample name -> the family's type, and label name -> values seen.
    types: dict[str, str] = field(default_factory=dict)
    labels: dict[str, dict[str, set[str]]] = field(default_factory=dict)


def read_exposition(text: str) -> Exposition:
    exp = Exposition()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            exp.types[sample.name] = family.type
            values = exp.labels.setdefault(sample.name, {})
            for k, v in sample.labels.items():
                values.setdefault(k, set()).add(v)
    return exp


def check_query(where: str, expr: str, exp: Exposition) -> list[str]:
    """What is wrong with one query against the exposition; [] when nothing."""
    problems: list[str] = []
    # Strings first: a regex like "/v1/.*" must not read as a metric name.
    bare = _STRING.sub('""', expr)
    for open_, close in ("()", "{}", "[]"):
        if bare.count(open_) != bare.count(close):
            problems.append(f"{where}: unbalanced {open_}{close}: {expr}")
    names = _METRIC.findall(bare)
    if not names:
        return [f"{where}: queries no mooncaked metric: {expr}"]
    for name in names:
        if name not in exp.types:
            base = name
            for suffix in ("_total", *_HISTOGRAM_PARTS):
                base = base.removesuffix(suffix)
            near = sorted(n for n in exp.types if n.startswith(base))
            problems.append(f"{where}: {name} is not in /metrics (samples like it: {near})")
    for name in _RATE_ARG.findall(bare):
        kind = exp.types.get(name)
        part = name.endswith(_HISTOGRAM_PARTS) and kind == "histogram"
        if kind is not None and kind != "counter" and not part:
            problems.append(f"{where}: rate/increase over {name}, a {kind}")
    used_labels: set[str] = set()
    for name, body in _SELECTOR.findall(expr):
        have = exp.labels.get(name, {})
        for label, op, value in _MATCHER.findall(body):
            if label in TARGET_LABELS:
                continue
            used_labels.add(label)
            if label not in have:
                problems.append(f"{where}: {name} has no label {label!r} (has {sorted(have)})")
            elif "$" not in value and op == "=" and value not in have[label]:
                problems.append(f"{where}: {name}{{{label}={value!r}}} matches no sample")
            elif "$" not in value and op == "=~":
                if not any(re.fullmatch(value, v) for v in have[label]):
                    problems.append(f"{where}: {name}{{{label}=~{value!r}}} matches no sample")
    all_labels = {k for n in names for k in exp.labels.get(n, {})}
    for group in _GROUPING.findall(bare):
        for label in (x.strip() for x in group.split(",")):
            if label and label not in TARGET_LABELS and label not in all_labels:
                problems.append(f"{where}: groups by {label!r}, a label none of {names} has")
    return problems


# ------------------------------------------------------------------- shape


def test_dashboard_is_a_grafana_dashboard_over_a_prometheus_variable() -> None:
    dash = load_dashboard()
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels(dash):
        grid = p["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        # Every panel asks the chosen data source, never a fixed one.
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert all(t["expr"].strip() for t in p["targets"]), p["title"]
    titles = " ".join(p["title"] for p in panels(dash)).lower()
    # What the dashboard is for: one panel (at least) on each.
    for topic in ("requests", "ttft", "tbt", "kv usage", "hit rate", "transfer", "gossip"):
        assert topic in titles, f"no panel about {topic}"


def test_check_query_finds_what_is_wrong() -> None:
    exp = read_exposition(
        "# TYPE mooncaked_x_total counter\n"
        'mooncaked_x_total{tier="dram"} 1\n'
        "# TYPE mooncaked_g gauge\n"
        "mooncaked_g 2\n"
    )
    ok = 'sum by (tier) (rate(mooncaked_x_total{instance=~"$instance", tier="dram"}[5m]))'
    assert check_query("q", ok, exp) == []
    assert "mooncaked_x is not in /metrics" in check_query("q", "rate(mooncaked_x[5m])", exp)[0]
    assert "a gauge" in check_query("q", "rate(mooncaked_g[5m])", exp)[0]
    assert "no label 'kind'" in check_query("q", 'mooncaked_x_total{kind="a"}', exp)[0]
    assert "matches no sample" in check_query("q", 'mooncaked_x_total{tier="ssd"}', exp)[0]
    assert "groups by 'kind'" in check_query("q", "sum by (kind) (mooncaked_g)", exp)[0]
    assert "queries no mooncaked metric" in check_query("q", "up", exp)[0]
    assert "unbalanced ()" in check_query("q", "sum(mooncaked_g", exp)[0]


# -------------------------------------------------------------- live node


@pytest.mark.timeout(120)
async def test_every_queried_metric_is_in_a_live_nodes_metrics(node_factory: Any) -> None:
    node: Node = await node_factory(store={"dram_bytes": 4 * 1024 * 1024})
    async with aiohttp.ClientSession(node.url) as s:
        body = {"prompt": "one request, so every per-reason counter has a sample", "max_tokens": 4}
        async with s.post("/v1/completions", json=body) as resp:
            assert resp.status == 200
        async with s.get("/metrics") as resp:
            assert resp.status == 200
            exp = read_exposition(await resp.text())
    assert node.cluster is not None and node.store is not None
    found = queries(load_dashboard())
    assert len(found) >= 20
    problems = [p for where, expr in found for p in check_query(where, expr, exp)]
    assert problems == [], "\n".join(problems)
