"""nvcc artifacts in the build cache: keys, kept failures, locking. Uses tiny broken sources so
nvcc fails fast."""

import hashlib
import json
import threading

import pytest

from cutlass_ops.gemms import build
from cutlass_ops.gemms.config import Arch
from custom_kernels.core import build_cache
from custom_kernels.core.errors import BuildError
from custom_kernels.core.version import __version__

pytestmark = pytest.mark.skipif(not build.nvcc_available(), reason="nvcc not found")

BROKEN = '#error "deliberately broken kernel"\n'


def test_key_covers_source_and_arch():
    a = build.BuildSpec("k", BROKEN, Arch.SM90A)
    assert a.key == build.BuildSpec("other-name", BROKEN, Arch.SM90A).key
    assert a.key != build.BuildSpec("k", BROKEN + " ", Arch.SM90A).key
    assert a.key != build.BuildSpec("k", BROKEN, Arch.SM100A).key
    assert a.directory.name == f"k-{a.key}"
    assert "compute_90a" in " ".join(build.nvcc_flags(Arch.SM90A))
    defined = build.BuildSpec("k", BROKEN, Arch.SM90A, ("CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",))
    assert defined.key != a.key


def test_an_artifact_under_the_key_before_the_one_build_cache_is_adopted(monkeypatch):
    """Length-prefixed byte parts, defines only when there are some: the key every existing
    artifact cache was built under. Such an entry moves to today's key instead of a rebuild."""
    def legacy_directory(spec):
        parts = [spec.kernel_source.encode(), build.LAUNCHER.read_bytes(),
                 build.nvcc_version().encode(), " ".join(build.nvcc_flags(spec.arch)).encode(),
                 spec.arch.value.encode()]
        if spec.defines:
            parts.append(" ".join(spec.defines).encode())
        digest = hashlib.sha256()
        for part in parts:
            digest.update(len(part).to_bytes(8, "little") + part)
        return spec.directory.with_name(f"{spec.name}-{digest.hexdigest()[:20]}")

    monkeypatch.setattr(build, "_compile", lambda *a: pytest.fail("nvcc ran"))
    for spec in (build.BuildSpec("k", BROKEN, Arch.SM90A),
                 build.BuildSpec("k", BROKEN, Arch.SM100A, ("A=1", "B"))):
        assert spec.directory.parent.parts[-3:] == (__version__, "artifacts", spec.arch.value)
        old = legacy_directory(spec)
        old.mkdir(parents=True)
        (old / build.LIBRARY).write_bytes(b"library")
        assert build.is_built(spec) and not old.exists()
        assert (spec.directory / build.LIBRARY).read_bytes() == b"library"


def test_only_tile_widths_cute_splits_get_the_extended_wgmma_shapes():
    from cutlass_ops.gemms.config import GemmConfig
    from cutlass_ops.gemms.loader import build_defines

    def defines(tn, **kw):
        return build_defines(GemmConfig(kernel_schedule="cooperative", tile=(128, tn, 64), **kw))

    for tn in (16, 32, 64, 96, 128, 192, 256):
        assert defines(tn) == ()
    for tn in (112, 160, 176, 208, 224):
        assert defines(tn) == ("CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",)


def test_defines_reach_nvcc():
    spec = build.BuildSpec("broken-defined", BROKEN, Arch.SM90A, ("CUTLASS_OPS_TEST_MACRO=7",))
    with pytest.raises(BuildError) as error:
        build.build(spec, retry_failed=True)
    assert "-DCUTLASS_OPS_TEST_MACRO=7" in open(error.value.log_path).readline()


def test_failure_is_kept_with_its_log_and_not_recompiled(monkeypatch):
    spec = build.BuildSpec("broken", BROKEN, Arch.SM90A)
    with pytest.raises(BuildError, match="deliberately broken") as first:
        build.build(spec)
    log = first.value.log_path
    assert "broken" in str(first.value) and log.endswith("build.log")
    assert "deliberately broken" in open(log).read()

    record = json.loads((spec.directory / "failed.json").read_text())
    assert "deliberately broken" in record["summary"]
    assert not (spec.directory / build.LIBRARY).exists()
    monkeypatch.setattr(build, "_compile", lambda spec, out: pytest.fail("nvcc ran again"))
    with pytest.raises(BuildError, match="deliberately broken"):
        build.build(spec)


def test_retry_failed_rebuilds():
    spec = build.BuildSpec("broken-retry", BROKEN, Arch.SM90A)
    with pytest.raises(BuildError):
        build.build(spec)
    marker = spec.directory / "failed.json"
    marker.write_text("{corrupt")
    with pytest.raises(BuildError):
        build.build(spec)  # a corrupt record is set aside and the build runs again
    assert list(spec.directory.glob("failed.json.corrupt-*"))
    assert json.loads(marker.read_text())["summary"]  # the new failure is recorded
    with pytest.raises(BuildError):
        build.build(spec, retry_failed=True)


def test_success_publishes_a_whole_library_and_its_metadata(monkeypatch, tmp_path):
    """The success path without CUTLASS's compile time: a one-line launcher."""
    launcher = tmp_path / "launcher.cu"
    launcher.write_text(f'#include "{build.KERNEL_HEADER}"\n'
                        'extern "C" int probe() { return VALUE; }\n')
    monkeypatch.setattr(build, "LAUNCHER", launcher)
    spec = build.BuildSpec("tiny", "#define VALUE 7\n", Arch.SM90A)
    artifact = build.build(spec)
    assert artifact.library == spec.directory / build.LIBRARY and artifact.seconds > 0
    assert build.is_built(spec) and build_cache.damage(artifact.library) is None
    assert json.loads((spec.directory / "built.json").read_text())["name"] == "tiny"
    assert "-o" in (spec.directory / "build.log").read_text()
    assert not (spec.directory / "failed.json").exists()
    assert build.build(spec).seconds == 0.0  # from the cache


def test_artifact_without_its_metadata_is_set_aside_and_rebuilt():
    spec = build.BuildSpec("broken-no-metadata", BROKEN, Arch.SM90A)
    spec.directory.mkdir(parents=True)
    (spec.directory / build.LIBRARY).write_bytes(b"a library whose build.json never came")
    assert build.is_built(spec)
    with pytest.raises(BuildError, match="deliberately broken"):  # nvcc ran on the source again
        build.build(spec)
    assert not build.is_built(spec)
    assert list(spec.directory.glob(build.LIBRARY + ".corrupt-*"))


def test_concurrent_callers_compile_once(monkeypatch):
    spec = build.BuildSpec("concurrent", BROKEN, Arch.SM90A)
    calls = []
    real = build._compile

    def counting(s, out):
        calls.append(s)
        return real(s, out)

    monkeypatch.setattr(build, "_compile", counting)
    errors = []

    def worker():
        try:
            build.build(spec)
        except BuildError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(errors) == 4


def test_build_many_reports_each_result_in_order():
    specs = [build.BuildSpec(f"many-{i}", BROKEN + f"// {i}\n", Arch.SM90A) for i in range(3)]
    seen = []
    results = build.build_many(specs, jobs=2, on_done=lambda s, r: seen.append(s.name))
    assert [type(r) for r in results] == [BuildError] * 3
    assert [r.name for r in results] == [s.name for s in specs]
    assert sorted(seen) == sorted(s.name for s in specs)
