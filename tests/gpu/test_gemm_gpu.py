"""GEMMs on an sm90 GPU against a float32 torch reference, with the output poisoned first."""

import itertools

import pytest
import torch

import cutlass_ops
from cutlass_ops import GemmConfig, UnsupportedInputError

pytestmark = [pytest.mark.gpu, pytest.mark.nvcc]  # builds CUTLASS C++ kernels with nvcc

CONFIGS = {
    "pingpong": GemmConfig(kernel_schedule="pingpong", tile=(128, 128, 64)),
    "cooperative": GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 64)),
    "cluster2x1": GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 64),
                             cluster=(2, 1, 1)),
    "cluster1x2": GemmConfig(kernel_schedule="pingpong", tile=(64, 128, 64), cluster=(1, 2, 1)),
}
STREAM_K = GemmConfig(kernel_schedule="cooperative", tile=(128, 128, 64), cluster=(1, 2, 1),
                      tile_scheduler="streamk")
DTYPES = [torch.bfloat16, torch.float16]
LAYOUTS = list(itertools.product(["row", "col"], repeat=2))
# Multiples of 8 (TMA) that are not multiples of any tile, so every edge tile is partial.
M, N, K = 264, 392, 200


def matrix(rows, cols, layout, dtype, batch=None, pad=0):
    """A random matrix in the given layout; pad > 0 leaves a gap after each leading dimension."""
    lead = (batch,) if batch else ()
    if layout == "row":
        return torch.randn(*lead, rows, cols + pad, device="cuda", dtype=dtype)[..., :cols]
    return torch.randn(*lead, cols, rows + pad, device="cuda", dtype=dtype)[..., :rows] \
        .transpose(-1, -2)


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def reference(a, b, c=None, alpha=1.0, beta=0.0):
    out = alpha * (a.float() @ b.float())
    return out + beta * c.float() if c is not None else out


def assert_close(out, ref, dtype):
    assert torch.isfinite(out).all(), "some output elements were not written"
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < (1e-2 if dtype == torch.bfloat16 else 2e-3), err


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("layout_a, layout_b", LAYOUTS, ids=["tt", "tn", "nt", "nn"])
def test_gemm_matches_reference(name, dtype, layout_a, layout_b):
    a, b = matrix(M, K, layout_a, dtype), matrix(K, N, layout_b, dtype)
    out = cutlass_ops.gemm(a, b, config=CONFIGS[name], out=poisoned((M, N), dtype))
    assert_close(out, reference(a, b), dtype)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_with_alpha_beta_and_padded_leading_dimensions(name):
    dtype, batch = torch.bfloat16, 3
    a = matrix(M, K, "row", dtype, batch=batch, pad=24)
    b = matrix(K, N, "col", dtype, batch=batch, pad=8)
    c = matrix(M, N, "row", dtype, batch=batch, pad=16)
    out = cutlass_ops.gemm(a, b, c, alpha=1.5, beta=-0.75, config=CONFIGS[name],
                           out=poisoned((batch, M, N), dtype))
    assert_close(out, reference(a, b, c, 1.5, -0.75), dtype)


@pytest.mark.parametrize("splits", [1, 3])
def test_stream_k(splits):
    a, b = matrix(256, 4096, "row", torch.bfloat16), matrix(4096, 512, "col", torch.bfloat16)
    out = cutlass_ops.gemm(a, b, config=STREAM_K.replace(splits=splits),
                           out=poisoned((256, 512), torch.bfloat16))
    assert_close(out, reference(a, b), torch.bfloat16)


@pytest.mark.parametrize("raster, swizzle", [("alongm", 2), ("alongn", 4), ("heuristic", 8)])
def test_run_time_scheduler_knobs(raster, swizzle):
    config = CONFIGS["pingpong"].replace(raster_order=raster, swizzle=swizzle)
    a, b = matrix(1024, 512, "row", torch.bfloat16), matrix(512, 1024, "col", torch.bfloat16)
    assert_close(cutlass_ops.gemm(a, b, config=config), reference(a, b), torch.bfloat16)


def test_beta_zero_ignores_nan_in_c_and_allocates_output():
    a, b = matrix(M, K, "row", torch.bfloat16), matrix(K, N, "col", torch.bfloat16)
    c = poisoned((M, N), torch.bfloat16)
    out = cutlass_ops.gemm(a, b, c, beta=0.0, config=CONFIGS["pingpong"])
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    assert_close(out, reference(a, b), torch.bfloat16)


def test_in_place_accumulation_into_c_and_fp32_output():
    a, b = matrix(M, K, "row", torch.bfloat16), matrix(K, N, "col", torch.bfloat16)
    c = torch.randn(M, N, device="cuda")
    expected = reference(a, b, c, 1.0, 1.0)
    out = cutlass_ops.gemm(a, b, c, beta=1.0, out=c,
                           config=CONFIGS["pingpong"])
    assert out.data_ptr() == c.data_ptr() and out.dtype == torch.float32
    assert_close(out, expected, torch.float16)


def test_column_major_output_and_decode_shape():
    a, b = matrix(M, K, "row", torch.bfloat16), matrix(K, N, "col", torch.bfloat16)
    out = poisoned((N, M), torch.bfloat16).t()
    assert_close(cutlass_ops.gemm(a, b, out=out, config=CONFIGS["pingpong"]), reference(a, b),
                 torch.bfloat16)
    x, w = matrix(1, 4096, "row", torch.bfloat16), matrix(4096, 1024, "col", torch.bfloat16)
    assert_close(cutlass_ops.gemm(x, w, config=CONFIGS["pingpong"]), reference(x, w),
                 torch.bfloat16)


def test_tf32():
    a, b = matrix(256, 512, "row", torch.float32), matrix(512, 384, "col", torch.float32)
    config = GemmConfig(kernel_schedule="pingpong", tile=(128, 128, 32))
    out = cutlass_ops.gemm(a, b, config=config, out=poisoned((256, 384), torch.float32))
    assert torch.isfinite(out).all()
    assert ((out - reference(a, b)).norm() / reference(a, b).norm()).item() < 5e-3


@pytest.mark.parametrize("m, n, k", [(0, 64, 64), (64, 0, 64), (64, 64, 0)])
def test_empty_sizes_follow_torch(m, n, k):
    a, b = matrix(m, k, "row", torch.bfloat16), matrix(k, n, "col", torch.bfloat16)
    c = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    out = cutlass_ops.gemm(a, b, c, alpha=2.0, beta=0.5, config=CONFIGS["pingpong"])
    torch.testing.assert_close(out, torch.addmm(c, a, b, beta=0.5, alpha=2.0))
    assert cutlass_ops.gemm(a, b, config=CONFIGS["pingpong"]).shape == (m, n)


def test_bad_inputs_get_clear_errors():
    a, b = matrix(128, 128, "row", torch.bfloat16), matrix(128, 128, "col", torch.bfloat16)
    config = CONFIGS["pingpong"]
    cases = [
        ((a.cpu(), b.cpu()), {}, "needs CUDA tensors"),
        ((a, b.cpu()), {}, "different devices"),
        ((a, b.half()), {}, "mixed operand types"),
        ((a.double(), b.double()), {}, "supported: bfloat16"),
        ((a, b[:64]), {}, "shapes do not multiply"),
        ((a[None].expand(2, -1, -1), b), {}, "must both be 2-D"),
        ((torch.randn(128 * 128 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(128, 128), b),
         {}, "data pointer"),
        ((torch.randn(128, 129, device="cuda", dtype=torch.bfloat16)[:, :128], b), {},
         "leading dimension"),
        ((matrix(128, 100, "row", torch.bfloat16), matrix(100, 128, "col", torch.bfloat16)), {},
         "contiguous dimension"),
        ((a, torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)[::2, ::2]), {},
         "unit stride"),
        ((a, b), {"beta": 1.0}, "no C was given"),
        ((a, b, torch.zeros(128, 64, device="cuda", dtype=torch.bfloat16)), {"beta": 1.0},
         "no broadcasting"),
        ((a, b), {"out": a}, "overlaps A"),
        ((a, b), {"config": GemmConfig(arch="sm100a", kernel_schedule="2sm", tile=(256, 128, 64),
                                       cluster=(2, 1, 1))}, "compute capability"),
        ((a, b), {"config": GemmConfig(kernel_schedule="cooperative", tile=(64, 128, 64))},
         "needs tile M"),
    ]
    for args, kwargs, expected in cases:
        kwargs = {"config": config, **kwargs}
        with pytest.raises((UnsupportedInputError, cutlass_ops.InvalidConfigError),
                           match=expected):
            cutlass_ops.gemm(*args, **kwargs)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_a_second_gpu_run_there():
    a = torch.randn(256, 256, device="cuda:1", dtype=torch.bfloat16)
    b = torch.randn(256, 256, device="cuda:1", dtype=torch.bfloat16).t()
    with torch.cuda.device(0):
        out = cutlass_ops.gemm(a, b, config=CONFIGS["pingpong"])
    assert out.device == a.device
    assert_close(out, reference(a, b), torch.bfloat16)
