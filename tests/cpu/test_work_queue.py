"""The work queue, cooperative launch and persistent launch helpers without a GPU: argument
packing, the counter layout shared with work_queue.cuh, lazy package import, and (marker
compile) an nvcc --cubin syntax check of the kernels built on the queue."""

import ctypes
import re
import subprocess
import sys
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "custom_kernels" / "csrc"


def nvcc_cubin(source: str, defines: dict, out: Path, arch: str = "sm_90a") -> bytes:
    """Compile csrc/<source> to a cubin with nvcc as NVRTC would (same include directories and
    -D values, no -rdc: grid.sync() needs none since CUDA 11); fail on any error or warning."""
    from custom_kernels.jit import include_dirs
    from cutlass_ops.gemms.build import nvcc_path

    cmd = [nvcc_path(), "-std=c++17", f"-arch={arch}", "--cubin", "-lineinfo",
           *(f"-I{d}" for d in include_dirs()), *(f"-D{k}={v}" for k, v in defines.items()),
           "-o", str(out), str(CSRC / source)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr, result.stderr
    return out.read_bytes()


def test_package_import_loads_no_torch():
    code = ("import sys, custom_kernels; assert 'torch' not in sys.modules; "
            "assert 'custom_kernels.clip_grad' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_lazy_exports_resolve():
    import custom_kernels

    assert callable(custom_kernels.clip_grad_norm_)
    assert callable(custom_kernels.segment_sum)
    assert callable(custom_kernels.launch_cooperative)
    with pytest.raises(AttributeError):
        custom_kernels.no_such_function


def test_lazy_exports_are_looked_up_once():
    """A resolved name becomes a plain attribute of the package, so that a call such as
    ``norms.rms_norm(...)`` does not pay the import hook (microseconds) every time."""
    import custom_kernels
    import custom_kernels.norms as norms

    for package, name in ((custom_kernels, "segment_sum"), (norms, "rms_norm"),
                          (norms, "RMSNorm")):
        value = getattr(package, name)
        assert vars(package)[name] is value


def test_counter_layout_matches_header():
    from custom_kernels import work_queue

    header = (CSRC / "work_queue.cuh").read_text()
    phases = int(re.search(r"kMaxPhases = (\d+);", header).group(1))
    assert "kCounters = kMaxPhases + 1" in header
    assert work_queue.COUNTERS == phases + 1


def test_pack_follows_the_launch_convention():
    import numpy as np
    import torch

    from custom_kernels.cooperative import _pack

    t = torch.zeros(4)
    params, values = _pack((t, 7, 2.5, True, np.int32(-3), np.float32(0.5), (1 << 64) - 1))
    assert len(params) == 7
    expected = [(ctypes.c_uint64, t.data_ptr()), (ctypes.c_int64, 7), (ctypes.c_double, 2.5),
                (ctypes.c_bool, True), (ctypes.c_int32, -3), (ctypes.c_float, 0.5),
                (ctypes.c_uint64, (1 << 64) - 1)]
    for address, value, (ctype, want) in zip(params, values, expected):
        assert isinstance(value, ctype)
        assert ctype.from_address(address).value == want  # each slot points at its value


def test_pack_refuses_unknown_types():
    from custom_kernels.cooperative import _pack

    with pytest.raises(TypeError, match="cannot pass"):
        _pack(("text",))


def test_persistent_launch_needs_no_work_queue_import_of_cuda():
    """The module imports without touching CUDA; counters() needs a GPU only when called."""
    code = ("import custom_kernels.work_queue as w, custom_kernels.cooperative as c, sys; "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


@pytest.mark.compile
def test_work_queue_header_compiles_alone(tmp_path):
    source = tmp_path / "probe.cu"
    source.write_text('#include "work_queue.cuh"\n'
                      'extern "C" __global__ void probe(unsigned* c, unsigned* out, unsigned n) {\n'
                      '  __shared__ unsigned slots[2];\n'
                      '  ck::BlockQueue q(c, slots);\n'
                      '  for (unsigned t = q.begin(); t < n; t = q.advance()) {\n'
                      '    q.prefetch(); if (threadIdx.x == 0) out[t] = blockIdx.x; }\n'
                      '  unsigned w = ck::warp_pull(c + 1); (void)w;\n'
                      '  ck::finish(c, 2);\n}\n')
    from custom_kernels.jit import include_dirs
    from cutlass_ops.gemms.build import nvcc_path

    cmd = [nvcc_path(), "-std=c++17", "-arch=sm_90a", "--cubin",
           *(f"-I{d}" for d in include_dirs()), "-o", str(tmp_path / "probe.cubin"), str(source)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
