"""custom_kernels.jit and custom_kernels.launch without a GPU: include paths, cache keys and paths,
cache hits, corrupt entries, errors."""

import hashlib
import json
from pathlib import Path

import pytest

from custom_kernels import jit, launch
from custom_kernels.core import build_cache, cache_dir
from custom_kernels.core.errors import BuildError, ToolchainError


def _toolkit_or_skip():
    try:
        return jit.include_dirs()
    except ToolchainError as exc:
        pytest.skip(str(exc))


def test_include_dirs_hold_toolkit_cccl_and_csrc():
    dirs = _toolkit_or_skip()
    assert dirs[-1] == str(jit.CSRC)
    assert all(Path(d).is_dir() for d in dirs)
    assert any((Path(d) / "cuda_bf16.h").is_file() for d in dirs)


def test_cache_key_covers_defines_names_and_arch():
    _toolkit_or_skip()
    base = jit.cache_key("norms.cu", {"A": 1, "B": "x"}, ("k",), "sm_90a")
    assert base == jit.cache_key("norms.cu", {"B": "x", "A": 1}, ("k",), "sm_90a")
    assert base != jit.cache_key("norms.cu", {"A": 2, "B": "x"}, ("k",), "sm_90a")
    assert base != jit.cache_key("norms.cu", {"A": 1}, ("k",), "sm_90a")
    assert base != jit.cache_key("norms.cu", {"A": 1, "B": "x"}, ("k2",), "sm_90a")
    assert base != jit.cache_key("norms.cu", {"A": 1, "B": "x"}, ("k",), "sm_100a")
    assert base != jit.cache_key("cluster_reduce.cuh", {"A": 1, "B": "x"}, ("k",), "sm_90a")


def test_cache_key_covers_every_csrc_file(monkeypatch, tmp_path):
    _toolkit_or_skip()
    (tmp_path / "a.cu").write_text("// a\n")
    (tmp_path / "h.cuh").write_text("// h\n")
    monkeypatch.setattr(jit, "CSRC", tmp_path)
    before = jit.cache_key("a.cu")
    (tmp_path / "h.cuh").write_text("// h changed\n")
    assert jit.cache_key("a.cu") != before


def test_cache_key_is_the_one_existing_cubin_caches_were_built_under():
    """sha256 of the sorted-key JSON payload: a change here would recompile every cached cubin."""
    _toolkit_or_skip()
    payload = {"source": "norms.cu", "csrc": jit._csrc_digest(), "defines": [["A", "1"]],
               "names": ["k"], "arch": "sm_90a", "nvrtc": jit.nvrtc_version(),
               "cuda.core": jit._cuda_core_version(), "include": list(jit.include_dirs()),
               "options": {"std": "c++17", "lineinfo": True}}
    legacy = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]
    assert jit.cache_key("norms.cu", {"A": 1}, ("k",), "sm_90a") == legacy


def test_cubin_path_is_versioned_and_readable(cache_root):
    _toolkit_or_skip()
    path = jit.cubin_path("norms.cu", {"NORM_PART": 0}, ("norm_fwd",), "sm_90a")
    assert path.parent == cache_dir.versioned_dir("nvrtc", "sm_90a")
    assert str(path).startswith(str(Path(cache_root).resolve()))
    assert path.name.startswith("norms-") and path.suffix == ".cubin"


def test_cached_cubin_is_returned_without_nvrtc():
    _toolkit_or_skip()
    defines = {"TEST_CACHED_ENTRY": 1}
    path = jit.cubin_path("norms.cu", defines, ("norm_fwd",))
    cache_dir.atomic_write_json(path.with_suffix(".json"), {"norm_fwd": "_Z8norm_fwdv"})
    cache_dir.atomic_write_bytes(path, b"not really a cubin")
    assert jit.compile_cubin("norms.cu", defines=defines, name_expressions=("norm_fwd",)) == path


def test_entry_without_symbol_table_is_set_aside():
    _toolkit_or_skip()
    defines = {"TEST_CORRUPT_ENTRY": 1}
    path = jit.cubin_path("norms.cu", defines, ("norm_fwd",))
    cache_dir.atomic_write_bytes(path, b"cubin")
    path.with_suffix(".json").write_text("{not json")
    entry = jit._entry(path, ("norm_fwd",))
    assert not build_cache.is_complete(entry, repair=True)
    assert not path.exists()
    assert list(path.parent.glob(path.with_suffix(".json").name + ".corrupt-*"))
    assert list(path.parent.glob(path.name + ".corrupt-*"))


def test_symbol_table_without_the_name_asked_for_is_incomplete():
    _toolkit_or_skip()
    path = jit.cubin_path("norms.cu", {"TEST_OTHER_NAME": 1}, ("norm_fwd",))
    cache_dir.atomic_write_json(path.with_suffix(".json"), {"norm_bwd": "_Z8norm_bwdv"})
    cache_dir.atomic_write_bytes(path, b"cubin")
    assert not build_cache.is_complete(jit._entry(path, ("norm_fwd",)))
    assert build_cache.is_complete(jit._entry(path, ("norm_bwd",)))


def test_missing_source_is_reported():
    with pytest.raises(FileNotFoundError, match="no_such.cu"):
        jit.compile_cubin("no_such.cu")


def test_compile_error_keeps_the_log(monkeypatch, tmp_path):
    _toolkit_or_skip()
    (tmp_path / "broken.cu").write_text("__global__ void k() { this is not C++; }\n")
    monkeypatch.setattr(jit, "CSRC", tmp_path)
    if jit.nvrtc_version() == "unavailable":
        with pytest.raises(ToolchainError, match="NVRTC"):
            jit.compile_cubin("broken.cu", name_expressions=("k",))
        return
    with pytest.raises(BuildError) as info:
        jit.compile_cubin("broken.cu", name_expressions=("k",))
    log = Path(info.value.log_path)
    assert "error" in log.read_text() and "error" in str(info.value)
    record = json.loads(log.with_suffix(".failed.json").read_text())
    assert record["summary"] and not list(log.parent.glob(log.stem + ".cubin*"))
    # NVRTC failures are not kept: the next call compiles again.
    calls = []
    real = jit._nvrtc
    monkeypatch.setattr(jit, "_nvrtc", lambda *args: calls.append(args) or real(*args))
    with pytest.raises(BuildError):
        jit.compile_cubin("broken.cu", name_expressions=("k",))
    assert len(calls) == 1


def test_symbol_table_is_json_beside_the_cubin():
    _toolkit_or_skip()
    if jit.nvrtc_version() == "unavailable":
        pytest.skip("NVRTC is not installed here")
    path = jit.compile_cubin("norms.cu", defines={"NORM_PART": 2}, name_expressions=(
        "norm_dw_reduce",))
    mapping = json.loads(path.with_suffix(".json").read_text())
    assert mapping["norm_dw_reduce"].startswith("_Z")


def test_cluster_grid_counts_blocks_like_cuda_cpp():
    assert launch._cluster_grid(32, 4) == 8
    assert launch._cluster_grid((16, 3), 8) == (2, 3)
    with pytest.raises(ValueError, match="multiple"):
        launch._cluster_grid(10, 4)
