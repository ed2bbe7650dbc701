"""Helpers for the metrics and health tests: scrape a /metrics endpoint, read samples,
read a service's JSON log lines, poll until something holds (an engine's gauges reading idle)."""
from __future__ import annotations

import json
import pathlib
import time
import urllib.error
import urllib.request
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body); HTTP errors are answers too."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


class Scrape:
    """One /metrics scrape: every sample by (name, labels)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples: dict[tuple[str, frozenset], float] = {}
        self.names: set[str] = set()
        for family in text_string_to_metric_families(text):
            self.names.add(family.name)
            for s in family.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value
        self.sample_names = {name for name, _ in self.samples}

    def get(self, name: str, **labels) -> float:
        """Sum of the samples named `name` whose labels include `labels` (0 when none)."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= ls)

    def has(self, name: str) -> bool:
        return name in self.sample_names

    def __sub__(self, before: "Scrape") -> "Delta":
        return Delta(self, before)


class Delta:
    def __init__(self, after: Scrape, before: Scrape) -> None:
        self.after, self.before = after, before

    def get(self, name: str, **labels) -> float:
        return self.after.get(name, **labels) - self.before.get(name, **labels)


def scrape(base_url: str) -> Scrape:
    status, body = http_get(base_url + "/metrics")
    assert status == 200, f"/metrics answered {status}: {body[:500]}"
    return Scrape(body)


def try_scrape(base_url: str) -> Scrape | None:
    try:
        return scrape(base_url)
    except (OSError, AssertionError):
        return None


def health_http(base_url: str) -> int | None:
    try:
        return http_get(base_url + "/health", timeout=2)[0]
    except OSError:
        return None


def wait_for(check: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    """Poll `check` until it returns something truthy; return it (AssertionError after timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_engine_gauges_idle(metrics_url: str, timeout: float = 10.0) -> Scrape:
    """Scrape an engine's /metrics until its gauges read idle (nothing running or waiting, no KV
    cache in use): the last step's metrics are recorded. Returns that scrape."""
    def idle():
        m = scrape(metrics_url)
        return m if (m.get("tessera:num_requests_running") == 0 and m.get("tessera:num_requests_waiting") == 0
                     and m.get("tessera:kv_cache_usage_perc") == 0) else None
    return wait_for(idle, timeout, "the engine's gauges to read idle")


def json_lines(path: pathlib.Path) -> list[dict]:
    """The JSON log lines of a service's log file (other lines are skipped)."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out
