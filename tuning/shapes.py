"""GEMM problem sizes from user input: shape strings, shape files and the Linear layers of a model.

A shape is ``(M, N, K, L)``: D[M, N] = A[M, K] @ B[K, N], repeated over a batch of L. Strings
are written ``MxNxK`` or ``MxNxKxL`` (L defaults to 1). Models are built on the ``meta`` device by
default, so harvesting the shapes of a model with billions of parameters allocates nothing.
"""

from __future__ import annotations

import importlib
import os
import re
from typing import Any

Shape = tuple[int, int, int, int]

EXPECTED_FORM = "'MxNxK' or 'MxNxKxL' with positive integers, e.g. '16x4096x4096'"

# Plain decimal digits only: int() alone would also accept '+5', '1_000' or full-width digits.
_SHAPE_PATTERN = re.compile(r"([0-9]+)x([0-9]+)x([0-9]+)(?:x([0-9]+))?", re.IGNORECASE)


def parse_shape(text: str) -> Shape:
    """Parse ``MxNxK`` or ``MxNxKxL`` into ``(M, N, K, L)``; raise ValueError on anything else."""
    match = _SHAPE_PATTERN.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"bad GEMM shape {text!r}: expected {EXPECTED_FORM}")
    m, n, k, batch = match.groups()
    shape = (int(m), int(n), int(k), int(batch) if batch is not None else 1)
    if min(shape) < 1:
        raise ValueError(
            f"bad GEMM shape {text!r}: every size must be >= 1; expected {EXPECTED_FORM}"
        )
    return shape


def format_shape(m: int, n: int, k: int, batch: int = 1) -> str:
    """The inverse of parse_shape: ``MxNxK``, with ``xL`` appended only for a real batch."""
    text = f"{m}x{n}x{k}"
    return text if batch == 1 else f"{text}x{batch}"


def _strip_comment(line: str) -> str:
    return line.split("#", 1)[0].strip()


def read_shapes_file(path: str | os.PathLike[str]) -> list[Shape]:
    """One shape per line; blank lines and ``#`` comments (whole-line or trailing) are skipped."""
    shapes = []
    with open(path, encoding="utf-8") as file:
        for line_number, line in enumerate(file, start=1):
            text = _strip_comment(line)
            if not text:
                continue
            try:
                shapes.append(parse_shape(text))
            except ValueError as error:
                raise ValueError(f"{os.fspath(path)}, line {line_number}: {error}") from None
    return shapes


def _linear_gemms(tokens: int, in_features: int, out_features: int, backward: bool) -> list[Shape]:
    """The GEMMs of one Linear layer applied to ``tokens`` rows."""
    forward = (tokens, out_features, in_features, 1)  # y = x W^T
    if not backward:
        return [forward]
    grad_input = (tokens, in_features, out_features, 1)  # dX = dY W
    grad_weight = (out_features, in_features, tokens, 1)  # dW = dY^T X
    return [forward, grad_input, grad_weight]


def harvest_linear_shapes(model: Any, tokens: int, *, backward: bool = False) -> list[Shape]:
    """Every distinct GEMM the ``torch.nn.Linear`` layers of ``model`` run on ``tokens`` rows.

    Order is first-seen, so the list follows the model's layer order; layers of equal size (the
    usual case in a transformer) contribute their shapes once.
    """
    import torch

    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    # A dict keeps insertion order, which makes it an ordered set.
    shapes: dict[Shape, None] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            gemms = _linear_gemms(tokens, module.in_features, module.out_features, backward)
            shapes.update(dict.fromkeys(gemms))
    return list(shapes)


# Layouts (A, B as t = row-major, n = column-major) of a Linear layer's GEMMs as cutlass_ops.ops
# runs them: y = x W^T reads W as a column-major B; dX = dY W reads W row-major; dW = dY^T X reads
# dY transposed (column-major A).
LINEAR_LAYOUTS = ("tn", "tt", "nt")


def harvest_linear_gemms(model: Any, tokens: int, *,
                         backward: bool = False) -> list[tuple[Shape, str, str]]:
    """Like ``harvest_linear_shapes``, with each GEMM's operand layouts and fused epilogue
    ("bias" for the forward GEMM of a Linear with a bias, else ""): what to tune so that
    cutlass_ops.nn.Linear finds exact hits in forward and backward."""
    import torch

    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    gemms: dict[tuple[Shape, str, str], None] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            gemms.update(dict.fromkeys(_layer_gemms(tokens, module.in_features,
                                                    module.out_features, backward,
                                                    module.bias is not None)))
        else:
            gemms.update(dict.fromkeys(_fused_block_gemms(module, tokens, backward)))
    return list(gemms)


def _layer_gemms(tokens, in_features, out_features, backward, bias, residual=False):
    shapes = _linear_gemms(tokens, in_features, out_features, backward)
    forward = ",".join(part for part, on in (("bias", bias), ("residual", residual)) if on)
    return list(zip(shapes, LINEAR_LAYOUTS, [forward] + [""] * (len(shapes) - 1)))


def _fused_block_gemms(module, tokens: int, backward: bool) -> list:
    """The GEMMs a decoder layer runs once ``convert`` fuses it (cutlass_ops.decoder_blocks):
    Q, K and V as one GEMM, gate and up as one, o_proj and down_proj with the residual in their
    epilogue (a mixture-of-experts layer: its attention's only). Layers that are not built like one add nothing (their Linears are harvested on
    their own)."""
    from cutlass_ops import decoder_blocks

    if not decoder_blocks.looks_like_decoder_layer(module):
        return []
    attention, mlp = module.self_attn, module.mlp
    if decoder_blocks.structure_refusal(module, require_gpu=False) is not None:
        return []
    # A mixture-of-experts layer fuses its attention half and its shared experts' gate+up (its
    # routed experts' grouped GEMMs: model_grouped_problems).
    moe = decoder_blocks.has_moe_mlp(module)
    merged = []
    for group in ((attention.q_proj, attention.k_proj, attention.v_proj),
                  *(() if moe else ((mlp.gate_proj, mlp.up_proj),))):
        width = sum(layer.out_features for layer in group)
        merged += _layer_gemms(tokens, group[0].in_features, width, backward,
                               group[0].bias is not None)
    for shared in decoder_blocks.shared_expert_mlps(mlp).values() if moe else ():
        width = shared.gate_proj.out_features + shared.up_proj.out_features
        merged += _layer_gemms(tokens, shared.gate_proj.in_features, width, backward,
                               shared.gate_proj.bias is not None)
    for layer in (attention.o_proj,) if moe else (attention.o_proj, mlp.down_proj):
        merged += _layer_gemms(tokens, layer.in_features, layer.out_features, backward,
                               layer.bias is not None, residual=True)
    return merged


def model_problems(model: Any, tokens: int, *, dtype: str = "bf16", out_dtype: str | None = None,
                   backward: bool = False, loss_chunk_rows: int | None = None) -> list:
    """The GemmProblems to tune so that a converted model finds exact hits: each Linear's GEMMs
    on ``tokens`` rows in the layouts cutlass_ops.nn.Linear runs them with, and, with
    ``loss_chunk_rows``, the chunked head of cutlass_ops.linear_cross_entropy (the lm_head's three
    GEMMs on a chunk of rows: logits, grad of hidden, grad of weight)."""
    from cutlass_ops.gemms.config import GemmOperands, GemmProblem

    letters = {"t": "row", "n": "col"}
    gemms = harvest_linear_gemms(model, tokens, backward=backward)
    head = getattr(model, "lm_head", None)
    if loss_chunk_rows and head is not None:
        chunk = _linear_gemms(loss_chunk_rows, head.in_features, head.out_features, True)
        gemms += [(shape, layout, "") for shape, layout in zip(chunk, LINEAR_LAYOUTS)]
    problems = []
    for (m, n, k, batch), layout, epilogue in gemms:
        operands = GemmOperands.make(dtype, layout_a=letters[layout[0]],
                                     layout_b=letters[layout[1]], out_dtype=out_dtype,
                                     epilogue=epilogue)
        problems.append(GemmProblem(operands, m, n, k, batch))
    return list(dict.fromkeys(problems))


def model_grouped_problems(model: Any, tokens: int, *, dtype: str = "bf16",
                           backward: bool = False) -> list:
    """The grouped GEMM problems (``tuning.grouped_search``) of the model's mixture-of-experts
    layers, as ``convert`` runs them (``cutlass_ops.moe``): each experts module's gate+up and
    down GEMMs over ``tokens`` x top-k routed rows, with their dX and dW when ``backward``.
    Top-k comes from the model's config (``num_experts_per_tok``) or a router's ``top_k``."""
    from cutlass_ops.moe.experts import looks_like_experts
    from tuning.grouped_search import moe_problems

    experts = [m for m in model.modules() if looks_like_experts(m)]
    if not experts:
        return []
    top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None) or next(
        (m.top_k for m in model.modules() if isinstance(getattr(m, "top_k", None), int)), None)
    if not top_k:
        raise ValueError("the model has mixture-of-experts layers but neither its config's "
                         "num_experts_per_tok nor a router's top_k says how many experts a "
                         "token takes; tune them with --grouped E:N:K --tokens ROWS")
    problems = []
    for module in experts:
        count, double_inter, hidden = module.gate_up_proj.shape
        for n, k in ((double_inter, hidden), (hidden, double_inter // 2)):
            problems += moe_problems(count, n, k, tokens * top_k, backward=backward,
                                     element=dtype)
    return list(dict.fromkeys(problems))


def _split_model_spec(spec: str) -> tuple[str, str]:
    module_name, separator, attribute = spec.partition(":")
    module_name, attribute = module_name.strip(), attribute.strip()
    if not separator or not module_name or not attribute or ":" in attribute:
        raise ValueError(
            f"bad model spec {spec!r}: expected 'package.module:callable', "
            "e.g. 'mymodels.llama:build'"
        )
    return module_name, attribute


def _resolve_attribute(module: Any, dotted_name: str, spec: str) -> Any:
    # Dotted names let a spec reach a classmethod or a factory nested in a namespace.
    target = module
    for name in dotted_name.split("."):
        try:
            target = getattr(target, name)
        except AttributeError:
            message = f"model spec {spec!r}: {module.__name__!r} has no {dotted_name!r}"
            raise ValueError(message) from None
    return target


def load_model(spec: str, device: str = "meta") -> Any:
    """Import ``package.module:callable`` and call it with no arguments to build an nn.Module.

    The call runs under ``torch.device(device)``: on the default ``meta`` device parameters have a
    shape but no storage, so any model can be inspected for its shapes at no memory cost.
    """
    import torch

    module_name, attribute = _split_model_spec(spec)
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"model spec {spec!r}: cannot import {module_name!r}: {error}") from error
    factory = _resolve_attribute(module, attribute, spec)
    if not callable(factory):
        raise ValueError(f"model spec {spec!r}: {attribute!r} is not callable")
    with torch.device(device):
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"model spec {spec!r}: {attribute}() returned {type(model).__name__}, "
            "expected a torch.nn.Module"
        )
    return model
