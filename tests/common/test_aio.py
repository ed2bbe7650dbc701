"""tessera.common.aio: the services' event loop choice (--event-loop / TESSERA_EVENT_LOOP)."""
from __future__ import annotations

import argparse

import pytest

from tessera.common import aio
from tessera.common.flags import add_common_flags

pytestmark = pytest.mark.unit


async def _which() -> str:
    return aio.loop_name()


def test_auto_takes_uvloop_when_installed():
    pytest.importorskip("uvloop")
    assert aio.run(_which(), "auto") == "uvloop"
    assert aio.run(_which(), "uvloop") == "uvloop"


def test_asyncio_is_the_standard_loop():
    assert aio.run(_which(), "asyncio") == "asyncio"


def test_unknown_loop_is_refused():
    with pytest.raises(ValueError, match="event loop must be one of"):
        aio.uvloop_module("trio")


def test_flag_and_env(monkeypatch):
    parser = argparse.ArgumentParser()
    add_common_flags(parser, 1, "X_PORT")
    assert parser.parse_args([]).event_loop == "auto"
    assert parser.parse_args(["--event-loop", "asyncio"]).event_loop == "asyncio"
    monkeypatch.setenv("TESSERA_EVENT_LOOP", "asyncio")
    parser = argparse.ArgumentParser()
    add_common_flags(parser, 1, "X_PORT")
    assert parser.parse_args([]).event_loop == "asyncio"
    with pytest.raises(SystemExit):
        parser.parse_args(["--event-loop", "trio"])
