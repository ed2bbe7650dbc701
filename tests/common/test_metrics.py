"""The shared metrics helper: the HTTP server's /metrics and /health, the flag, the buckets."""
from __future__ import annotations

import argparse
import pytest

from prometheus_client import CollectorRegistry, Counter

from helpers.metrics_util import Scrape, http_get
from helpers.stack import free_port
from tessera.common import metrics

pytestmark = pytest.mark.unit


def test_server_serves_metrics_and_a_health_that_follows_its_source():
    registry = CollectorRegistry()
    hits = Counter("tessera:test_hits", "test counter", registry=registry)
    hits.inc(3)
    state = {"serving": False}
    server = metrics.start_metrics_server(free_port(), "127.0.0.1", health=lambda: state["serving"],
                                          registry=registry)
    try:
        base = f"http://127.0.0.1:{server.port}"
        status, body = http_get(base + "/metrics")
        assert status == 200 and Scrape(body).get("tessera:test_hits_total") == 3
        assert "tessera:test_hits_created" not in body  # no _created series
        assert http_get(base + "/health") == (503, '{"status": "NOT_SERVING"}\n')
        state["serving"] = True
        assert http_get(base + "/health") == (200, '{"status": "SERVING"}\n')
        assert http_get(base + "/nope")[0] == 404
    finally:
        server.close()


def test_port_zero_disables_and_a_taken_port_is_not_fatal():
    assert metrics.start_metrics_server(0) is None
    first = metrics.start_metrics_server(free_port(), "127.0.0.1", registry=CollectorRegistry())
    try:
        assert metrics.start_metrics_server(first.port, "127.0.0.1", registry=CollectorRegistry()) is None
    finally:
        first.close()


def test_flag_defaults_and_env(monkeypatch):
    for service, port in (("frontend", 9301), ("tokenizer", 9302), ("engine", 9303)):
        monkeypatch.delenv("TESSERA_METRICS_PORT", raising=False)
        parser = argparse.ArgumentParser()
        metrics.add_metrics_flag(parser, service)
        assert parser.parse_args([]).metrics_port == port
        assert parser.parse_args(["--metrics-port", "0"]).metrics_port == 0
        monkeypatch.setenv("TESSERA_METRICS_PORT", "9999")
        parser = argparse.ArgumentParser()
        metrics.add_metrics_flag(parser, service)
        assert parser.parse_args([]).metrics_port == 9999
        assert parser.parse_args(["--metrics-port", "1234"]).metrics_port == 1234


def test_vllm_bucket_helpers():
    assert metrics.build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert metrics.build_1_2_5_buckets(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert metrics.TTFT_BUCKETS[0] == 0.001 and metrics.TTFT_BUCKETS[-1] == 2560.0
    assert metrics.ITL_BUCKETS[0] == 0.01 and metrics.ITL_BUCKETS[-1] == 80.0
    assert metrics.REQUEST_LATENCY_BUCKETS[0] == 0.3 and metrics.REQUEST_LATENCY_BUCKETS[-1] == 7680.0
    for buckets in (metrics.TTFT_BUCKETS, metrics.ITL_BUCKETS, metrics.REQUEST_LATENCY_BUCKETS,
                    metrics.ITERATION_TOKENS_BUCKETS, metrics.STEP_TIME_BUCKETS, metrics.FAST_LATENCY_BUCKETS):
        assert buckets == sorted(set(buckets))


def _defined_metric_families() -> set[str]:
    """Every tessera: metric family the three services define."""
    from prometheus_client import REGISTRY
    from tessera_engine.metrics import EngineMetrics
    from tessera_frontend import metrics as frontend_metrics  # noqa: F401 (registers its metrics)
    from tessera_tokenizer import metrics as tokenizer_metrics  # noqa: F401

    engine_registry = CollectorRegistry()
    EngineMetrics("m", 2048, block_size=16, num_blocks=8, enable_prefix_caching=True, registry=engine_registry)
    names = set()
    for registry in (engine_registry, REGISTRY):
        for family in registry.collect():
            if family.name.startswith("tessera:"):
                names.add(family.name)
    return names


def _family(name: str, families: set[str]) -> str | None:
    for suffix in ("", "_bucket", "_sum", "_count", "_total"):
        if suffix and not name.endswith(suffix):
            continue
        base = name[: len(name) - len(suffix)] if suffix else name
        if base in families:
            return base
    return None


def test_docs_and_dashboard_name_only_real_metrics():
    import json
    import pathlib
    import re

    import yaml

    root = pathlib.Path(__file__).resolve().parents[2]
    families = _defined_metric_families()
    assert len(families) >= 30
    docs = (root / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"`(tessera:[a-z0-9_]+)`", docs))
    assert {_family(n, families) for n in documented} == families, "docs/metrics.md and the code disagree"

    dashboard = json.loads((root / "deploy" / "grafana" / "dashboards" / "tessera.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {n for e in exprs for n in re.findall(r"tessera:[a-z0-9_]+", e)}
    unknown = sorted(n for n in used if _family(n, families) is None)
    assert not unknown, f"the dashboard queries metrics nobody exports: {unknown}"
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for wanted in ("time to first token", "inter-token", "throughput", "kv cache", "running / waiting",
                   "prefix cache hit rate"):
        assert wanted in titles, wanted

    config = yaml.safe_load((root / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {(sd["names"][0], sd["port"]) for job in config["scrape_configs"] for sd in job["dns_sd_configs"]}
    assert targets == {("frontend", 9301), ("tokenizer", 9302), ("engine", 9303)}
    assert metrics.DEFAULT_METRICS_PORTS == {"frontend": 9301, "tokenizer": 9302, "engine": 9303}
