import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def cache_root(tmp_path_factory):
    """Every test writes its cache under one session directory, unless CUTLASS_OPS_TEST_CACHE_DIR
    names a directory to reuse (prebuilt artifacts on the GPU machine)."""
    root = os.environ.get("CUTLASS_OPS_TEST_CACHE_DIR") or str(tmp_path_factory.mktemp("cache"))
    previous = os.environ.get("CUTLASS_OPS_CACHE_DIR")
    os.environ["CUTLASS_OPS_CACHE_DIR"] = root
    yield root
    if previous is None:
        os.environ.pop("CUTLASS_OPS_CACHE_DIR", None)
    else:
        os.environ["CUTLASS_OPS_CACHE_DIR"] = previous


@pytest.fixture(autouse=True)
def clean_working_directory(tmp_path, monkeypatch):
    """Each test runs in an empty working directory, which must still be empty afterwards: the
    library never writes into the user's working directory."""
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    yield
    left = sorted(os.listdir(workdir))
    assert not left, f"files written into the working directory: {left}"


@pytest.fixture(autouse=True)
def seeded_torch():
    """torch's global generators seeded before each test: what a test draws from them depends on
    that test alone, not on which tests ran before it, so a failure reproduces when the test
    runs by itself."""
    try:
        import torch
    except ImportError:
        return
    torch.manual_seed(0)


def nvcc_missing() -> bool:
    from cutlass_ops.gemms.build import nvcc_available

    return not nvcc_available()


def sm90_gpu_missing() -> bool:
    try:
        import torch
    except ImportError:
        return True
    if not torch.cuda.is_available():
        return True
    return torch.cuda.get_device_capability() != (9, 0)


def pytest_collection_modifyitems(config, items):
    """Skips what this machine cannot run: marker ``gpu`` without an sm90 GPU; markers
    ``nvcc`` (GPU tests that build CUTLASS C++ kernels) and ``compile`` without nvcc. The other
    GPU tests (the custom kernel families: norms, rotary, SwiGLU, cross-entropy, ragged,
    clip_grad, the routing split, and models converted without a built GEMM, which dispatch
    sends to torch) compile through NVRTC and run without nvcc."""
    skip_nvcc = pytest.mark.skip(reason="nvcc not found (builds the CUTLASS C++ kernels)")
    skip_gpu = pytest.mark.skip(reason="needs an sm90 CUDA GPU")
    no_nvcc, no_gpu = nvcc_missing(), sm90_gpu_missing()
    for item in items:
        if no_nvcc and (item.get_closest_marker("nvcc") or item.get_closest_marker("compile")):
            item.add_marker(skip_nvcc)
        if no_gpu and item.get_closest_marker("gpu"):
            item.add_marker(skip_gpu)
