"""``cutlass_ops.scaled_grouped_mm``: FP8 grouped GEMMs, the forward of an FP8 mixture-of-experts
layer (issue 53), in ``torch._scaled_grouped_mm``'s 2d-3d form, with torch's rowwise scales and
the blockwise scales torch lacks:

    out[rows of expert g] = (a[rows of g] * scale_a) @ (b[g] * scale_b[g])   in float32, as bf16

- ``a`` [M, K] e4m3, row-major: the tokens, sorted by expert;
- ``b`` [E, K, N] e4m3, K contiguous: each expert's ``nn.Linear`` weight [N, K] transposed;
- ``offs`` [E] int32: cumulative ends of each expert's rows, never read on the host (a call can
  be captured in a CUDA graph); rows past the last end are not written;
- rowwise scales (torch's): ``scale_a`` [M] float32, ``scale_b`` [E, N];
- blockwise scales (DeepSeek-V3's recipe): ``scale_a`` [M, K/128], one a token and 128 columns;
  ``scale_b`` [E, K/128, N/128], one a 128x128 block of each expert's weight (``scaled_mm``'s
  blockwise shapes with an expert dimension in front); any strides.

The recipe is read from the scales' shapes, as ``scaled_mm`` reads it. Where a call runs:
- tensors off a CUDA device: the dequantized float32 product (``reference``; the CPU rule of
  ``custom_kernels.core.fallback``);
- rowwise on a GPU: ``torch._scaled_grouped_mm``, or our CUTLASS rowwise grouped kernel where a
  GPU tune (``cutlass-tune tune --grouped E:N:K --fp8 rowwise``) stored one as faster on every
  routing it timed, after checking it against the float32 reference;
- blockwise on a GPU: the CUTLASS FP8 blockwise grouped kernel
  (``cutlass_ops.gemms.grouped.grouped_fp8_runtime``; ``BLOCKWISE_KERNEL``); with it turned off,
  the documented fallback: both operands dequantized to bf16 and multiplied by
  ``cutlass_ops.grouped_mm`` (correct to bf16's rounding, slower, logged once).

A custom op ``cutlass_ops::scaled_grouped_mm`` with a fake, so ``torch.compile(fullgraph=True)``
traces it. FP8 operands take no gradient: the training step quantizes around the op.
"""

from __future__ import annotations

import enum

import torch
from torch import Tensor

from cutlass_ops.moe.grouped import bounds, grouped_mm
from custom_kernels.core import fallback
from custom_kernels.core.errors import UnsupportedInputError

ENTRY = "cutlass_ops.scaled_grouped_mm"
BLOCK = 128
FP8 = torch.float8_e4m3fn
# Blockwise calls run the CUTLASS blockwise grouped kernel (tests/gpu/moe/test_grouped_fp8_gpu.py
# passed: docs/measurements.md); False sends them to the dequantized fallback through grouped_mm.
BLOCKWISE_KERNEL = True


class GroupedRecipe(enum.Enum):
    ROWWISE = "rowwise"
    BLOCKWISE = "blockwise"


def check(a, b, scale_a, scale_b, offs, out_dtype) -> GroupedRecipe:
    """Every rule of a call, the recipe when they hold; UnsupportedInputError naming the rule
    otherwise."""
    tensors = {"a": a, "b": b, "scale_a": scale_a, "scale_b": scale_b, "offs": offs}
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise UnsupportedInputError(f"{ENTRY}: {name} is a {type(t).__name__}, not a tensor")
    if a.dtype != FP8 or b.dtype != FP8:
        raise UnsupportedInputError(f"{ENTRY}: a and b must be float8_e4m3fn, not {a.dtype} and "
                                    f"{b.dtype}")
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1]:
        raise UnsupportedInputError(
            f"{ENTRY} takes the 2d-3d form, a [M, K] and b [E, K, N] with one K; got "
            f"{tuple(a.shape)} and {tuple(b.shape)}")
    (m, k), (experts, _, n) = a.shape, b.shape
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise UnsupportedInputError(f"{ENTRY}: a must be row-major and b K contiguous (each "
                                    "expert's [N, K] weight transposed)")
    if offs.dtype != torch.int32 or offs.shape != (experts,):
        raise UnsupportedInputError(f"{ENTRY}: offs must be int32 of shape ({experts},), got "
                                    f"{offs.dtype} {tuple(offs.shape)}")
    if out_dtype != torch.bfloat16:
        raise UnsupportedInputError(f"{ENTRY} writes bfloat16, not {out_dtype}")
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        raise UnsupportedInputError(f"{ENTRY}: scales must be float32")
    sa, sb = tuple(scale_a.shape), tuple(scale_b.shape)
    if sa in ((m,), (m, 1)) and sb in ((experts, n), (experts, 1, n)):
        if k % 16 or n % 16:
            raise UnsupportedInputError(f"{ENTRY}: rowwise K and N must be multiples of 16")
        recipe = GroupedRecipe.ROWWISE
    elif sa == (m, k // BLOCK) and sb == (experts, k // BLOCK, n // BLOCK):
        if k % BLOCK or n % BLOCK:
            raise UnsupportedInputError(f"{ENTRY}: blockwise K and N must be multiples of {BLOCK}")
        recipe = GroupedRecipe.BLOCKWISE
    else:
        raise UnsupportedInputError(
            f"{ENTRY}: scale_a {sa} and scale_b {sb} name no recipe for M={m}, K={k}, N={n}, "
            f"E={experts}: rowwise ({m},) and ({experts}, {n}); blockwise ({m}, {k // BLOCK}) "
            f"and ({experts}, {k // BLOCK}, {n // BLOCK})")
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise UnsupportedInputError(f"{ENTRY}: tensors on different devices: "
                                    f"{sorted(map(str, devices))}")
    return recipe


def dequantized_a(a, scale_a, recipe: GroupedRecipe, dtype=torch.float32) -> Tensor:
    """a [M, K] times its scales, in ``dtype``."""
    if recipe is GroupedRecipe.ROWWISE:
        return (a.float() * scale_a.reshape(-1, 1)).to(dtype)
    return (a.float() * scale_a.repeat_interleave(BLOCK, dim=1)[:, :a.shape[1]]).to(dtype)


def dequantized_b(b, scale_b, recipe: GroupedRecipe, dtype=torch.float32) -> Tensor:
    """b [..., K, N] (all experts, or one) times its scales [..., N] / [..., K/128, N/128], in
    ``dtype``."""
    k, n = b.shape[-2:]
    if recipe is GroupedRecipe.ROWWISE:
        return (b.float() * scale_b.reshape(*b.shape[:-2], 1, n)).to(dtype)
    blocks = scale_b.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return (b.float() * blocks[..., :k, :n]).to(dtype)


def reference(a, b, scale_a, scale_b, offs) -> Tensor:
    """The float32 product, as bf16: one matmul an expert, each expert's weight dequantized on
    its own (``offs`` read on the host: the CPU rule and the tests' ground truth, the blockwise
    kernel's too); rows past the last end are zero."""
    recipe = check(a, b, scale_a, scale_b, offs, torch.bfloat16)
    a32 = dequantized_a(a, scale_a, recipe)
    out = torch.zeros((a.shape[0], b.shape[2]), dtype=torch.float32, device=a.device)
    if recipe is GroupedRecipe.ROWWISE:
        scale_b = scale_b.reshape(b.shape[0], -1)
    for g, (start, end) in enumerate(bounds(offs, a.shape[0])):
        if end > start:
            out[start:end] = a32[start:end] @ dequantized_b(b[g], scale_b[g], recipe)
    return out.to(torch.bfloat16)


def _blockwise_kernel(a, b, scale_a, scale_b, offs) -> Tensor:
    from cutlass_ops.gemms.grouped import grouped_build, grouped_fp8_entries, grouped_fp8_runtime

    # The kernel reads each expert's weight as [N, K] and its scales N blocks first.
    weights = b.transpose(1, 2)
    sb = grouped_fp8_runtime.weight_scale_layout(scale_b.transpose(1, 2))
    # The tuned kernel of this problem (cutlass-tune tune --grouped E:N:K --fp8 blockwise), else
    # the default one.
    problem = grouped_build.GroupedFp8Problem.of(a, weights)
    config = grouped_fp8_entries.tuned_config(problem, a.device.index) or \
        grouped_build.GroupedFp8Config()
    return grouped_fp8_runtime.run(config, a, weights, scale_a, sb, offs)


def _tuned_rowwise(a, b):
    """The rowwise kernel a GPU tune stored for this problem as faster than
    ``torch._scaled_grouped_mm`` on every routing it timed, or None (then torch's runs)."""
    from cutlass_ops.gemms.grouped import grouped_build, grouped_fp8_entries

    problem = grouped_build.GroupedFp8Problem.of(a, b.transpose(1, 2), "rowwise")
    return grouped_fp8_entries.tuned_config(problem, a.device.index)


def _run(a, b, scale_a, scale_b, offs, out_dtype) -> Tensor:
    recipe = check(a, b, scale_a, scale_b, offs, out_dtype)
    if a.device.type != "cuda":
        fallback.log_once(f"{ENTRY} uses the float32 reference",
                          f"the tensors are on {a.device}, not a CUDA device")
        return reference(a, b, scale_a, scale_b, offs)
    if recipe is GroupedRecipe.ROWWISE:
        scale_a, scale_b = scale_a.reshape(-1), scale_b.reshape(b.shape[0], -1)
        tuned = _tuned_rowwise(a, b)
        if tuned is not None:
            from cutlass_ops.gemms.grouped import grouped_fp8_runtime

            return grouped_fp8_runtime.run(tuned, a, b.transpose(1, 2), scale_a.contiguous(),
                                           scale_b.contiguous(), offs)
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype)
    if BLOCKWISE_KERNEL:
        return _blockwise_kernel(a, b, scale_a, scale_b, offs)
    fallback.log_once(f"{ENTRY} runs blockwise calls dequantized, through grouped_mm",
                      "the FP8 blockwise grouped kernel has not yet run on a GPU")
    return grouped_mm(dequantized_a(a, scale_a, recipe, torch.bfloat16),
                      dequantized_b(b, scale_b, recipe, torch.bfloat16), offs, out_dtype=out_dtype)


@torch.library.custom_op("cutlass_ops::scaled_grouped_mm", mutates_args=())
def scaled_grouped_mm_op(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, offs: Tensor,
                         out_dtype: torch.dtype) -> Tensor:
    return _run(a, b, scale_a, scale_b, offs, out_dtype)


@scaled_grouped_mm_op.register_fake
def _(a, b, scale_a, scale_b, offs, out_dtype):
    check(a, b, scale_a, scale_b, offs, out_dtype)
    return a.new_empty((a.shape[0], b.shape[2]), dtype=out_dtype)


def scaled_grouped_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, offs: Tensor, *,
                      out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``(a * scale_a) @ (b * scale_b)`` an expert at a time (module docstring)."""
    check(a, b, scale_a, scale_b, offs, out_dtype)  # by name, before torch's own schema refusal
    return scaled_grouped_mm_op(a, b, scale_a, scale_b, offs, out_dtype)
