"""Alert rules and the Grafana dashboard in deploy/ can fire and show data: every query names
metrics calmq exports, with labels those metrics (or the scrape config's target labels)
carry, every part has an alert for being down, which Prometheus' own rule tester fires on
series shaped as a PodMonitor scrape gives them, and every rule has a runbook."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
import yaml

from tests.support.promql import catalogue, read_query

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "calmq-dashboard.json"
ALERTING_DOC = ROOT / "docs" / "how-to" / "alerting.md"

# Labels Prometheus attaches to every series of a target: its scrape job and instance, and
# the worker pool the documented scrape config sets on worker targets (a worker process
# serves one pool, so the pool is a property of the target, not of each sample); the
# environment's namespace (Kubernetes service discovery, PodMonitors) and the cluster (an
# external label, or a relabelling where one Prometheus scrapes several clusters).
TARGET_LABELS = {"job", "instance", "pool", "namespace", "cluster"}
PARTS = ("api", "relay", "worker", "forwarder", "reaper")
TROUBLESHOOTING = ROOT / "docs" / "how-to" / "troubleshooting.md"

REQUIRED_ALERTS = {  # the concerns of the issues, each covered by at least one rule
    "queue age over SLO": "calmq_queue_age_seconds",
    "dead letters growing": "calmq_attempts_finished_total",
    "slot lag": "calmq_relay_slot_lag_seconds",
    "abandoned slot's WAL": "calmq_replication_slot_retained_wal_bytes",
    "429 rate": "calmq_model_calls_total",
    "table bloat": "calmq_db_dead_tuple_ratio",
    "transaction ID wraparound": "calmq_db_xid_age",
    "NOTIFY queue filling": "calmq_db_notification_queue_usage",
}


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _dashboard() -> dict[str, Any]:
    found: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return found


def _panel_exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in _dashboard()["panels"] for t in p["targets"]]


def _exprs(source: str) -> list[tuple[str, str]]:
    if source == "alerts":
        return [(r["alert"], r["expr"]) for r in _rules()]
    variables = [(f"${v['name']}", v["definition"]) for v in _dashboard()["templating"]["list"]
                 if v["type"] == "query"]
    return _panel_exprs() + [(name, _label_values_metric(q)) for name, q in variables]


def _label_values_metric(definition: str) -> str:
    """label_values(metric{...}, label) -> the selector, as a query of its own."""
    match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", definition.strip())
    assert match, definition
    return match.group(1)


def _scrape_configs() -> list[dict[str, Any]]:
    """The scrape configs shown in docs/how-to/alerting.md."""
    blocks = re.findall(r"```yaml\n(.*?)```", ALERTING_DOC.read_text(), re.DOTALL)
    configs = [yaml.safe_load(b) for b in blocks if "scrape_configs" in b]
    return [job for c in configs for job in c["scrape_configs"]]


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        # `make test` installs it (make promtool); in CI a missing checker is a failure.
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("promtool is not installed (Debian package prometheus: make promtool)")
        pytest.skip("promtool is not installed (Debian package prometheus)")
    return promtool


def test_the_catalogue_agrees_with_prometheus_clients_registry() -> None:
    """Each metric the code scan finds is registered, with the same labels, once the modules
    that define it ran (lazily created ones by their factories) and vice versa: the scan is
    neither vacuous nor inventing metrics."""
    import calmq.calls.budget
    import calmq.calls.caching
    import calmq.calls.fallback
    import calmq.calls.gate
    import calmq.calls.tiers
    import calmq.cli.services
    import calmq.job_costs
    import calmq.processors.batcher
    import calmq.processors.failures
    import calmq.processors.metrics
    import calmq.producers.api
    import calmq.producers.backlog
    import calmq.producers.intake
    import calmq.producers.retention
    import calmq.producers.routes.jobs
    import calmq.relay.cdc
    import calmq.relay.publisher
    import calmq.retrying
    import calmq.reviews
    import calmq.spending
    import calmq.supervision

    # The factories below are the modules' own lazy constructors (cached: calling one
    # again returns the same metrics), which is how the processes create them.
    calmq.calls.budget._metrics()
    calmq.calls.caching._counters()
    calmq.job_costs._counters()
    calmq.calls.fallback._fallbacks()
    calmq.calls.gate._blocked_gauge()
    calmq.calls.gate._paused_gauge()
    calmq.calls.gate._unconfirmed_counter()
    calmq.calls.tiers._calls()
    calmq.processors.failures._handbacks()
    calmq.cli.services.gc_pause_histogram()
    calmq.relay.cdc._metrics()
    calmq.relay.publisher._rejected_total()
    calmq.retrying._retries()
    calmq.producers.retention.retention_counters()
    calmq.supervision._failures()
    calmq.reviews._review_wait()
    calmq.spending._held_gauge()
    calmq.producers.backlog.queue_age_gauge()
    calmq.producers.backlog.slot_gauges()
    calmq.producers.backlog.table_gauges()
    for module in (calmq.processors.metrics, calmq.producers.api, calmq.producers.intake,
                   calmq.producers.routes.jobs,
                   calmq.processors.batcher):  # these define theirs at import
        assert module.__name__ in sys.modules

    # prometheus_client has no public view of a collector's label names; its registry's
    # map from collector to series names is the one place both are together.
    registered: dict[str, frozenset[str]] = {}
    for collector, names in list(prometheus_client.REGISTRY._collector_to_names.items()):
        labels = frozenset(getattr(collector, "_labelnames", ()))
        for name in names:
            if name.startswith("calmq_") and name + "_total" not in names:  # a counter's
                registered[name] = labels  # base name is no series of its own
    # The collector's own labels: the scan adds ``le``/``quantile`` to the series that get it.
    series = {n: labels - {"le", "quantile"} for n, labels in catalogue().series().items()}
    assert {n: registered[n] for n in series if n in registered} == {
        n: labels for n, labels in series.items() if n in registered}
    assert sorted(set(registered) - set(series)) == []
    assert sorted(n for n in series if not n.endswith("_created") and n not in registered) == []


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_queries_name_only_exported_metrics_with_their_labels(source: str) -> None:
    """Every metric in a rule, panel or variable query is one calmq exports (or Prometheus'
    `up`), every label matcher is a label of that metric or a target label, and every
    grouping label is carried by a metric of the expression."""
    series = catalogue().series()
    series["up"] = frozenset()
    problems: list[str] = []
    used: set[str] = set()
    for title, expr in _exprs(source):
        q = read_query(expr)
        used |= q.metrics
        problems += [f"{title}: {m} is not exported" for m in sorted(q.metrics - series.keys())]
        problems += [f"{title}: {m} has no label {label}" for m, label in sorted(q.matchers)
                     if m in series and label not in series[m] | TARGET_LABELS]
        carried = set().union(*(series.get(m, frozenset()) for m in q.metrics)) | TARGET_LABELS
        problems += [f"{title}: no metric of it carries {label}"
                     for label in sorted(q.grouping - carried)]
    assert any(m.startswith("calmq_") for m in used), f"no calmq metric in the {source}"
    assert problems == []


def test_the_query_reader_finds_names_matchers_and_grouping() -> None:
    """The PromQL reader the checks rely on sees through functions, ranges and variables."""
    q = read_query('histogram_quantile(0.99, sum by (le, pool) (rate(calmq_x_bucket'
                   '{pool=~"$pool", topic=~"calmq\\\\.($pool)\\\\..+"}[$__rate_interval])))'
                   ' / on() group_left absent(up{job="calmq-api"}) and 5 * 1024')
    assert q.metrics == {"calmq_x_bucket", "up"}
    assert q.matchers == {("calmq_x_bucket", "pool"), ("calmq_x_bucket", "topic"),
                          ("up", "job")}
    assert q.grouping == {"le", "pool"}


def test_rules_are_well_formed_and_cover_the_concerns() -> None:
    """Each rule has a unique name, a severity, a summary and balanced brackets; every
    concern has a rule."""
    rules = _rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        expr = rule["expr"]
        for pair in ("()", "{}", "[]"):
            assert expr.count(pair[0]) == expr.count(pair[1]), rule["alert"]
        assert rule["labels"]["severity"] in ("page", "ticket")
        assert rule["annotations"]["summary"]
    exprs = " ".join(r["expr"] for r in rules)
    missing = [concern for concern, metric in REQUIRED_ALERTS.items() if metric not in exprs]
    assert missing == []


def test_every_part_has_a_down_and_an_absent_alert_on_its_scrape_job() -> None:
    """For each part's job (calmq-<part>), a rule fires on `up{job=...} == 0` and one on
    its absence from an environment (`unless on (namespace, cluster) up{job=...}`): a part
    that stopped, or that Prometheus lost track of, is an alert, not a dashboard gap."""
    exprs = [" ".join(r["expr"].split()) for r in _rules()]
    for part in PARTS:
        up = f'up{{job="calmq-{part}"}}'
        assert any(up in e and "== 0" in e for e in exprs), f"no `{up} == 0` rule"
        assert any(f"unless on (namespace, cluster) {up}" in e for e in exprs), \
            f"no rule on `{up}` missing from an environment"


def test_every_documented_scrape_gives_the_job_and_pool_labels() -> None:
    """The static scrape config names its jobs calmq-<part> with the pool on workers; the
    pod-discovery one takes job and pool from the pods' calmq.dev/job and calmq.dev/pool
    labels, which is also what the chart's PodMonitors read (test_kubernetes checks the
    pods carry them)."""
    configs = _scrape_configs()
    static = {c["job_name"]: c for c in configs if "static_configs" in c}
    assert {f"calmq-{part}" for part in PARTS} <= set(static)
    assert all("pool" in t["labels"] for t in static["calmq-worker"]["static_configs"])
    [discovery] = [c for c in configs if "kubernetes_sd_configs" in c]
    targets = {r.get("target_label"): r["source_labels"]
               for r in discovery["relabel_configs"] if r.get("target_label")}
    assert targets["job"] == ["__meta_kubernetes_pod_label_calmq_dev_job"]
    assert targets["pool"] == ["__meta_kubernetes_pod_label_calmq_dev_pool"]


def _slug(heading: str) -> str:
    """The anchor GitHub (and most Markdown renderers) give a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_rule_has_a_runbook_section_in_the_troubleshooting_guide() -> None:
    """Each rule's runbook_url is a section of docs/how-to/troubleshooting.md that names
    the alert in its heading (rules added later must bring theirs)."""
    headings = {_slug(h): h for h in re.findall(r"^#+ (.+)$", TROUBLESHOOTING.read_text(),
                                                 re.M)}
    missing = []
    for rule in _rules():
        url = rule["annotations"].get("runbook_url", "")
        path, _, anchor = url.partition("#")
        if path != "docs/how-to/troubleshooting.md" or anchor not in headings \
                or rule["alert"] not in headings[anchor]:
            missing.append(f"{rule['alert']}: {url or 'no runbook_url'}")
    assert missing == []


def _scrape(part: str, value: str, pool: str | None = None,
            namespace: str = "calmq") -> dict[str, str]:
    """The `up` series a PodMonitor scrape of one pod of ``part`` in ``namespace`` gives."""
    labels = {"job": f"calmq-{part}", "namespace": namespace,
              "pod": f"calmq-{part}-5d8f-x2k4p",
              "container": part, "endpoint": "metrics", "instance": "10.42.0.7:9100"}
    if pool:
        labels["pool"] = pool
    text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"up{{{text}}}", "values": value}


def _sample(metric: str, values: str, **labels: str) -> tuple[str, str]:
    return metric + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}", values


_API = {"job": "calmq-api", "instance": "10.42.0.7:9100"}
_WORKER = {"job": "calmq-worker", "pool": "default"}
_HEALTHY_SAMPLES = [  # what a healthy install reports besides `up`, flat over 40 minutes
    _sample("calmq_queue_age_seconds", "0x40", pool="default", priority="interactive", **_API),
    _sample("calmq_queue_age_seconds", "3x40", pool="default", priority="bulk", **_API),
    _sample("calmq_replication_slot_active", "1x40", slot="calmq_outbox", **_API),
    _sample("calmq_replication_slot_retained_wal_bytes", "1048576x40", slot="calmq_outbox",
            **_API),
    _sample("calmq_relay_slot_lag_seconds", "0.2x40", slot="calmq_outbox", job="calmq-relay"),
    _sample("calmq_attempts_finished_total", "0+60x40", status="completed", failure_class="",
            **_WORKER),
    _sample("calmq_model_calls_total", "0+60x40", provider="openai", model="gpt-4o-mini",
            outcome="ok", **_WORKER),
    _sample("calmq_poison_messages_total", "0x40", **_WORKER),
    _sample("calmq_provider_refusals_unconfirmed_total", "0+0x40", provider="openai",
            model="gpt-4o-mini", code="provider_permission", **_WORKER),
    _sample("calmq_db_dead_tuple_ratio", "0.03x40", table="jobs", **_API),
    _sample("calmq_db_dead_tuples", "600000x40", table="jobs", **_API),
    _sample("calmq_db_dead_tuple_ratio", "0.5x40", table="tenants", **_API),
    _sample("calmq_db_dead_tuples", "25x40", table="tenants", **_API),  # small: no alert
    _sample("calmq_db_oldest_transaction_seconds", "2x40", **_API),
    _sample("calmq_db_xid_age", "150000000+100000x40", **_API),
    _sample("calmq_db_notification_queue_usage", "0x40", **_API),
]
# The database's ill states, one scenario each: (series replaced, values, alert, its labels).
_DATABASE_TROUBLE = [
    (_sample("calmq_db_dead_tuple_ratio", "", table="jobs", **_API)[0], "0.03x4 0.35x36",
     "CalmqTableBloat", {"table": "jobs"}),
    (_sample("calmq_db_oldest_transaction_seconds", "", **_API)[0], "0+150x40",
     "CalmqLongTransaction", {}),
    (_sample("calmq_db_xid_age", "", **_API)[0], "900000000+10000000x40",
     "CalmqTransactionIdWraparound", {}),
    # A listening session stopped reading: the queue grows by 1% a minute.
    (_sample("calmq_db_notification_queue_usage", "", **_API)[0], "0+0.01x40",
     "CalmqNotificationQueueFilling", {}),
    # A step's every request refused by a firewall in front of the provider: 2 a minute,
    # each its job's own (the probe call went through).
    (_sample("calmq_provider_refusals_unconfirmed_total", "", provider="openai",
             model="gpt-4o-mini", code="provider_permission", **_WORKER)[0], "0+2x40",
     "CalmqProviderRefusalsUnconfirmed",
     {"provider": "openai", "model": "gpt-4o-mini", "code": "provider_permission"}),
]


def _scenario(name: str, parts: dict[str, str], fires: dict[str, dict[str, str]],
              waiting: bool = False, replace: dict[str, str] | None = None) -> dict[str, Any]:
    """A promtool test: ``parts`` maps each scraped part to its `up` values; every rule is
    checked at 35 minutes, those in ``fires`` with the labels given, the rest silent.
    ``replace`` gives some of the healthy samples other values."""
    series = [_scrape(part, v, "default" if part in ("worker", "batcher") else None)
              for part, v in parts.items()]
    for text, values in _HEALTHY_SAMPLES:
        # Jobs wait, and nobody takes them: the bulk queue ages.
        aging = waiting and text.startswith("calmq_queue_age_seconds") and "bulk" in text
        given = (replace or {}).get(text, values)
        series.append({"series": text, "values": "0+10x40" if aging else given})
    tests = []
    for rule in _rules():
        labels = fires.get(rule["alert"])
        expected = [] if labels is None else [
            {"exp_labels": {"severity": rule["labels"]["severity"], **labels}}]
        tests.append({"eval_time": "35m", "alertname": rule["alert"], "exp_alerts": expected})
    return {"name": name, "interval": "1m", "input_series": series,
            "alert_rule_test": tests}


def test_promtool_rule_tests_fire_only_for_the_missing_or_down_part(tmp_path: Path) -> None:
    """`promtool test rules` on PodMonitor-shaped series: a healthy install fires nothing;
    each part without a target fires its absent alert, each part whose pods answer no
    scrape fires its down alert, and nothing else fires."""
    promtool = _promtool()
    healthy = dict.fromkeys((*PARTS, "batcher"), "1x40")
    scenarios = [_scenario("healthy install", healthy, {})]
    absent = {"api": "CalmqApiDown", "relay": "CalmqRelayDown",
              "forwarder": "CalmqForwarderDown", "reaper": "CalmqReaperDown"}
    for part, alert in absent.items():
        parts = {p: v for p, v in healthy.items() if p != part}
        scenarios.append(_scenario(f"no {part} target", parts, {alert: {"namespace": "calmq"}}))
        scenarios.append(_scenario(f"{part} down", {**healthy, part: "1x5 0x35"},
                                   {alert: {"namespace": "calmq"}}))
    # Workers: down is per pool; no worker target at all is an alert only while jobs wait
    # (a pool KEDA scaled to zero is not an outage): bulk jobs aging by 10 s a minute pass
    # a minute (the absent rule) long before 15 (the bulk SLO).
    scenarios.append(_scenario("worker pool down", {**healthy, "worker": "1x5 0x35"},
                               {"CalmqWorkerPoolDown": {"namespace": "calmq",
                                                        "pool": "default"}}))
    no_workers = {p: v for p, v in healthy.items() if p != "worker"}
    scenarios.append(_scenario("no worker target, nothing waits", no_workers, {}))
    scenarios.append(_scenario(
        "no worker target while jobs wait", no_workers,
        {"CalmqWorkersAbsent": {}}, waiting=True))
    # The database: bloat on a large table, a transaction open for an hour, freezing behind.
    for text, values, alert, labels in _DATABASE_TROUBLE:
        scenarios.append(_scenario(alert, healthy, {alert: labels}, replace={text: values}))
    _promtool_test(promtool, tmp_path, scenarios)
    assert len(scenarios) == 1 + 2 * len(absent) + 3 + len(_DATABASE_TROUBLE)


def _promtool_test(promtool: str, tmp_path: Path, scenarios: list[dict[str, Any]]) -> None:
    """`promtool test rules` of ``scenarios`` against the rules as written, without their
    annotations: promtool compares an alert's annotations too, and those are prose
    (test_rules_are_well_formed checks them)."""
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(doc))
    (tmp_path / "tests.yml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": scenarios}))
    done = subprocess.run([promtool, "test", "rules", "tests.yml"], cwd=tmp_path,
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def _two_environments(name: str, production: dict[str, str],
                      fires: dict[str, dict[str, str]],
                      samples: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    """A promtool test of staging and production in one Prometheus: staging healthy (every
    part up), production's parts with the `up` values of ``production``, ``samples`` added;
    every rule checked at 35 minutes, those in ``fires`` with production's labels given."""
    series = [_scrape(part, "1x40", "default" if part == "worker" else None, "staging")
              for part in (*PARTS, "batcher")]
    series += [_scrape(part, values, "default" if part == "worker" else None, "production")
               for part, values in production.items()]
    for namespace in ("staging", "production"):  # nothing waits in either, unless given
        series.append({"series": _sample("calmq_queue_age_seconds", "", pool="default",
                                         priority="bulk", namespace=namespace, **_API)[0],
                       "values": "0x40"})
    series += [{"series": text, "values": values} for text, values in samples]
    tests = []
    for rule in _rules():
        labels = fires.get(rule["alert"])
        expected = [] if labels is None else [{"exp_labels": {
            "severity": rule["labels"]["severity"], "namespace": "production", **labels}}]
        tests.append({"eval_time": "35m", "alertname": rule["alert"], "exp_alerts": expected})
    return {"name": name, "interval": "1m", "input_series": series,
            "alert_rule_test": tests}


def test_promtool_alerts_fire_for_the_dead_environment_only(tmp_path: Path) -> None:
    """With staging healthy and production broken in one Prometheus, each alert fires for
    production (its namespace label) and for nothing else: staging's live parts, queues
    and samples do not hide production's dead ones."""
    promtool = _promtool()
    healthy = dict.fromkeys((*PARTS, "batcher"), "1x40")
    no_api = {p: v for p, v in healthy.items() if p != "api"}
    no_workers = {p: v for p, v in healthy.items() if p != "worker"}
    waiting = _sample("calmq_queue_age_seconds", "", pool="default", priority="interactive",
                      namespace="production", **_API)[0]
    scenarios = [
        _two_environments("production healthy too", healthy, {}),
        _two_environments("production API down", {**healthy, "api": "1x5 0x35"},
                          {"CalmqApiDown": {}}),
        _two_environments("production has no API target", no_api, {"CalmqApiDown": {}}),
        _two_environments("production relay down", {**healthy, "relay": "1x5 0x35"},
                          {"CalmqRelayDown": {}}),
        _two_environments("production worker pool down", {**healthy, "worker": "1x5 0x35"},
                          {"CalmqWorkerPoolDown": {"pool": "default"}}),
        # Production's interactive jobs wait and it has no workers; staging's do not take
        # them. The queue ages 10 s a minute: past 60 s (absent workers) and 30 s (the SLO).
        _two_environments("production jobs wait without workers", no_workers,
                          {"CalmqWorkersAbsent": {},
                           "CalmqInteractiveQueueAgeOverSLO": {"pool": "default",
                                                               "priority": "interactive"}},
                          samples=((waiting, "0+10x40"),)),
    ]
    _promtool_test(promtool, tmp_path, scenarios)


def test_the_documented_table_lists_every_alert() -> None:
    """docs/how-to/alerting.md has a row for each rule, and no row for a rule that is gone."""
    documented = set(re.findall(r"^\| `(Calmq\w+)` \|", ALERTING_DOC.read_text(), re.M))
    assert documented == {r["alert"] for r in _rules()}


def test_promtool_accepts_the_rules(tmp_path: Path) -> None:
    """Prometheus' own checker parses every expression (where promtool is installed)."""
    promtool = _promtool()
    done = subprocess.run([promtool, "check", "rules", str(RULES)], check=False,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dashboard_has_the_pool_variable_and_the_panels_on_call_needs() -> None:
    """A `pool` variable over a metric that carries the pool label, used by the panels; a
    panel each for consumer lag per topic, job latency p50/p99, queue age, retries, dead
    letters, tokens and cost."""
    dash = _dashboard()
    [pool] = [v for v in dash["templating"]["list"] if v["name"] == "pool"]
    metric = _label_values_metric(pool["definition"]).split("{")[0]
    assert "pool" in catalogue().series()[metric]
    assert pool["definition"].rstrip(")").endswith("pool")
    exprs = [expr for _title, expr in _panel_exprs()]
    wanted = {
        "consumer lag per topic": ("calmq_consumer_lag_messages", "by (topic)"),
        "job latency p50": ("calmq_job_latency_seconds_bucket", "histogram_quantile(0.5,"),
        "job latency p99": ("calmq_job_latency_seconds_bucket", "histogram_quantile(0.99,"),
        "queue age": ("calmq_queue_age_seconds", "max by (pool, priority)"),
        "retries": ("calmq_retries_total", "rate("),
        "dead letters": ("calmq_dead_letters_total", "increase("),
        "tokens": ("calmq_model_tokens_total", "rate("),
        "cost": ("calmq_model_cost_usd_total", "rate("),
    }
    for what, (metric_name, shape) in wanted.items():
        assert any(metric_name in e and shape in " ".join(e.split())
                   for e in exprs), what
    filtered = [e for e in exprs if "$pool" in e]
    assert len(filtered) >= len(wanted)


def test_dashboard_panels_are_unique_and_use_the_datasource_variable() -> None:
    """Panel ids are unique and every query goes through the ${datasource} variable."""
    dash = _dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert any(v["name"] == "datasource" for v in dash["templating"]["list"])
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"


def test_dashboard_shows_one_environment_at_a_time() -> None:
    """A `cluster` and a single-valued `namespace` variable scope every panel's every
    selector, so a healthy staging in the same Prometheus does not hide a dead production."""
    dash = _dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert not variables["namespace"]["multi"]
    assert not variables["namespace"]["includeAll"]
    assert variables["cluster"]["definition"].rstrip(")").endswith("cluster")
    scope = 'namespace=~"$namespace", cluster=~"$cluster"'
    unscoped = []
    for title, expr in [*_panel_exprs(), ("$pool", variables["pool"]["definition"])]:
        selectors = re.findall(r"\b(?:calmq_\w+|up)\b(\{[^}]*\})?", expr)
        unscoped += [title for sel in selectors if scope not in sel]
    assert unscoped == []
