"""Compiled code loads only from a cache no other user can write to (custom_kernels.core.
cache_trust): the build cache, the loaders and dispatch refuse a cache root or a build directory
writable by group or others, or owned by another user; the library creates its directories
private; each directory is checked once per process."""

import os
import stat

import pytest

from custom_kernels.core import build_cache, cache_dir, cache_trust
from custom_kernels.core.errors import UnsafeCacheError

ELF = b"\x7fELF\x02\x01" + b"\0" * 58  # a header whose tables end at once: whole


def _build(out):
    out.write_bytes(ELF)
    return build_cache.Built({"names": "x"})


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A fresh cache root, as the library creates it (private)."""
    path = tmp_path / "cache"
    monkeypatch.setenv(cache_dir.ENV_VAR, str(path))
    cache_dir.versioned_dir()
    return path.resolve()


def _entry():
    return build_cache.file_entry(build_cache.entry_path("nvrtc", "sm_90a", "k", "0" * 20)
                                  .with_suffix(".cubin"))


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_directories_the_library_creates_are_private_whatever_the_umask(root):
    previous = os.umask(0o002)  # a user-private-group default: new directories group-writable
    try:
        built = build_cache.get_or_build(_entry(), _build).path
    finally:
        os.umask(previous)
    assert _mode(root) == 0o700
    for directory in built.relative_to(root).parents:
        assert _mode(root / directory) == 0o700
    assert not _mode(built) & (stat.S_IWGRP | stat.S_IWOTH)  # the compiler's 0o664, made 0o644


@pytest.mark.parametrize("where", ["root", "build dir"])
def test_a_cache_writable_by_others_is_refused_with_the_fix(root, where):
    entry = _entry()
    built = build_cache.get_or_build(entry, _build).path
    cache_trust.forget()  # as a new process would
    unsafe = root if where == "root" else built.parent
    os.chmod(unsafe, 0o777 if where == "root" else 0o770)
    with pytest.raises(UnsafeCacheError) as refused:
        build_cache.get_or_build(entry, _build)
    message = str(refused.value)
    assert refused.value.path == str(unsafe) and f"`chmod go-w {unsafe}`" in message
    assert "writable by group" in message and cache_dir.ENV_VAR in message
    os.chmod(unsafe, 0o700)  # fixed: the next load in the same process passes
    assert build_cache.get_or_build(entry, _build).path == built


def test_an_unsafe_cache_is_refused_before_building(root):
    os.chmod(root, 0o775)
    calls = []
    with pytest.raises(UnsafeCacheError, match="writable by group"):
        build_cache.get_or_build(_entry(), lambda out: calls.append(out) or _build(out))
    assert calls == []  # no minute of nvcc for a kernel that would never be loaded


def test_a_cache_owned_by_another_user_is_refused(root):
    if os.geteuid() != 0:
        pytest.skip("giving a directory away needs root")
    entry = _entry()
    build_cache.get_or_build(entry, _build)
    cache_trust.forget()
    arch_dir = entry.artifact.parent
    os.chown(arch_dir, 4242, -1)
    with pytest.raises(UnsafeCacheError, match="belongs to user id 4242"):
        build_cache.get_or_build(entry, _build)
    os.chown(arch_dir, 0, -1)  # root-owned is fine
    build_cache.get_or_build(entry, _build)


def test_each_directory_is_checked_once_per_process(root, monkeypatch):
    entry = _entry()
    first = build_cache.get_or_build(entry, _build).path
    second = build_cache.get_or_build(build_cache.file_entry(first.with_name("j.cubin")),
                                      _build).path
    cache_trust.forget()
    stats = []
    inspect = cache_trust._inspect

    def counting_inspect(path):
        stats.append(str(path))
        return inspect(path)

    monkeypatch.setattr(cache_trust, "_inspect", counting_inspect)
    chain = [root, *reversed(first.relative_to(root).parents[:-1]), first]
    cache_trust.require_private(first)
    assert stats == [str(root / p) for p in chain]
    stats.clear()
    cache_trust.require_private(first)
    cache_trust.require_private(second)
    assert stats == [str(second)]  # its directories were checked already


def test_a_file_outside_the_cache_is_checked_with_its_directory(tmp_path, root):
    library = tmp_path / "elsewhere" / "kernel.so"
    library.parent.mkdir(mode=0o755)
    library.write_bytes(ELF)
    cache_trust.require_private(library)
    os.chmod(library, 0o666)
    cache_trust.forget()
    with pytest.raises(UnsafeCacheError, match="kernel.so is writable by group and others"):
        cache_trust.require_private(library)


def test_loaders_refuse_before_loading(root, monkeypatch):
    import ctypes

    from custom_kernels import jit
    from cutlass_ops.gemms import runtime

    built = build_cache.get_or_build(_entry(), _build).path
    cache_trust.forget()
    os.chmod(root, 0o777)
    monkeypatch.setattr(ctypes, "CDLL", lambda *a: pytest.fail("loaded an unsafe library"))
    with pytest.raises(UnsafeCacheError, match="chmod go-w"):
        runtime.LoadedKernel(built, "fake")
    monkeypatch.setattr(jit, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(jit, "compile_cubin", lambda *a, **k: built)
    with pytest.raises(UnsafeCacheError, match="chmod go-w"):
        jit._load("norms.cu", "kernel", {}, 0)


def test_the_dsl_cache_is_used_only_when_private(root, monkeypatch):
    from cutlass_ops.gemms import dsl

    monkeypatch.delenv(dsl.CACHE_ENV, raising=False)
    monkeypatch.setattr(dsl, "_prepared", None)
    os.chmod(root, 0o777)
    with pytest.raises(UnsafeCacheError, match="writable by group and others"):
        dsl._interface()
    assert dsl.CACHE_ENV not in os.environ


def test_matmul_treats_an_unsafe_cache_as_nothing_built(root, warnings):
    """cutlass_ops.matmul chooses its kernel: a built kernel in an unsafe cache is not one it
    can run, so dispatch sees nothing built and runs torch.matmul, with one warning naming the
    path and the fix (cutlass_ops.gemm, which names its kernel, raises UnsafeCacheError)."""
    from cutlass_ops.gemms import build, dispatch, emit, loader
    from cutlass_ops.gemms.choice import Choice
    from cutlass_ops.gemms.config import GemmConfig, GemmOperands

    if not build.nvcc_available():
        pytest.skip("nvcc not found (the artifact's key names its version)")
    operands, config = GemmOperands.make("bf16"), GemmConfig(tile=(64, 16, 128))
    cache_dir.atomic_write_text(emit._emitted_path(operands, config), "// emitted")
    spec = loader.build_spec(operands, config, "// emitted")
    cache_dir.make_private_dirs(spec.directory)
    (spec.directory / build.LIBRARY).write_bytes(ELF)
    assert dispatch.built_choices(operands, "sm90a") == [Choice(config)]
    cache_trust.forget()
    os.chmod(root, 0o777)
    for _ in range(2):
        assert not loader.is_built(operands, config)
        assert dispatch.built_choices(operands, "sm90a") == []
    lines = [line for line in warnings() if "refuses to load compiled code" in line]
    assert len(lines) == 1 and f"chmod go-w {root}" in lines[0]
    with pytest.raises(UnsafeCacheError):
        loader.kernel_for(operands, config)


def test_the_session_cache_root_of_the_tests_is_private():
    """tests/conftest.py's root (pytest's tmp directories are 0o700): the suites load from it."""
    cache_trust.require_private(cache_dir.versioned_dir())
