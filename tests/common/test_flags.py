"""tessera.common.flags: flags with environment fallbacks; boolean ones as vLLM spells them."""
from __future__ import annotations

import argparse

import pytest

from tessera.common.flags import add_flag

pytestmark = pytest.mark.unit


def parser(monkeypatch, **env) -> argparse.ArgumentParser:
    for name in ("X_EAGER", "X_INVARIANT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    p = argparse.ArgumentParser()
    add_flag(p, "--enforce-eager", "X_EAGER", False, type=bool)
    add_flag(p, "--batch-invariant", "X_INVARIANT", True, type=bool)
    add_flag(p, "--max-loras", "X_LORAS", 1, type=int)
    return p


def test_a_boolean_flag_alone_is_true_and_its_no_form_false(monkeypatch):
    p = parser(monkeypatch)
    assert vars(p.parse_args([])) == {"enforce_eager": False, "batch_invariant": True, "max_loras": 1}
    assert p.parse_args(["--enforce-eager"]).enforce_eager is True
    assert p.parse_args(["--enforce-eager", "--max-loras", "2"]).max_loras == 2  # the next flag is not its value
    assert p.parse_args(["--enforce-eager", "off"]).enforce_eager is False
    assert p.parse_args(["--no-batch-invariant"]).batch_invariant is False
    assert p.parse_args(["--batch-invariant", "false"]).batch_invariant is False


def test_the_environment_sets_a_boolean_default_and_the_command_line_wins(monkeypatch, capsys):
    p = parser(monkeypatch, X_EAGER="yes", X_INVARIANT="0")
    args = p.parse_args([])
    assert args.enforce_eager is True and args.batch_invariant is False
    assert p.parse_args(["--no-enforce-eager", "--batch-invariant"]).enforce_eager is False
    with pytest.raises(SystemExit):
        p.parse_args(["--enforce-eager", "maybe"])
    assert "expected a boolean, got 'maybe'" in capsys.readouterr().err
