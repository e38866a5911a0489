"""Fused SwiGLU without a GPU: the input rules (raised on every device, and by the custom ops),
the torch fallback against HF's ``act_fn(gate) * up`` (values bit for bit, gradients, logged
once, traced by torch.compile), zero-size and meta inputs, the fake impls' shapes
(FakeTensorMode with CUDA tensors), the ops' wiring with a torch stand-in for the kernels (the
eager path, the custom op's autograd, torch.compile(fullgraph=True), opcheck, layouts reaching
the launcher), the backward formula of the .cu file, and the launcher's grid and access width."""


import pytest
import torch
import torch.nn.functional as F
from torch._subclasses import FakeTensorMode

from custom_kernels import swiglu
from custom_kernels.core.errors import UnsupportedInputError

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def hf_swiglu(gate_up):
    """HF's LlamaMLP activation on the halves of a merged gate+up output."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# --- input rules -------------------------------------------------------------------------------

def test_input_rules():
    def refused(match, x, fn=swiglu.swiglu):
        with pytest.raises(UnsupportedInputError, match=match):
            fn(x)

    refused("must be even", torch.randn(3, 7))
    refused("must be even", torch.randn(1))
    refused("float32, float16 or bfloat16, not torch.int32", torch.ones(3, 8, dtype=torch.int32))
    refused("float32, float16 or bfloat16, not torch.float64", torch.randn(3, 8).double())
    refused("float32, float16 or bfloat16, not torch.complex64",
            torch.randn(3, 8, dtype=torch.complex64))
    refused("no dimension", torch.tensor(1.0))
    refused(r"non-contiguous last dimension \(stride 2\); call .contiguous\(\)",
            torch.randn(3, 16)[:, ::2])
    refused(r"non-contiguous last dimension \(stride 3\)", torch.randn(8, 3).t())
    refused("must be a torch.Tensor, got list", [1.0, 2.0])
    ops = torch.ops.custom_kernels
    refused("custom_kernels::swiglu_fwd: the last dimension of gate_up must be even",
            torch.randn(3, 7), ops.swiglu_fwd)
    with pytest.raises(UnsupportedInputError, match=r"dy must be a torch.float32 tensor of shape "
                                                    r"\(3, 4\)"):
        ops.swiglu_bwd(torch.randn(3, 8), torch.randn(3, 8))
    with pytest.raises(UnsupportedInputError, match="dy must be a torch.float32"):
        ops.swiglu_bwd(torch.randn(3, 4).half(), torch.randn(3, 8))


def test_rules_hold_for_cuda_tensors_too():
    """What a GPU refuses is refused before anything runs (fake CUDA tensors: no GPU here)."""
    with FakeTensorMode():
        with pytest.raises(UnsupportedInputError, match="even"):
            swiglu.swiglu(torch.empty(4, 9, device="cuda", dtype=torch.bfloat16))
        with pytest.raises(UnsupportedInputError, match="non-contiguous"):
            swiglu.swiglu(torch.empty(16, 4, device="cuda").t())


def test_the_ops_refuse_cpu_tensors_at_the_launch():
    """A custom op called directly with CPU tensors names the device instead of launching."""
    with pytest.raises(UnsupportedInputError, match="swiglu_fwd: the tensors are on cpu"):
        torch.ops.custom_kernels.swiglu_fwd(torch.randn(3, 8))
    with pytest.raises(UnsupportedInputError, match="swiglu_bwd: the tensors are on cpu"):
        torch.ops.custom_kernels.swiglu_bwd(torch.randn(3, 4), torch.randn(3, 8))


# --- the torch fallback against HF -------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 22), (2, 3, 2 * 64), (1, 2)])
def test_fallback_equals_hf(dtype, shape, warnings):
    x = torch.randn(shape).to(dtype)
    y = swiglu.swiglu(x)
    assert y.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == dtype and y.is_contiguous()
    assert torch.equal(y, hf_swiglu(x))
    swiglu.swiglu(x)
    assert warnings() == ["swiglu uses torch_swiglu: the tensors are on cpu, not a CUDA device"]


def test_fallback_is_hf_llama_mlp():
    """With HF's own module: the merged GEMM's output, then swiglu, is LlamaMLP's activation."""
    hf = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="silu")
    mlp = hf.LlamaMLP(config)
    x = torch.randn(2, 5, 32)
    gate_up = x @ torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).t()
    want = mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)
    torch.testing.assert_close(swiglu.swiglu(gate_up), want)
    torch.testing.assert_close(mlp.down_proj(swiglu.swiglu(gate_up)), mlp(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fallback_gradients_equal_autograd(dtype):
    x = torch.randn(4, 6, 2 * 10).to(dtype).requires_grad_()
    dy = torch.randn(4, 6, 10).to(dtype)
    (ours,) = torch.autograd.grad(swiglu.swiglu(x), x, dy)
    (want,) = torch.autograd.grad(hf_swiglu(x), x, dy)
    assert torch.equal(ours, want)


def test_fallback_traces_under_torch_compile():
    x = torch.randn(3, 16, requires_grad=True)
    compiled = torch.compile(swiglu.swiglu, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    (dx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(y, hf_swiglu(x))
    torch.testing.assert_close(dx, torch.autograd.grad(hf_swiglu(x).sum(), x)[0])


def test_zero_size_and_meta():
    for shape, out in [((0, 8), (0, 4)), ((3, 0), (3, 0)), ((2, 0, 6), (2, 0, 3))]:
        x = torch.randn(shape, requires_grad=True)
        y = swiglu.swiglu(x)
        assert y.shape == out
        y.sum().backward()
        assert x.grad.shape == x.shape
    y = swiglu.swiglu(torch.empty(4, 3, 2 * 7, device="meta", dtype=torch.bfloat16))
    assert y.shape == (4, 3, 7) and y.device.type == "meta" and y.dtype == torch.bfloat16


# --- the reference and the kernel's backward formula ------------------------------------------

def test_backward_formula_is_the_gradient():
    """The backward kernel's formula (s = sigmoid(g): d_gate = dy u s (1 + g (1 - s)),
    d_up = dy silu(g)) is the gradient of silu(g) * u: checked in float64 through autograd."""
    x = torch.randn(5, 2 * 9, dtype=torch.float64, requires_grad=True) * 4
    dy = torch.randn(5, 9, dtype=torch.float64)
    (dx,) = torch.autograd.grad(swiglu.torch_swiglu(x), x, dy)
    g, u = x.detach().chunk(2, dim=-1)
    s = torch.sigmoid(g)
    formula = torch.cat([dy * u * s * (1 + g * (1 - s)), dy * g * s], dim=-1)
    torch.testing.assert_close(dx, formula)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_is_fp32_rounded_once(dtype):
    x = torch.randn(7, 2 * 33).to(dtype).requires_grad_()
    y = swiglu.swiglu_reference(x)
    assert y.dtype == dtype
    assert torch.equal(y, hf_swiglu(x.float()).to(dtype))
    dy = torch.randn(7, 33).to(dtype)
    (dx,) = torch.autograd.grad(y, x, dy)
    xf = x.detach().float().requires_grad_()
    (want,) = torch.autograd.grad(hf_swiglu(xf), xf, dy.float())
    assert dx.dtype == dtype and torch.equal(dx, want.to(dtype))


# --- fakes -------------------------------------------------------------------------------------

def test_fakes_give_contiguous_outputs():
    with FakeTensorMode():
        merged = torch.empty(2, 7, 3 * 2 * 96, device="cuda", dtype=torch.bfloat16)
        gate_up = merged.narrow(-1, 0, 2 * 96)  # strided rows: a slice of a wider output
        y = swiglu.swiglu(gate_up)
        assert y.shape == (2, 7, 96) and y.is_contiguous()
        assert y.dtype == torch.bfloat16 and y.device.type == "cuda"
        dgu = torch.ops.custom_kernels.swiglu_bwd(y.expand(2, 7, 96), gate_up)
        assert dgu.shape == gate_up.shape and dgu.is_contiguous()


# --- the ops' wiring, with a torch stand-in for the kernels ------------------------------------

def torch_launch(backward, rows, inter, tensors, amax=None):
    """What the kernels write, in torch: 2-D [rows, width] views with a unit last stride; the
    AMAX build's atomicMax of the output's largest |value| into ``amax``."""
    for t in tensors:
        assert t.dim() == 2 and t.shape[0] == rows and (t.shape[1] <= 1 or t.stride(1) == 1)
    if backward:
        dy, gate_up, dgu = tensors
        g, u = gate_up[:, :inter].float(), gate_up[:, inter:].float()
        s, d = torch.sigmoid(g), dy.float()
        dgu[:, :inter] = d * u * s * (1 + g * (1 - s))
        dgu[:, inter:] = d * F.silu(g)
    else:
        gate_up, y = tensors
        y.copy_(F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
    if amax is not None:
        amax.copy_(torch.maximum(amax, tensors[-1].float().abs().amax()))


@pytest.fixture
def calls(monkeypatch):
    """The stand-in installed; the list of (backward, rows, inter, first tensor) it saw."""
    seen = []

    def recording(backward, rows, inter, tensors, amax=None):
        seen.append((backward, rows, inter, tensors[0]))
        torch_launch(backward, rows, inter, tensors, amax)

    monkeypatch.setattr(swiglu, "_launch", recording)
    return seen


def grads_of(fn, x, dy):
    x = x.detach().requires_grad_()
    y = fn(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    return y, dx


@pytest.mark.parametrize("path", ["eager", "op", "compiled"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paths_and_autograd(calls, path, dtype):
    """The direct path (_EagerSwiGLU), the custom op with its registered autograd, and the op
    under torch.compile(fullgraph=True) give HF's values and the fp32 gradient rounded once."""
    x = torch.randn(3, 5, 2 * 12).to(dtype)
    dy = torch.randn(3, 5, 12).to(dtype)
    fn = {"eager": swiglu._swiglu, "op": torch.ops.custom_kernels.swiglu_fwd,
          "compiled": torch.compile(swiglu._swiglu, backend="aot_eager", fullgraph=True)}[path]
    y, dx = grads_of(fn, x, dy)
    assert [c[:3] for c in calls] == [(False, 15, 12), (True, 15, 12)]
    assert y.is_contiguous() and dx.is_contiguous() and dx.dtype == dtype
    assert torch.equal(y, hf_swiglu(x))
    torch.testing.assert_close(dx, grads_of(swiglu.swiglu_reference, x, dy)[1])


def test_no_grad_launches_once(calls):
    x = torch.randn(4, 8, requires_grad=True)
    with torch.no_grad():
        y = swiglu._swiglu(x)
    assert not y.requires_grad and [c[0] for c in calls] == [False]
    y = swiglu._swiglu(x.detach())
    assert y.grad_fn is None


def test_layouts_reaching_the_launcher(calls):
    """Strided rows (a slice of a wider GEMM output) are read in place; an expanded gradient
    (``y.sum().backward()``) and a batch that cannot be one view are copied to rows."""
    merged = torch.randn(4, 6, 3 * 16)
    gate_up = merged[..., 16:48].requires_grad_()
    y = swiglu._swiglu(gate_up)
    assert calls[-1][3].data_ptr() == gate_up.data_ptr() and calls[-1][3].stride(0) == 48
    y.sum().backward()
    dy = calls[-1][3]
    assert calls[-1][0] and dy.shape == (24, 16) and dy.stride(1) == 1
    torch.testing.assert_close(gate_up.grad, torch.autograd.grad(
        hf_swiglu(gate_up).sum(), gate_up)[0])
    transposed = torch.randn(6, 4, 16).transpose(0, 1)  # rows cannot be one strided view
    torch.testing.assert_close(swiglu._swiglu(transposed), hf_swiglu(transposed))
    assert calls[-1][3].is_contiguous()


def test_opcheck(calls):
    x = torch.randn(3, 5, 2 * 12, requires_grad=True)
    torch.library.opcheck(torch.ops.custom_kernels.swiglu_fwd.default, (x,))
    y = torch.ops.custom_kernels.swiglu_fwd(x)
    # The backward op has no autograd of its own (no double backward): detached inputs.
    torch.library.opcheck(torch.ops.custom_kernels.swiglu_bwd.default,
                          (torch.randn_like(y), x.detach()))
    torch.library.opcheck(torch.ops.custom_kernels.swiglu_fwd.default,
                          (torch.randn(8, 6, 32)[:, 2, :].requires_grad_(),))


# --- launcher pieces ---------------------------------------------------------------------------

def test_vector_ok():
    assert swiglu.vector_ok(2, 14336, (28672, 14336), (0, 512))
    assert swiglu.vector_ok(4, 4, (8, 4))
    assert not swiglu.vector_ok(2, 11)
    assert not swiglu.vector_ok(4, 6)
    assert not swiglu.vector_ok(2, 64, (100,))
    assert not swiglu.vector_ok(2, 64, (), (2,))
    assert swiglu.vector_ok(2, 64, (0,))  # an expanded row


@pytest.mark.parametrize("rows, vectors", [(4096, 1792), (1, 1), (7, 11), (3, 256), (3, 257),
                                           (10 ** 6, 1), (10 ** 7, 1792), (5, 2000)])
def test_grid_covers_every_vector(rows, vectors):
    (gx, gy), shift = swiglu.grid_shape(rows, vectors)
    lanes = 1 << shift
    rows_per_block = swiglu.BLOCK // lanes
    assert lanes * rows_per_block == swiglu.BLOCK
    assert gx * lanes >= vectors > (gx - 1) * lanes  # every vector, no idle block column
    assert lanes < 2 * vectors or lanes == 1       # short rows share a block
    assert gy <= swiglu.MAX_GRID_Y and (gy == swiglu.MAX_GRID_Y or gy * rows_per_block >= rows)


def test_kernel_names():
    assert swiglu.KERNELS == {False: "swiglu_fwd_kernel", True: "swiglu_bwd_kernel"}
    source = (swiglu.jit.CSRC / swiglu.SOURCE).read_text()
    assert all(f"{name}(" in source for name in swiglu.KERNELS.values())
