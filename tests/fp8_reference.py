"""The FP8 linear's reference for the tests (tests/cpu/fp8/test_fp8_linear.py and its GPU twin):
each GEMM's operands quantized and dequantized along their reduction with the block the recipe
names, written here apart from cutlass_ops.fp8 (its own table, no transposed layouts, no
padding: partial blocks are blocks of their own), and the random operands it is checked on.

The reference runs on the CPU whatever the tensors' device: its quantization follows the
library's rule to the bit (float32 amax, ``inv = fp8_max / amax`` an IEEE float32 division,
``m * inv`` one rounded product, ``scale = 1 / inv``, round-to-nearest-even cast), its products
are float64. On a CUDA device a quotient by a Python number is computed as a product by its
reciprocal, one ulp off for some amaxes;
bf16 values then often land exactly on an FP8 rounding tie (a row of amax 2.625 = 21/8 sends
2.15625 to 368, halfway between 352 and 384), which the ulp breaks the other way: a reference
computed so on the GPU differed from correct layers by up to 3% a row (one FP8 step, 6%, on
many of a row's values)."""

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
# Each output row against its reference row. What separates a correct layer from the reference:
# its bf16 output (one rounding, 2^-9 an element: 0.002-0.0025 a row here), and on a GPU the
# GEMM's accumulation (its order; the tensorwise and rowwise forwards' fast accumulation keeps
# about 14 bits an add, DeepSeek-V3's measure: a few 1e-4 a row at K <= 384). A wrong
# granularity, orientation or FP8 type moves many quantized values by an FP8 step: from 1.5e-2
# (x's row against its 1x128 blocks, K 256) to 0.17 a row on these operands at 200 and 256
# tokens (``wrong_specs``; tests check it).
BOUND = 1e-2
# Which outputs (y, dx, dW) each entry of a spec reaches.
REACHES = {"x": (0,), "w": (0, 1), "dy": (1, 2), "xt": (2,), "grad": (1, 2)}
BLOCKS = [(None, None), (1, None), (None, 1), (1, 128), (128, 1), (128, 128)]


def dequantized(t, block, dtype=E4M3):
    """``t`` through ``dtype`` and back, one scale (1 / (the type's largest / amax)) per
    ``block`` (rows, cols) of ``t``; partial blocks at the ends are blocks of their own.
    Quantized on the CPU in float32 with the library's rule (module docstring), returned in
    float64 (exact: an FP8 value times a float32 scale)."""
    t = t.detach().cpu().float()
    rows, cols = t.shape
    br = rows if block[0] is None else block[0]
    bc = cols if block[1] is None else block[1]
    padded = F.pad(t, (0, -cols % bc, 0, -rows % br))
    blocks = padded.reshape(padded.shape[0] // br, br, padded.shape[1] // bc, bc)
    top = torch.tensor(torch.finfo(dtype).max, dtype=torch.float32)  # a tensor: IEEE division
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    inv = torch.where(amax == 0, torch.ones_like(amax), top / amax)
    inv = inv.clamp(max=torch.finfo(torch.float32).max)
    scale = torch.reciprocal(inv)
    q = (blocks * inv).clamp(-top, top).to(dtype).double() * scale.double()
    return q.reshape(padded.shape)[:rows, :cols]


def reference(spec, x, w, bias, dy):
    """(y, dx, dW) in float64 on the CPU from the dequantized operands of each GEMM."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    y = dequantized(x2, spec["x"]) @ dequantized(w, spec["w"]).t()
    if bias is not None:
        y = y + bias.detach().cpu().double()
    dx = dequantized(dy2, spec["dy"], spec["grad"]) @ dequantized(w.t(), spec["w"]).t()
    dw = dequantized(dy2.t(), spec["dy"], spec["grad"]) @ dequantized(x2.t(), spec["xt"]).t()
    return y, dx, dw


def wrong_specs(recipe):
    """(what, spec, outputs): ``SPEC[recipe]`` with one entry changed (each other block of
    ``BLOCKS``: another granularity or the transposed orientation; the other FP8 type for the
    gradients) and the indices of the outputs (y, dx, dW) the change reaches."""
    spec = SPEC[recipe]
    for name, outputs in REACHES.items():
        if name == "grad":
            choices = [E5M2 if spec["grad"] == E4M3 else E4M3]
        else:
            choices = [block for block in BLOCKS if block != spec[name]]
        for choice in choices:
            yield f"{name}={choice}", {**spec, name: choice}, outputs


def row_error(got, want) -> float:
    """The largest relative error of a row (rows of very different sizes are each checked), in
    float64 on the CPU."""
    got, want = (t.detach().reshape(-1, t.shape[-1]).cpu().double() for t in (got, want))
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


def chunked_head_and_fp8_linear(head, hidden, labels, chunk_rows):
    """An FP8 head (``Fp8Linear``) in the chunked loss, and the same head called whole then
    F.cross_entropy, each with its backward: ``(ours, reference, bf16_loss)``, the first two
    ``(loss, grad_hidden, grad_weight)``, the last the bf16 chunked loss on the same tensors."""
    from cutlass_ops.fused_cross_entropy import linear_cross_entropy

    def run(loss_of):
        hidden.grad, head.weight.grad = None, None
        loss = loss_of()
        loss.backward()
        return loss.detach(), hidden.grad.clone(), head.weight.grad.clone()
    ours = run(lambda: linear_cross_entropy(hidden, head.weight, labels, chunk_rows=chunk_rows,
                                            products=head.loss_head_products()))
    reference = run(lambda: F.cross_entropy(head(hidden).float(), labels, ignore_index=-100))
    bf16 = linear_cross_entropy(hidden.detach(), head.weight.detach(), labels)
    return ours, reference, bf16


def kept_operand_sequence(x, w, offs):
    """The FP8 experts' kept forward operand through one weight change: a training call, two
    calls that train nothing, an in-place doubling of ``w``, one more such call. Returns
    ``{"trained", "first", "again", "doubled"}`` (outputs) and ``{"kept_twice", "renewed"}``
    (whether the second no-grad call read the first's operand, whether the change replaced it)."""
    from cutlass_ops.fp8 import fp8_experts

    fp8_experts.clear_weight_copies()
    trained = fp8_experts.fp8_routed_gemm(x, w, offs)
    with torch.no_grad():
        first = fp8_experts.fp8_routed_gemm(x, w, offs)
        kept = fp8_experts._kept(w)[1]
        again = fp8_experts.fp8_routed_gemm(x, w, offs)
        kept_twice = fp8_experts._kept(w)[1] is kept
        w.mul_(2.0)  # an in-place write bumps the version counter
        doubled = fp8_experts.fp8_routed_gemm(x, w, offs)
    return ({"trained": trained, "first": first, "again": again, "doubled": doubled},
            {"kept_twice": kept_twice, "renewed": fp8_experts._kept(w)[1] is not kept})
