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


# FP8 models (benchmarks/e2e.py's FP8 rows; ``fp8_model_tolerance``): a model whose Linears run
# an FP8 recipe, against its eager bf16 self. No fixed bound works there: e4m3's 3 mantissa bits
# put 3.7% of noise on every GEMM (2.6% per quantized operand), and a random-weight Llama
# amplifies it through the layers (float32 emulation of the recipes, benchmarks/fp8_emulation.py,
# 512 tokens: hidden 4096, worst gradient 0.37-0.38 at 2 layers and 0.54-0.55 at 4, logits
# 0.19 / 0.26; hidden 1024, 8 layers: 0.28-0.30 and 0.17), so a bound wide enough for the
# benchmark's 8 layers would pass a model missing a layer (error 1). Instead each parameter's
# gradient, and the logits, may be at most ``FP8_MODEL_MARGINS`` times as far from eager's as the
# recipe's float32 emulation is (torch operations on the same model and tokens), and never need
# be closer than the 16-bit model bound. Two correct implementations of a recipe land alike: at
# hidden 1024 and 4 layers, convert(model, fp8=...) off a GPU (the same quantization, scaled_mm's
# float32 products), torchao 0.18's own emulation (tensorwise, rowwise) and the other recipes
# stay within 0.86-1.10x of the emulation's error on every parameter, while one layer whose
# weight scale is applied twice lands at 3.4-5.1x (its own and its neighbours' parameters).
# The margin leaves room for what the emulation leaves out (the forward's fast accumulation,
# the kernels' order of sums). The loss is not in it: FP8 moved the loss by at most 0.26%
# there, inside the 1% every model check keeps.
FP8_MODEL_MARGINS = {MODEL_LOGITS: 1.5, MODEL_GRADIENTS: 1.5}

# Twin-bounded models (``twin_model_tolerance``): a 16-bit model against its eager self where
# a fixed bound is the wrong question. A MoE router's gate gradient runs through a softmax over
# the router logits and a top-k selection, so near-ties make it fragile in bf16: converted
# models' gate gradients land past the fixed bound with the loss equal to 5 digits
# (docs/measurements.md, "Grouped GEMMs for mixture-of-experts"). The question is instead whether ours is about as far from eager as eager itself is
# from the exact computation: eager's float32 twin (the same model and tokens in float32). Two
# implementations of equal precision each carry their own rounding error against the exact
# result, largely independent, so they differ by about sqrt(2) times either's error; 2.0 leaves
# room for that without hiding a bug of order 1 (a skipped layer, a wrong expert: error 1
# against eager where the twin's is a few percent). The dtype's model bound stays the floor.
TWIN_MODEL_MARGINS = {MODEL_LOGITS: 2.0, MODEL_GRADIENTS: 2.0}


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


def fp8_model_tolerance(emulated_error: float, dtype="bfloat16",
                        family: str = MODEL_GRADIENTS) -> float:
    """The bound for an FP8 model's result (a parameter's gradient, the logits) whose float32
    emulation of the recipe is ``emulated_error`` from the eager reference: the FP8 margin times
    that, or the ``dtype`` model bound where that is wider (see ``FP8_MODEL_MARGINS``). A NaN
    emulation gives no bound (NaN: every comparison fails)."""
    return _margined(emulated_error, dtype, family, FP8_MODEL_MARGINS, "FP8")


def twin_model_tolerance(twin_error: float, dtype="bfloat16",
                         family: str = MODEL_GRADIENTS) -> float:
    """The bound for a ``dtype`` model's result (a parameter's gradient, the logits) whose
    reference's float32 twin is ``twin_error`` from that reference: the twin margin times that,
    or the ``dtype`` model bound where that is wider (see ``TWIN_MODEL_MARGINS``). A NaN twin
    error gives no bound (NaN: every comparison fails)."""
    return _margined(twin_error, dtype, family, TWIN_MODEL_MARGINS, "twin")


def _margined(error: float, dtype, family: str, margins: dict, kind: str) -> float:
    """max(the dtype's bound for ``family``, the margin times ``error``); NaN for a NaN error."""
    if family not in margins:
        raise ValueError(f"no {kind} margin for family {family!r}; known: {sorted(margins)}")
    return max(relative_tolerance(dtype, family), margins[family] * error) \
        if error == error else float("nan")


def relative_error(result, reference) -> float:
    """``||result - reference|| / ||reference||`` (Frobenius), computed in float32; NaN when the
    result holds NaN (an unwritten output)."""
    reference = reference.float()
    error = (result.float() - reference).norm() / reference.norm().clamp_min(1e-30)
    return float(error.item())
