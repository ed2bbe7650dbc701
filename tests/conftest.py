"""Shared test setup: offline Hugging Face, quiet tokenizers, no metrics port unless a test picks one;
and the check that every test is exactly one of `unit` / `integration` (tests/README.md)."""
import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Service processes started by tests serve no /metrics unless the test gives them a port
# (tests/helpers/stack.py gives every service a free one), so parallel runs never fight over 9301-9303.
os.environ.setdefault("TESSERA_METRICS_PORT", "0")
# The engines' quantized-crossover timings (quantized_crossover.py) go to a cache of the run's
# own, not the developer's ~/.cache/tessera.
os.environ.setdefault("TESSERA_CACHE_DIR", tempfile.mkdtemp(prefix="tessera-test-cache-"))

# Fixtures that make any test using them slow (over ~20 s for the first user, or HF equality):
SLOW_FIXTURES = {
    "generic_kernels",  # compiles the generic CPU-kernel variant (~25-55 s, once a session)
    "loaded_fp32", "make_core", "hf_greedy",  # the default model in fp32 / HF transformers' generate on it
    "mistral",  # a random HF Mistral saved and loaded, compared with HF's generate
}
# Parametrized fixtures whose value makes a test slow: test_cpu_kernels.py's `kernels` fixture
# takes generic_kernels by request.getfixturevalue, which item.fixturenames does not show.
SLOW_PARAMS = {("kernels", "generic")}
# Fixtures that start service processes: a test using one cannot be `unit`.
PROCESS_FIXTURES = {"stack", "client", "model"}


@pytest.fixture(scope="session")
def generic_kernels(tmp_path_factory):
    """The baseline variant an image ships (scalar paths), built as `--variants` builds it and
    loaded as TESSERA_CPU_KERNELS_PREBUILT=<dir> loads it: here, so that the modules that compare
    it with the native build share one build (a fixture imported into each would build it again)."""
    from tessera_engine import cpu_kernels

    out = tmp_path_factory.mktemp("kernel-variants")
    built = cpu_kernels.build_variants(out, ["generic"])
    assert [p.name.split(".")[0] for p in built] == ["tessera_cpu_kernels_generic"]
    module = cpu_kernels._load_prebuilt(str(out))
    assert module.variant == "generic"
    return module


def pytest_collection_modifyitems(config, items):
    """Adds `slow` to tests using a SLOW_FIXTURES fixture or a SLOW_PARAMS value; refuses a test that is not exactly one
    of unit / integration, or a `unit` test that uses the stack."""
    wrong = []
    for item in items:
        names = {m.name for m in item.iter_markers()}
        fixtures = set(getattr(item, "fixturenames", ()))
        kinds = names & {"unit", "integration"}
        if len(kinds) != 1:
            wrong.append(f"{item.nodeid}: marked {sorted(kinds) or 'neither'}; mark it unit or integration")
        elif "unit" in kinds and fixtures & PROCESS_FIXTURES:
            wrong.append(f"{item.nodeid}: marked unit but uses {sorted(fixtures & PROCESS_FIXTURES)}")
        params = getattr(getattr(item, "callspec", None), "params", {})
        slow_param = any(params.get(name) == value for name, value in SLOW_PARAMS)
        if (fixtures & SLOW_FIXTURES or slow_param) and "slow" not in names:
            item.add_marker(pytest.mark.slow)
    if wrong:
        raise pytest.UsageError("tests without a clear class (tests/README.md):\n  " + "\n  ".join(wrong))
