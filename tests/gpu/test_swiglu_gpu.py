"""Fused SwiGLU on an sm90 GPU (marker gpu): the forward pass bit for bit against Hugging Face's
``F.silu(gate) * up`` (bf16, fp16, fp32) on merged gate+up outputs, contiguous and as strided
slices of a wider output (aligned: 16-byte accesses; misaligned: one element an access), odd
and tiny I, large and extreme values, decode and LlamaMLP-sized shapes, the row loop past the
grid's 65535 row groups, zero sizes; the backward pass within one rounding of the fp32
gradient, with expanded and transposed output gradients; opcheck; the eager path against the
custom op; torch.compile(fullgraph=True) forward and backward; CUDA graph replay; the bandwidth
against a device copy of as many bytes."""

import pytest
import torch
import torch.nn.functional as F

from custom_kernels import swiglu

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def merged_gate_up(rows, inter, dtype, offset=0, width=None, scale=3.0):
    """A [rows, 2I] gate+up output, as columns [offset, offset + 2I) of a [rows, width] GEMM
    output (width 2I and offset 0: contiguous)."""
    width = width or offset + 2 * inter
    merged = (torch.randn(rows, width, device="cuda") * scale).to(dtype)
    return merged[:, offset:offset + 2 * inter]


def hf_swiglu(gate_up):
    """HF's LlamaMLP activation, ``act_fn(gate) * up``, eager torch on the GPU."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def assert_same_bits(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    bits = {2: torch.int16, 4: torch.int32}[got.element_size()]
    same = got.view(bits) == want.contiguous().view(bits)
    assert same.all(), f"{int((~same).sum())} of {got.numel()} elements differ"


def ulps(got, want):
    """Distance in units in the last place, element by element (+0 and -0 are one value)."""
    bits = {2: torch.int16, 4: torch.int32}[got.element_size()]
    sign = 1 << (8 * got.element_size() - 1)

    def ordered(t):
        i = t.contiguous().view(bits).long() & (2 * sign - 1)
        return torch.where(i >= sign, sign - i, i)

    return (ordered(got) - ordered(want)).abs()


def assert_within_ulps(got, want, n):
    assert got.shape == want.shape and got.dtype == want.dtype
    distance = ulps(got, want)
    assert int(distance.max()) <= n, \
        f"{int((distance > n).sum())} of {got.numel()} elements are more than {n} ulp apart " \
        f"(worst {int(distance.max())})"


# --- forward -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [4096, 1000, 1001, 11, 8, 1])
@pytest.mark.parametrize("layout", ["contiguous", "aligned slice", "misaligned slice"])
def test_forward_bits_equal_hf(dtype, inter, layout):
    offset, width = {"contiguous": (0, None), "aligned slice": (16, 3 * 2 * inter + 16),
                     "misaligned slice": (1, 2 * inter + 3)}[layout]
    gate_up = merged_gate_up(77, inter, dtype, offset, width)
    y = swiglu.swiglu(gate_up)
    assert y.shape == (77, inter)
    assert_same_bits(y, hf_swiglu(gate_up))
    # Independently of torch's kernels: near fp32 math rounded once (relative Frobenius error;
    # a per-element ulp count misleads where the product cancels to a tiny value).
    from custom_kernels.core.tolerances import relative_error
    assert relative_error(y, swiglu.swiglu_reference(gate_up)) < {
        torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_values(dtype):
    """Large gates (exp(-g) overflows to inf: silu is -0; or exp(-g) is 0: silu is g), zeros,
    tiny values. |up| < 1 keeps the products finite."""
    big = torch.finfo(dtype).max
    values = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 88.0, -88.0, 89.0, -89.0,
                           100.0, -100.0, 1e4, -1e4, big, -big], device="cuda")
    gate = values.repeat(16).to(dtype)
    up = (torch.rand(gate.numel(), device="cuda") * 2 - 1).to(dtype)
    gate_up = torch.cat([gate, up]).view(1, -1)
    y = swiglu.swiglu(gate_up)
    assert_same_bits(y, hf_swiglu(gate_up))
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("shape", [(1, 14336), (64, 14336), (4096, 14336), (2, 3, 5, 1000)])
def test_model_shapes(shape):
    """Decode (one and 64 tokens), a LlamaMLP-8B prefill, and several leading dimensions."""
    gate_up = torch.randn(*shape[:-1], 2 * shape[-1], device="cuda").bfloat16()
    y = swiglu.swiglu(gate_up)
    assert y.shape == shape
    assert_same_bits(y, hf_swiglu(gate_up))


@pytest.mark.parametrize("inter, dtype", [(1, torch.bfloat16), (8, torch.bfloat16)])
def test_rows_past_the_grid_limit(inter, dtype):
    """More row groups than the grid's y dimension holds: the kernel's row loop (one-vector
    rows put BLOCK rows in a block, so this takes 65535 * BLOCK rows and more)."""
    rows = swiglu.MAX_GRID_Y * swiglu.BLOCK + 1000
    gate_up = torch.randn(rows, 2 * inter, device="cuda").to(dtype)
    assert_same_bits(swiglu.swiglu(gate_up), hf_swiglu(gate_up))


def test_zero_sizes():
    for shape in [(0, 64), (3, 0), (2, 0, 16)]:
        x = torch.randn(shape, device="cuda", requires_grad=True)
        y = swiglu.swiglu(x)
        assert y.shape == (*shape[:-1], shape[-1] // 2)
        y.sum().backward()
        assert x.grad.shape == x.shape


# --- backward ----------------------------------------------------------------------------------

def grad_of(fn, gate_up, dy):
    x = gate_up.detach().requires_grad_()
    (dx,) = torch.autograd.grad(fn(x), x, dy)
    return dx


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [4096, 1000, 1001, 11, 1])
@pytest.mark.parametrize("layout", ["contiguous", "aligned slice", "misaligned slice"])
def test_backward_within_one_rounding(dtype, inter, layout):
    """fp32 math rounded once: the fp32 autograd gradient rounded to the dtype, give or take one
    ulp where the two fp32 computations round a step apart (exactly equal in most elements).
    In fp32 the absolute tolerance covers d_gate near the root of 1 + g (1 - s) (g near
    -1.28), where an FMA contracted or not moves a near-zero result by ~1e-7 of dy * up."""
    offset, width = {"contiguous": (0, None), "aligned slice": (8, 2 * 2 * inter + 8),
                     "misaligned slice": (1, 2 * inter + 1)}[layout]
    gate_up = merged_gate_up(53, inter, dtype, offset, width)
    dy = torch.randn(53, inter, device="cuda").to(dtype)
    dx = grad_of(swiglu.swiglu, gate_up, dy)
    assert dx.shape == gate_up.shape and dx.is_contiguous() and dx.dtype == dtype
    want = grad_of(swiglu.swiglu_reference, gate_up, dy)
    if dtype == torch.float32:
        torch.testing.assert_close(dx, want, rtol=1e-5, atol=1e-4)
    else:
        assert_within_ulps(dx, want, 1)


def test_expanded_and_transposed_output_gradients():
    gate_up = merged_gate_up(24, 64, torch.bfloat16).requires_grad_()
    swiglu.swiglu(gate_up).sum().backward()  # dy: ones expanded from a scalar
    want = grad_of(swiglu.swiglu_reference, gate_up, torch.ones(24, 64, device="cuda",
                                                                 dtype=torch.bfloat16))
    assert_within_ulps(gate_up.grad, want, 1)
    dy = torch.randn(64, 24, device="cuda").bfloat16().t()  # a transposed gradient
    assert_within_ulps(grad_of(swiglu.swiglu, gate_up, dy),
                       grad_of(swiglu.swiglu_reference, gate_up, dy), 1)


# --- the op: opcheck, the eager path, torch.compile, CUDA graphs -------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(dtype):
    gate_up = merged_gate_up(9, 96, dtype, 8, 3 * 96).requires_grad_()
    ops = torch.ops.custom_kernels
    torch.library.opcheck(ops.swiglu_fwd.default, (gate_up,))
    y = ops.swiglu_fwd(gate_up)
    # The backward op has no autograd of its own (no double backward): detached inputs.
    torch.library.opcheck(ops.swiglu_bwd.default, (torch.randn_like(y), gate_up.detach()))


def test_eager_path_equals_the_custom_op():
    gate_up = merged_gate_up(33, 512, torch.bfloat16)
    dy = torch.randn(33, 512, device="cuda").bfloat16()
    assert torch.equal(grad_of(swiglu.swiglu, gate_up, dy),
                       grad_of(torch.ops.custom_kernels.swiglu_fwd, gate_up, dy))
    with torch.no_grad():
        assert torch.equal(swiglu.swiglu(gate_up), torch.ops.custom_kernels.swiglu_fwd(gate_up))


def mlp(x, w_gate_up, w_down, act):
    """LlamaMLP with merged gate and up weights."""
    return (act(x @ w_gate_up.t()) @ w_down.t()).float().square().mean()


def test_torch_compile_fullgraph_forward_and_backward():
    x = torch.randn(2, 64, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w_gu = (torch.randn(2 * 1408, 512, device="cuda") / 512 ** 0.5).bfloat16().requires_grad_()
    w_down = (torch.randn(512, 1408, device="cuda") / 1408 ** 0.5).bfloat16().requires_grad_()
    compiled = torch.compile(mlp, fullgraph=True)
    loss = compiled(x, w_gu, w_down, swiglu.swiglu)
    loss.backward()
    ours = [loss.detach(), x.grad.clone(), w_gu.grad.clone(), w_down.grad.clone()]
    x.grad = w_gu.grad = w_down.grad = None
    loss = mlp(x, w_gu, w_down, hf_swiglu)
    loss.backward()
    for got, want in zip(ours, [loss.detach(), x.grad, w_gu.grad, w_down.grad]):
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert err < 2e-2, f"relative error {err:.3g}"


def test_cuda_graph_replay():
    gate_up = merged_gate_up(256, 1408, torch.bfloat16, 16, 3 * 2 * 1408).requires_grad_()
    dy = torch.randn(256, 1408, device="cuda").bfloat16()

    def step():
        y = swiglu.swiglu(gate_up)
        (dx,) = torch.autograd.grad(y, gate_up, dy)
        return y, dx

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up (compile, load) outside the capture
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, dx = step()
    for seed in range(3):
        torch.manual_seed(seed)
        with torch.no_grad():
            gate_up.copy_(torch.randn_like(gate_up))
        dy.copy_(torch.randn_like(dy))
        graph.replay()
        assert_same_bits(y, hf_swiglu(gate_up.detach()))
        assert_within_ulps(dx, grad_of(swiglu.swiglu_reference, gate_up, dy), 1)
