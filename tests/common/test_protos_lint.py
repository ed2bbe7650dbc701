"""The protos pass `buf lint` with protos/buf.yaml's rule set (buf's STANDARD), and the only
exceptions are the per-RPC ignore comments of the RPCs that predate it.

The lint runs buf from npm (`npx --yes @bufbuild/buf@<version>`): skipped, with the reason, when
npx is not installed or the package cannot be fetched (offline).
"""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

PROTOS = pathlib.Path(__file__).resolve().parents[2] / "protos"
BUF = "@bufbuild/buf@1.75.0"
BUF_FILE_ANNOTATIONS = 100  # buf's exit code when it found lint failures

# The RPCs whose message names predate the rule set (protos/buf.yaml): service.rpc -> the rules
# their ignore comments may name. A new RPC follows every rule.
LEGACY_RPCS = {
    "FrontendService.Generate", "FrontendService.Complete", "FrontendService.ListLoRAAdapters",
    "FrontendService.LoadLoRAAdapter", "FrontendService.UnloadLoRAAdapter",
    "EngineService.Session", "EngineService.GetStats", "EngineService.GetInfo", "EngineService.LoadLoRAAdapter",
    "EngineService.UnloadLoRAAdapter", "EngineService.ListLoRAAdapters",
    "TokenizerService.GetModelInfo",
}
LEGACY_RULES = {"RPC_REQUEST_STANDARD_NAME", "RPC_RESPONSE_STANDARD_NAME", "RPC_REQUEST_RESPONSE_UNIQUE"}


def ignored_rules() -> dict[str, set[str]]:
    """service.rpc -> the rules its `// buf:lint:ignore` comments name, over every .proto;
    an ignore comment on anything but an RPC is keyed by its file and line."""
    found: dict[str, set[str]] = {}
    for path in sorted((PROTOS / "tessera" / "v1").glob("*.proto")):
        service, pending = "", []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if m := re.match(r"\s*service\s+(\w+)", line):
                service = m.group(1)
            if m := re.match(r"\s*//\s*buf:lint:ignore\s+(\w+)", line):
                pending.append((m.group(1), f"{path.name}:{number}"))
                continue
            if line.strip().startswith("//"):
                continue
            rpc = re.match(r"\s*rpc\s+(\w+)", line)
            for rule, where in pending:
                found.setdefault(f"{service}.{rpc.group(1)}" if rpc else where, set()).add(rule)
            pending = []
    return found


@pytest.mark.unit
def test_only_the_legacy_rpcs_ignore_rules():
    ignored = ignored_rules()
    assert set(ignored) <= LEGACY_RPCS, f"ignore comments beyond the legacy RPCs: {set(ignored) - LEGACY_RPCS}"
    assert set().union(*ignored.values()) <= LEGACY_RULES


@pytest.mark.unit
@pytest.mark.slow
def test_buf_lint():
    if shutil.which("npx") is None:
        pytest.skip("npx is not installed: buf lint runs from npm (@bufbuild/buf)")
    try:
        done = subprocess.run(["npx", "--yes", BUF, "lint"], cwd=PROTOS, capture_output=True, text=True,
                              timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip(f"npx {BUF} took over 300 s (fetching it offline?)")
    if done.returncode not in (0, BUF_FILE_ANNOTATIONS) and "npm error" in done.stderr:
        pytest.skip(f"npx could not fetch {BUF} (offline?): {done.stderr.strip()[-400:]}")
    assert done.returncode == 0, f"buf lint (protos/buf.yaml):\n{done.stdout}{done.stderr}"
