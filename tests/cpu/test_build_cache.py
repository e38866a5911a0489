"""custom_kernels.core.build_cache with fake build functions: keys, building once across threads
and processes, failure records, corrupt entries, interrupted builds."""

import json
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from custom_kernels.core import build_cache
from custom_kernels.core.errors import BuildError, ToolchainError
from custom_kernels.core.version import __version__


def _elf(size: int, tables_end: int) -> bytes:
    """A 64-bit little-endian ELF image of ``size`` bytes whose section table ends at
    ``tables_end``."""
    head = bytearray(64)
    head[:6] = b"\x7fELF\x02\x01"
    # No program headers; two 64-byte section headers, the last thing in the file as linkers
    # lay it out.
    struct.pack_into("<QQ", head, 0x20, 64, tables_end - 2 * 64)
    struct.pack_into("<HHHH", head, 0x36, 56, 0, 64, 2)
    return bytes(head) + b"\0" * (size - 64)


WHOLE = _elf(1024, 1024)


class FakeBuild:
    """A build function that counts its calls and writes ``data`` (or fails with ``log``)."""

    def __init__(self, data: bytes = WHOLE, sidecar=None, log: str = "", fail: str | None = None,
                 seconds: float = 0.0):
        self.data, self.sidecar, self.log, self.fail = data, sidecar, log, fail
        self.seconds = seconds
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, out: Path) -> build_cache.Built:
        with self.lock:
            self.calls += 1
        time.sleep(self.seconds)
        if self.fail is not None:
            raise build_cache.BuildFailed(self.fail)
        out.write_bytes(self.data)
        return build_cache.Built({"names": "x"} if self.sidecar is None else self.sidecar,
                                 self.log)


@pytest.fixture
def entry(tmp_path) -> build_cache.Entry:
    return build_cache.file_entry(tmp_path / "kernel-0123456789abcdef0123.cubin")


def test_key_is_stable_and_ignores_the_order_of_the_payload():
    # Pinned: existing caches are found under these hashes.
    assert build_cache.key({"a": "x", "b": [1, 2]}) == "5125d018f84d57c49a8d"
    assert build_cache.key({"b": [1, 2], "a": "x"}) == "5125d018f84d57c49a8d"
    assert build_cache.key({"a": "x", "b": [2, 1]}) != "5125d018f84d57c49a8d"
    assert build_cache.digest(b"ab") != build_cache.digest(b"ab ")


def test_an_entry_under_an_earlier_key_is_adopted_once(tmp_path):
    legacy, directory = tmp_path / "k-old", tmp_path / "k-new"
    build_cache.adopt(directory, legacy, "kernel.so")  # nothing to adopt: nothing happens
    assert not directory.exists()
    legacy.mkdir()
    build_cache.adopt(directory, legacy, "kernel.so")  # no artifact in it: left alone
    assert legacy.exists() and not directory.exists()
    (legacy / "kernel.so").write_bytes(b"\x7fELF")
    build_cache.adopt(directory, legacy, "kernel.so")
    assert (directory / "kernel.so").read_bytes() == b"\x7fELF" and not legacy.exists()
    build_cache.adopt(directory, tmp_path / "other", "kernel.so")  # the new entry stays
    assert (directory / "kernel.so").exists()


def test_entry_paths_are_versioned_and_readable(cache_root, tmp_path):
    path = build_cache.entry_path("nvrtc", "sm_90a", "norms", "abc")
    assert path == Path(cache_root).resolve() / __version__ / "nvrtc" / "sm_90a" / "norms-abc"
    directory = build_cache.directory_entry(tmp_path / "k-abc", "k", "kernel.so", "built.json")
    assert (directory.artifact.name, directory.sidecar.name, directory.failure.name) == (
        "kernel.so", "built.json", "failed.json")
    assert directory.lock == tmp_path / "k-abc.lock"
    files = build_cache.file_entry(tmp_path / "norms-abc.cubin")
    assert files.name == "norms-abc"
    assert [p.name for p in (files.sidecar, files.log, files.failure, files.lock)] == [
        "norms-abc.json", "norms-abc.log", "norms-abc.failed.json", "norms-abc.lock"]


def test_built_once_then_found(entry):
    build = FakeBuild(sidecar={"k": "_Z1kv"}, log="warning: unused\n")
    first = build_cache.get_or_build(entry, build)
    assert first.path == entry.artifact and entry.artifact.read_bytes() == WHOLE
    assert json.loads(entry.sidecar.read_text()) == {"k": "_Z1kv"}
    assert entry.log.read_text() == "warning: unused\n"
    assert build_cache.get_or_build(entry, build) == (entry.artifact, 0.0)
    assert build.calls == 1
    assert not list(entry.artifact.parent.glob(".*.tmp"))


def test_concurrent_threads_build_once(entry):
    build = FakeBuild(seconds=0.2)
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        build_cache.get_or_build(entry, build).path)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert build.calls == 1 and results == [entry.artifact] * 6


_PROCESS_BUILDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from custom_kernels.core import build_cache

    artifact, calls = Path(sys.argv[1]), Path(sys.argv[2])

    def build(out):
        with open(calls, "a") as f:
            f.write("built\\n")
        time.sleep(0.5)
        out.write_bytes(b"artifact")
        return build_cache.Built({})

    print(build_cache.get_or_build(build_cache.file_entry(artifact), build).path)
""")


def test_concurrent_processes_build_once(tmp_path):
    artifact, calls = tmp_path / "k-abc.so", tmp_path / "calls.txt"
    procs = [subprocess.Popen([sys.executable, "-c", _PROCESS_BUILDER, str(artifact), str(calls)],
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert outputs == [str(artifact)] * 3
    assert calls.read_text() == "built\n"


def test_failure_is_recorded_once_and_reraised_until_retry(entry):
    failing = FakeBuild(fail="cc -c kernel.cu\nkernel.cu(3): error: boom\n1 error detected\n")
    with pytest.raises(BuildError, match=r"kernel.cu\(3\): error: boom") as first:
        build_cache.get_or_build(entry, failing)
    assert first.value.name == entry.name and first.value.log_path == str(entry.log)
    assert "cc -c kernel.cu" in entry.log.read_text()
    assert json.loads(entry.failure.read_text())["summary"] == "kernel.cu(3): error: boom"
    assert not entry.artifact.exists()

    with pytest.raises(BuildError, match="error: boom") as again:
        build_cache.get_or_build(entry, failing)
    assert failing.calls == 1 and str(again.value) == str(first.value)

    fixed = FakeBuild()
    assert build_cache.get_or_build(entry, fixed, retry=True).path == entry.artifact
    assert fixed.calls == 1 and not entry.failure.exists()


def test_failure_not_kept_is_built_again(tmp_path):
    entry = build_cache.file_entry(tmp_path / "k-abc.cubin", keep_failures=False)
    failing = FakeBuild(fail="error: boom")
    for _ in range(2):
        with pytest.raises(BuildError, match="boom"):
            build_cache.get_or_build(entry, failing)
    assert failing.calls == 2 and json.loads(entry.failure.read_text())["summary"] == "error: boom"


def test_corrupt_failure_record_is_set_aside_and_built_again(entry):
    with pytest.raises(BuildError):
        build_cache.get_or_build(entry, FakeBuild(fail="error: boom"))
    entry.failure.write_bytes(b"\xff{not json")
    assert build_cache.get_or_build(entry, FakeBuild()).path == entry.artifact
    assert list(entry.failure.parent.glob(entry.failure.name + ".corrupt-*"))


def _empty(entry):
    entry.artifact.write_bytes(b"")


def _truncated(entry):
    entry.artifact.write_bytes(WHOLE[:700])


def _no_sidecar(entry):
    entry.sidecar.unlink()


def _sidecar_not_json(entry):
    entry.sidecar.write_text("{not json")


def _sidecar_incomplete(entry):
    entry.sidecar.write_text("[]")  # valid JSON, but not the dict the entry wants


@pytest.mark.parametrize("corrupt", [_empty, _truncated, _no_sidecar, _sidecar_not_json,
                                     _sidecar_incomplete])
def test_corrupt_entry_is_set_aside_and_rebuilt(entry, corrupt):
    build_cache.get_or_build(entry, FakeBuild())
    corrupt(entry)
    assert build_cache.is_complete(entry) is False  # the check alone moves nothing
    assert entry.artifact.exists()
    rebuild = FakeBuild(data=_elf(2048, 2048))
    assert build_cache.get_or_build(entry, rebuild).path == entry.artifact
    assert rebuild.calls == 1 and entry.artifact.read_bytes() == _elf(2048, 2048)
    assert list(entry.artifact.parent.glob(entry.artifact.name + ".corrupt-*"))
    assert build_cache.is_complete(entry)


def test_damage_reads_elf_tables_and_leaves_other_formats_to_the_sidecar(tmp_path):
    path = tmp_path / "a"
    for data, why in [(WHOLE, None), (WHOLE[:1000], "is truncated"), (WHOLE[:40], "is truncated"),
                      (b"", "is empty"), (b"not an ELF file", None)]:
        path.write_bytes(data)
        assert build_cache.damage(path) == why


def test_interrupted_build_leaves_no_partial_artifact(entry):
    def interrupted(out: Path):
        out.write_bytes(WHOLE[:100])
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_cache.get_or_build(entry, interrupted)
    assert not entry.artifact.exists() and not entry.failure.exists()
    assert not list(entry.artifact.parent.glob(".*.tmp"))
    assert build_cache.get_or_build(entry, FakeBuild()).path == entry.artifact


_KILLED_BUILDER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from custom_kernels.core import build_cache

    def build(out):
        out.write_bytes(b"half an artif")
        os.kill(os.getpid(), signal.SIGKILL)

    build_cache.get_or_build(build_cache.file_entry(Path(sys.argv[1])), build)
""")


def test_killed_build_leaves_no_artifact_and_releases_its_lock(entry):
    proc = subprocess.run([sys.executable, "-c", _KILLED_BUILDER, str(entry.artifact)],
                          timeout=120)
    assert proc.returncode != 0
    assert not entry.artifact.exists()
    build = FakeBuild()
    assert build_cache.get_or_build(entry, build).path == entry.artifact and build.calls == 1


def test_success_without_output_is_a_failure(entry):
    with pytest.raises(BuildError, match="reported success but its output is empty"):
        build_cache.get_or_build(entry, FakeBuild(data=b""))
    with pytest.raises(BuildError, match="is missing"):
        build_cache.get_or_build(entry, lambda out: build_cache.Built({}), retry=True)


def test_toolchain_errors_are_raised_and_not_recorded(entry):
    def no_compiler(out):
        raise ToolchainError("nvcc not found")

    with pytest.raises(ToolchainError):
        build_cache.get_or_build(entry, no_compiler)
    assert not entry.failure.exists() and not entry.log.exists()
    assert build_cache.get_or_build(entry, FakeBuild()).path == entry.artifact

