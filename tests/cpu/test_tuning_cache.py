import json
import logging
import multiprocessing

import pytest

from cutlass_ops.gemms.config import GemmConfig, GemmOperands, GemmProblem
from cutlass_ops.gemms.gemm_entries import SCHEMA as GEMM
from custom_kernels.core.tuned_store import (CacheScope, TuningCache, all_caches,
                                             import_documents, merge_documents, parse_documents)
from tuning.tuned_families import SCHEMAS

NORMS = SCHEMAS["norms"]

SCOPE = CacheScope("NVIDIA H200", 90, 132, "580.159.04", "13.0", "4.2.0.0", "0.1.0")
OPERANDS = GemmOperands.make("bf16")


def problem(m):
    return GemmProblem(OPERANDS, m, 4096, 4096)


def entry(ms, config=GemmConfig()):
    return {"winner": {"config": config.to_dict(), "swap_ab": False}, "winner_ms": ms,
            "torch_ms": 1.0, "runners_up": []}


def norm_problem(hidden):
    from custom_kernels.norms import norm_config as nc

    return nc.NormProblem("rms", "fwd", hidden, "bfloat16", "bfloat16", "bfloat16")


def norm_entry(ms):
    return {"winner": "t256_r1_c1_v8_s1", "winner_ms": ms, "torch_ms": 1.0}


def import_document(document, root):
    """Parses a document (as ``cutlass-tune import`` does) and imports it: entries changed."""
    documents, _ = parse_documents(document, SCHEMAS, "test")
    return import_documents(documents, root).changed


def test_round_trip_and_scope_keys(tmp_path):
    cache = TuningCache(SCOPE, GEMM, tmp_path)
    assert cache.get(problem(16)) is None
    cache.put(problem(16), entry(0.5))
    again = TuningCache(SCOPE, GEMM, tmp_path).get(problem(16))
    assert again.winner_ms == 0.5 and again.winner.config == GemmConfig()
    assert again.problem == problem(16)
    other = CacheScope(**{**SCOPE.to_dict(), "driver": "590.0"})
    assert TuningCache(other, GEMM, tmp_path).get(problem(16)) is None
    assert TuningCache(other, GEMM, tmp_path).path != cache.path
    assert json.loads(cache.path.read_text())["scope"] == SCOPE.to_dict()


def _writer(root, start):
    cache = TuningCache(SCOPE, GEMM, root)
    for m in range(start, start + 25):
        cache.put(problem(m), entry(float(m)))


def test_concurrent_processes_lose_nothing(tmp_path):
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_writer, args=(tmp_path, 1 + 100 * i)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert len(TuningCache(SCOPE, GEMM, tmp_path).entries()) == 100


@pytest.mark.parametrize("damage", [b'{"format": 1, "scope": {', b"\x00garbage", b"[1, 2]",
                                    b"\xff\xfe{}"])
def test_corrupt_file_is_set_aside_and_rebuilt(tmp_path, damage, caplog):
    cache = TuningCache(SCOPE, GEMM, tmp_path)
    cache.put(problem(16), entry(0.5))
    cache.path.write_bytes(damage)
    with caplog.at_level(logging.WARNING, logger="custom_kernels.core.cache_dir"):
        assert cache.get(problem(16)) is None
    aside, = tmp_path.glob("*.corrupt-*")
    assert f"{cache.path} " in caplog.text and f"moved it to {aside.name}" in caplog.text
    cache.put(problem(128), entry(0.7))
    assert set(cache.entries()) == {problem(128).name}


def test_listing_sets_aside_a_file_that_is_not_utf8(tmp_path, caplog):
    TuningCache(SCOPE, GEMM, tmp_path).put(problem(16), entry(0.5))
    TuningCache(SCOPE, NORMS, tmp_path).put(norm_problem(4096), norm_entry(0.1))
    bad, bad_norms = tmp_path / "bad.json", tmp_path / "norms" / "bad.json"
    bad.write_bytes(b"\xff\xfe\x00\x01 not text")
    bad_norms.write_bytes(b"\xff")
    with caplog.at_level(logging.WARNING, logger="custom_kernels.core.cache_dir"):
        assert [c.path for c in all_caches(GEMM, tmp_path)] == [
            TuningCache(SCOPE, GEMM, tmp_path).path]
        assert len(all_caches(NORMS, tmp_path)) == 1
    assert not bad.exists() and not bad_norms.exists()
    assert f"{bad} is not UTF-8 text" in caplog.text and f"{bad_norms} is not" in caplog.text
    assert len(list(tmp_path.rglob("bad.json.corrupt-*"))) == 2


def test_export_import_merge_keeps_the_faster_winner(tmp_path):
    here = TuningCache(SCOPE, GEMM, tmp_path / "here")
    there = TuningCache(SCOPE, GEMM, tmp_path / "there")
    here.put(problem(16), entry(0.5))
    here.put(problem(128), entry(0.9))
    there.put(problem(128), entry(0.6, GemmConfig(tile=(64, 128, 64))))
    there.put(problem(1024), entry(2.0))
    assert import_document(there.export(), tmp_path / "here") == 2
    merged = here.entries()
    assert set(merged) == {problem(m).name for m in (16, 128, 1024)}
    assert merged[problem(128).name].winner_ms == 0.6
    assert import_document(there.export(), tmp_path / "here") == 0
    with pytest.raises(ValueError, match="export"):
        import_document({"format": 99}, tmp_path)
    here.clear()
    assert here.entries() == {}


def test_families_keep_apart_through_export_import_and_merge(tmp_path):
    gemm, norms = TuningCache(SCOPE, GEMM, tmp_path / "a"), TuningCache(SCOPE, NORMS, tmp_path / "a")
    assert gemm.path != norms.path and norms.path.parent.name == "norms"
    gemm.put(problem(16), entry(0.5))
    norms.put(norm_problem(4096), norm_entry(0.1))
    assert [c.family for c in all_caches(GEMM, tmp_path / "a")] == ["gemm"]
    assert [c.family for c in all_caches(NORMS, tmp_path / "a")] == ["norms"]
    documents = [parse_documents(doc, SCHEMAS, "test")[0][0]
                 for doc in (gemm.export(), norms.export())]
    merged = merge_documents(documents)
    assert sorted(d.schema.family for d in merged) == ["gemm", "norms"]
    assert import_documents(merged, tmp_path / "b").changed == 2
    assert TuningCache(SCOPE, GEMM, tmp_path / "b").get(problem(16)).winner_ms == 0.5
    assert TuningCache(SCOPE, NORMS, tmp_path / "b").get(norm_problem(4096)).winner_ms == 0.1
    legacy = {k: v for k, v in gemm.export().items() if k != "family"}  # older exports: GEMM
    assert import_document(legacy, tmp_path / "c") == 1
    assert TuningCache(SCOPE, GEMM, tmp_path / "c").get(problem(16)) is not None
    documents, rejections = parse_documents({**gemm.export(), "family": "softmax"}, SCHEMAS, "x")
    assert documents == [] and "unknown kernel family 'softmax'" in rejections[0].reason


def test_a_file_is_parsed_once_while_it_stays_the_same(tmp_path, monkeypatch):
    cache = TuningCache(SCOPE, GEMM, tmp_path)
    cache.put(problem(16), entry(0.5))
    calls = []
    real = GEMM.parse
    monkeypatch.setattr(type(GEMM), "parse", lambda self, *a: calls.append(a) or real(*a))
    for _ in range(5):
        assert cache.get(problem(16)) is not None
    assert len(calls) <= 1
    cache.put(problem(32), entry(0.5))  # a new file: read again
    assert cache.get(problem(32)) is not None
