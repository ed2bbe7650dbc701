"""Unit tests of tessera.common.cpu_load: the machine's busy CPU seconds."""
from __future__ import annotations

import time

import pytest

from tessera.common.cpu_load import system_busy_s

pytestmark = pytest.mark.unit


def test_busy_seconds_grow_while_this_process_computes():
    before = system_busy_s()
    assert before is not None and before > 0
    started = time.process_time()
    while time.process_time() - started < 0.3:  # this process's own CPU time: 0.3 s
        pass
    assert system_busy_s() - before >= 0.2
