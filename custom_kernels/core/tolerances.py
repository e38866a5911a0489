"""How far a correct kernel's result may be from its float32 reference: one table for every kernel
family, read by the tuner before a candidate may win (and by anything else that checks a kernel).

The measure is the relative Frobenius error ``||result - reference|| / ||reference||``. A wrong
kernel (a missed tile or row, a wrong stride, an unwritten output) is off by order 1 or NaN; a
correct one only by rounding. Each bound sits several times above the rounding of its dtype and
far below a wrong kernel's error. Torch-free at import.
"""

from __future__ import annotations

from custom_kernels.core.elements import element

GEMM = "gemm"
NORMS = "norms"
# A whole model against its eager self in the same dtype (benchmarks/model_checks.py): the
# converted model's logits at each decoding step, and every parameter's gradient of a train step.
MODEL_LOGITS = "model logits"
MODEL_GRADIENTS = "model gradients"

# Bound by element dtype and kernel family. The columns differ where the arithmetic does:
# - float32: a GEMM's f32 operands run on the tensor cores as TF32 (10-bit mantissa), and that
#   input rounding adds up over the K products of each output; the norms compute in true float32,
#   so only the order of their row reductions differs from the reference.
# - float16 / bfloat16: both families round their outputs to the dtype (unit roundoff 2^-11 /
#   2^-8); a GEMM adds the float32 accumulation over K on top. The norms' bounds cover every output
#   they compare (y and the new residual forward; dx, dW and dB backward) and keep more headroom
#   for bfloat16; either family's value would separate right from wrong results.
# - model logits / gradients: a whole bf16 model against its eager self compounds every kernel's
#   rounding over the layers (forward for the logits, forward and backward for the gradients),
#   and the converted model's kernels (merged GEMMs, fused norms with the residual add inside,
#   the chunked loss) round in another order than eager's. The bound sits above that noise at
#   the e2e benchmark's depth (8 Llama-3-8B-shaped layers, H200: eager's own KV-cache decode
#   steps are up to 2.5% from its full forward over the same tokens, torch.compile's prefill
#   logits 3.4% from eager's; the converted model's worst gradient 2.6%, its decode steps 2.4%)
#   and far below a broken model's error: a skipped decoder layer's parameters get no gradient
#   and a zeroed MLP's gate and up projections zeros (error 1), and the logits move by order 1.
#   float16 has 3 more mantissa bits than bfloat16; no converted float32 model is compared
#   (convert() leaves float32 layers alone): its bound is for whole-model tests on a CPU.
_BOUNDS = {
    #            GEMM   norms        model logits       model gradients
    "bfloat16": {GEMM: 1e-2, NORMS: 2e-2, MODEL_LOGITS: 5e-2, MODEL_GRADIENTS: 5e-2},
    "float16": {GEMM: 4e-3, NORMS: 5e-3, MODEL_LOGITS: 1e-2, MODEL_GRADIENTS: 1e-2},
    "float32": {GEMM: 5e-3, NORMS: 1e-4, MODEL_LOGITS: 1e-3, MODEL_GRADIENTS: 1e-3},  # GEMM: TF32
}


def relative_tolerance(dtype, family: str = GEMM) -> float:
    """The bound for results of ``dtype`` (a DType, its value "bf16" / "f16" / "f32", a torch
    dtype or its name) from a kernel of ``family``."""
    try:
        name = element(dtype).torch_name  # our names, torch's, torch dtypes: the one table
    except ValueError:
        name = None
    if name not in _BOUNDS:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {sorted(_BOUNDS)}")
    column = _BOUNDS[name]
    if family not in column:
        raise ValueError(f"no tolerance for kernel family {family!r}; known: {sorted(column)}")
    return column[family]


def relative_error(result, reference) -> float:
    """``||result - reference|| / ||reference||`` (Frobenius), computed in float32; NaN when the
    result holds NaN (an unwritten output)."""
    reference = reference.float()
    error = (result.float() - reference).norm() / reference.norm().clamp_min(1e-30)
    return float(error.item())
