"""The FP8 linear's reference for the tests (tests/cpu/test_fp8_linear.py and its GPU twin):
each GEMM's operands quantized and dequantized along their reduction with the block the recipe
names, written here apart from cutlass_ops.fp8 (its own table, no transposed layouts, no
padding: partial blocks are blocks of their own), and the random operands it is checked on."""

import torch
import torch.nn.functional as F

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ["tensorwise", "rowwise", "blockwise"]

# The reference's own table: the block (rows, cols) of each operand read as a matrix whose rows
# run along the GEMM's reduction (None: the whole extent), and the gradients' FP8 type.
SPEC = {
    "tensorwise": dict(x=(None, None), w=(None, None), dy=(None, None), xt=(None, None),
                       grad=E5M2),
    "rowwise": dict(x=(1, None), w=(1, None), dy=(1, None), xt=(1, None), grad=E4M3),
    "blockwise": dict(x=(1, 128), w=(128, 128), dy=(1, 128), xt=(128, 128), grad=E4M3),
}
# Each output row against its reference row: our outputs round to bf16 once (2^-9), a wrong
# granularity, orientation or FP8 type moves the quantized values by percents.
BOUND = 1e-2


def dequantized(t, block, dtype=E4M3):
    """``t`` through ``dtype`` and back, one scale (amax / the type's largest) per ``block``
    (rows, cols) of ``t``; partial blocks at the ends are blocks of their own."""
    t = t.float()
    rows, cols = t.shape
    br = rows if block[0] is None else block[0]
    bc = cols if block[1] is None else block[1]
    padded = F.pad(t, (0, -cols % bc, 0, -rows % br))
    blocks = padded.reshape(padded.shape[0] // br, br, padded.shape[1] // bc, bc)
    top = torch.finfo(dtype).max
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True) / top
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (blocks / scale).clamp(-top, top).to(dtype).float() * scale
    return q.reshape(padded.shape)[:rows, :cols]


def reference(spec, x, w, bias, dy):
    """(y, dx, dW) in float32 from the dequantized operands of each GEMM."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    y = dequantized(x2, spec["x"]) @ dequantized(w, spec["w"]).t()
    if bias is not None:
        y = y + bias.float()
    dx = dequantized(dy2, spec["dy"], spec["grad"]) @ dequantized(w.t(), spec["w"]).t()
    dw = dequantized(dy2.t(), spec["dy"], spec["grad"]) @ dequantized(x2.t(), spec["xt"]).t()
    return y, dx, dw


def row_error(got, want) -> float:
    """The largest relative error of a row (rows of very different sizes are each checked)."""
    got, want = (t.detach().reshape(-1, t.shape[-1]).float() for t in (got, want))
    return float(((got - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30)).max())


def operand(rows, cols, generator, dtype=torch.bfloat16):
    """Random values whose rows and 128-column blocks differ in size by up to 2^6 (within e4m3's
    range: a scale per row or block changes which values round how, nothing underflows)."""
    t = torch.randn(rows, cols, generator=generator)
    t *= 2.0 ** (6 * torch.rand(rows, 1, generator=generator) - 3)
    blocks = 2.0 ** (6 * torch.rand(1, -(-cols // 128), generator=generator) - 3)
    t *= blocks.repeat_interleave(128, dim=1)[:, :cols]
    return t.to(dtype)


def run_linear(recipe, tokens, k=256, n=384, dtype=torch.bfloat16, bias=True, device="cpu"):
    """x (2, tokens / 2, k), w (n, k), b, dy from ``operand``; y = fp8_linear(x, [w], b,
    recipe) and its backward of dy: (x, w, b, dy, y), the gradients in .grad."""
    from cutlass_ops.fp8.linear import fp8_linear

    generator = torch.Generator().manual_seed(tokens + k + n)

    def make(rows, cols):
        return operand(rows, cols, generator, dtype).to(device)

    x = make(tokens, k).reshape(2, tokens // 2, k).requires_grad_()
    w = make(n, k).requires_grad_()
    b = make(1, n)[0].requires_grad_() if bias else None
    dy = make(tokens, n).reshape(2, tokens // 2, n)
    y = fp8_linear(x, [w], b, recipe)
    y.backward(dy)
    return x, w, b, dy, y
