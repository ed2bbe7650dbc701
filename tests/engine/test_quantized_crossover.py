"""Unit tests of the quantized/dense crossover timing (tessera_engine.quantized_crossover)."""
from __future__ import annotations

import itertools
import json
import time

import pytest
import torch

from tessera_engine import quantized_crossover as qc
from tessera_engine.models.llama import MatmulPair

pytestmark = pytest.mark.unit


def _pairs(ms_per_row: float, dense_ms: float) -> list[MatmulPair]:
    """One fake matmul whose quantized pass costs ms_per_row a row and dense pass a flat dense_ms."""
    return [MatmulPair(8, (8, 8, 3), lambda x: time.sleep(x.shape[0] * ms_per_row / 1000),
                       lambda x: time.sleep(dense_ms / 1000))]


class Model:
    """What crossover_rows reads of a model: its matmul pairs."""

    def matmul_pairs(self):
        return _pairs(1.0, 1.0)


class Ops:
    """What crossover_rows reads of the ops: the quantized matmul's kind and the dense packing."""
    quantized_matmul = "exact"

    class dense_packing:
        name = "test"


def test_bisection_finds_the_last_row_count_where_the_quantized_pass_wins():
    rows, timings = qc.measure(_pairs(4.0, 18.0), torch.float32)  # wins up to 4 rows (16 < 18 ms), loses at 6
    assert rows == 4
    assert all((ratio < 1) == (r <= 4) for r, (_, _, ratio) in timings.items())
    assert len(timings) < len(qc.CANDIDATE_ROWS)  # bisection, not every candidate


def test_no_rows_when_the_quantized_pass_loses_at_one_row():
    assert qc.measure(_pairs(20.0, 5.0), torch.float32)[0] == 0


def test_a_quiet_measurement_is_cached_and_a_busy_one_is_not(monkeypatch, tmp_path):
    assert qc.ATTEMPTS == 3
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(qc, "_measured", {})
    answers = iter([3, 6, 2, 3])  # what each timing finds

    def measure(pairs, dtype):
        return next(answers), {3: (1.0, 2.0, 0.5)}

    monkeypatch.setattr(qc, "measure", measure)

    busy = itertools.count(0.0, 100.0)  # the machine's busy seconds jump: someone else runs
    monkeypatch.setattr(qc, "system_busy_s", lambda: next(busy))
    rows, why = qc.crossover_rows(Model(), Ops(), torch.float32)
    # timed ATTEMPTS times, busy each time: the middle answer (of 3, 6, 2), not cached
    assert rows == 3 and "not cached" in why and not qc.cache_path().exists()
    assert qc.crossover_rows(Model(), Ops(), torch.float32)[1] == "timed by this process for an earlier engine"

    monkeypatch.setattr(qc, "_measured", {})
    monkeypatch.setattr(qc, "system_busy_s", lambda: 0.0)
    rows, why = qc.crossover_rows(Model(), Ops(), torch.float32)
    assert rows == 3 and "cached" in why
    table = json.loads(qc.cache_path().read_text())
    assert [e["rows"] for e in table.values()] == [3]

    monkeypatch.setattr(qc, "_measured", {})
    monkeypatch.setattr(qc, "measure", lambda pairs, dtype: pytest.fail("measured again despite the cache"))
    rows, why = qc.crossover_rows(Model(), Ops(), torch.float32)
    assert rows == 3 and "before" in why


def test_a_prompt_chunk_is_timed_once_at_prompt_rows_and_the_answer_cached(monkeypatch, tmp_path):
    """prompt_rows_dense: both paths over the decoder layers at PROMPT_ROWS rows; a quiet
    answer cached apart from the crossover's (its own key and field)."""
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(qc, "_measured", {})
    monkeypatch.setattr(qc, "system_busy_s", lambda: 0.0)
    monkeypatch.setattr(qc, "PROMPT_ROWS", 8)
    rows_seen = []

    class Model:
        def __init__(self, ms_per_row, dense_ms):
            self.pairs = _pairs(ms_per_row, dense_ms)

        def matmul_pairs(self, lm_head=True):
            assert lm_head is False  # the lm_head stays quantized for every row
            return [p._replace(quantized=lambda x, f=p.quantized: (rows_seen.append(x.shape[0]), f(x)))
                    for p in self.pairs]

    class Ops:
        quantized_matmul = "int8"

        class dense_packing:
            name = "test"

    dense, why = qc.prompt_rows_dense(Model(1.0, 4.0), Ops(), torch.float32)  # 8 ms quantized, 4 dense
    assert dense is True and "dense faster on 8-row" in why and "cached" in why
    assert set(rows_seen) == {8}
    table = json.loads(qc.cache_path().read_text())
    assert [e["prompt_dense"] for e in table.values()] == [True]
    monkeypatch.setattr(qc, "_measured", {})
    monkeypatch.setattr(qc, "measure_prompt_rows", lambda pairs, dtype: pytest.fail("timed again despite the cache"))
    assert qc.prompt_rows_dense(Model(1.0, 4.0), Ops(), torch.float32)[0] is True


_SAPPHIRE = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Processor
stepping\t: 8
flags\t\t: fpu avx2 avx512f avx512_vnni amx_int8 amx_bf16 amx_tile
"""


def test_the_cache_tells_apart_cpus_that_a_vm_names_alike():
    # a VM names only the vendor: the same name over hosts of other generations and ISAs
    same = qc.cpu_identity(_SAPPHIRE, "L2=2048K,L3=107520K")
    assert qc.cpu_identity(_SAPPHIRE, "L2=2048K,L3=107520K") == same
    assert same.startswith("Intel(R) Xeon(R) Processor|6/143/8|")
    emerald = _SAPPHIRE.replace("model\t\t: 143", "model\t\t: 207").replace("stepping\t: 8", "stepping\t: 2")
    no_amx = _SAPPHIRE.replace(" amx_int8 amx_bf16 amx_tile", "")
    others = {qc.cpu_identity(emerald, "L2=2048K,L3=107520K"), qc.cpu_identity(no_amx, "L2=2048K,L3=107520K"),
              qc.cpu_identity(_SAPPHIRE, "L2=2048K,L3=327680K")}
    assert len(others) == 3 and same not in others
    # the flags' order in /proc/cpuinfo does not matter
    shuffled = _SAPPHIRE.replace("fpu avx2 avx512f", "avx512f fpu avx2")
    assert qc.cpu_identity(shuffled, "L2=2048K,L3=107520K") == same


def test_a_cached_answer_is_not_read_on_another_cpu_of_the_same_name(monkeypatch, tmp_path):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(qc, "_measured", {})
    monkeypatch.setattr(qc, "system_busy_s", lambda: 0.0)
    timed = []
    monkeypatch.setattr(qc, "measure", lambda pairs, dtype: (timed.append(1) or 4, {4: (1.0, 2.0, 0.5)}))

    monkeypatch.setattr(qc, "cpu_identity", lambda: "Intel(R) Xeon(R) Processor|6/143/8|L3=105M|flags=a")
    assert qc.crossover_rows(Model(), Ops(), torch.float32)[0] == 4 and len(timed) == 1
    monkeypatch.setattr(qc, "_measured", {})
    assert "before" in qc.crossover_rows(Model(), Ops(), torch.float32)[1] and len(timed) == 1
    monkeypatch.setattr(qc, "_measured", {})
    monkeypatch.setattr(qc, "cpu_identity", lambda: "Intel(R) Xeon(R) Processor|6/106/6|L3=48M|flags=b")
    assert "timed at start" in qc.crossover_rows(Model(), Ops(), torch.float32)[1] and len(timed) == 2
