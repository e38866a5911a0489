"""FP8 training emulated in float32 with torch operations alone: the reference an FP8 model's
numerics are checked against (``benchmarks/e2e.py``'s FP8 rows, through
``model_checks.fp8_gradient_bound``: each gradient compared with the emulation's directly), its
CPU tests, and the calibration of the FP8 bound in ``custom_kernels.core.tolerances``
(``python benchmarks/fp8_emulation.py``).

An FP8 GEMM with float32 accumulation computes the exact products of its FP8 operands, so
quantizing each operand (scale, round to the FP8 type, unscale) and multiplying the results in
float32 gives what the hardware gives up to the order of the sums (and the forward's fast
accumulation, which this leaves out). ``emulate_fp8(model, recipe)`` swaps the forward of every
``nn.Linear`` but the LM head for such a Linear, forward and backward: each operand of its three
GEMMs is quantized as ``cutlass_ops.fp8.recipes`` says (which matrix, which FP8 type, which scale
granularity along the reduction), by the plain torch code below, not by our kernels: the recipe
table is shared, the implementation is not. torchao's tensorwise and rowwise recipes are ours
(its rowwise rounds scales to powers of two, which moves no value's relative precision).

``wrong_scale`` plants a fault for the tests: one layer's weight scale is applied twice on
dequantization (a scale kernel's typical slip), so that layer's products are off by a factor.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "blockwise")
BLOCK = 128
# (block rows, block columns) of a granularity's scale; None: the whole dimension.
_BLOCKS = {"tensor": (None, None), "row": (1, None), "block_1x128": (1, BLOCK),
           "block_128x128": (BLOCK, BLOCK)}


def recipe_table(recipe: str):
    """The recipe's record (``cutlass_ops.fp8.recipes``): forward, dgrad and wgrad GEMMs."""
    from cutlass_ops.fp8 import recipes

    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; known: {RECIPES}")
    return recipes.get(recipe)


def quantize(t: torch.Tensor, dtype, block_rows=None, block_cols=None, scale_error=1.0):
    """``t`` [R, K] (K: the GEMM's reduction dimension) through ``dtype`` and back, one scale per
    block of ``block_rows`` x ``block_cols`` (None: the whole dimension), each mapping its block's
    amax to the type's largest value; float32. Extents that are not multiples of a block are
    padded with zeros (which change no amax). ``scale_error`` multiplies the dequantized values
    (1: correct)."""
    t = t.float()
    rows, cols = t.shape
    br, bc = block_rows or rows, block_cols or cols
    padded = torch.nn.functional.pad(t, (0, -cols % bc, 0, -rows % br))
    pr, pc = padded.shape
    blocks = padded.reshape(pr // br, br, pc // bc, bc)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-12)
    scale = torch.finfo(dtype).max / amax
    q = (blocks * scale).to(dtype).float() / scale * scale_error
    return q.reshape(pr, pc)[:rows, :cols]


def _operand(t, operand, scale_error=1.0):
    """One GEMM operand [R, K] quantized as the recipe's ``Operand`` record says."""
    granularity = getattr(operand.granularity, "value", operand.granularity)
    return quantize(t, operand.dtype, *_BLOCKS[granularity], scale_error)


def _gemm(a, b, gemm, scale_error=1.0):
    """``a`` [M, K] @ ``b`` [N, K]^T with both operands quantized along K per ``gemm`` (a
    ``recipes.Gemm``); ``scale_error`` applies to ``b``, the weight in the forward and dgrad."""
    return _operand(a, gemm.a) @ _operand(b, gemm.b, scale_error).t()


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, table, scale_error):
        ctx.save_for_backward(x, weight)
        ctx.table, ctx.scale_error = table, scale_error
        y = _gemm(x.reshape(-1, x.shape[-1]), weight, table.forward, scale_error)
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dx = _gemm(dy2, weight.t(), ctx.table.dgrad, ctx.scale_error)
        dw = _gemm(dy2.t(), x2.t(), ctx.table.wgrad)
        return dx.to(x.dtype).reshape(x.shape), dw.to(weight.dtype), None, None


class _FP8ExpertLinear(torch.autograd.Function):
    """One expert's GEMM as ``cutlass_ops.fp8.fp8_experts`` runs it: forward and dgrad quantized
    per the recipe, the weight gradient in high precision (its grouped GEMM is bf16)."""

    @staticmethod
    def forward(ctx, x, weight, table):
        ctx.save_for_backward(x, weight)
        ctx.table = table
        return _gemm(x, weight, table.forward).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = _gemm(dy, weight.t(), ctx.table.dgrad)
        dw = dy.float().t() @ x.float()
        return dx.to(x.dtype), dw.to(weight.dtype), None


def is_experts(module: nn.Module) -> bool:
    """A Hugging Face experts module (Qwen3-MoE's, Mixtral's, ...): 3-d ``gate_up_proj``
    [E, 2I, H] and ``down_proj`` [E, H, I], forward(hidden, top_k_index, top_k_weights)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3 and
            isinstance(down, torch.Tensor) and down.dim() == 3 and hasattr(module, "act_fn"))


def _experts_forward(module: nn.Module, table):
    """Hugging Face's expert loop (gate and up from one GEMM, act(gate) * up, down, weighted,
    summed into each token's row) with each GEMM through ``_FP8ExpertLinear``."""
    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in range(module.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == expert)
            if not token.numel():
                continue
            gate, up = _FP8ExpertLinear.apply(hidden_states[token], module.gate_up_proj[expert],
                                              table).chunk(2, dim=-1)
            y = _FP8ExpertLinear.apply(module.act_fn(gate) * up, module.down_proj[expert],
                                       table)
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out
    return forward


def emulate_fp8(model: nn.Module, recipe: str, *, skip=("lm_head",), wrong_scale=None):
    """Every ``nn.Linear`` of ``model`` (but those whose last name is in ``skip``) computes
    through emulated FP8 GEMMs per ``recipe``, in place; parameters and names are unchanged.
    Under the blockwise recipe, mixture-of-experts layers' experts too (``is_experts``), as
    ``convert`` makes them FP8 (``cutlass_ops.fp8.fp8_experts``: their weight gradients
    bf16). With ``wrong_scale`` (a Linear's name), that layer's weight scale is applied
    twice."""
    table = recipe_table(recipe)
    found = False
    for name, module in model.named_modules():
        if recipe == "blockwise" and is_experts(module):
            module.forward = _experts_forward(module, table)
            continue
        if not isinstance(module, nn.Linear) or name.split(".")[-1] in skip:
            continue
        error = 1.0
        if name == wrong_scale:
            found, error = True, 2.0
        module.forward = _forward(module, table, error)
    if wrong_scale is not None and not found:
        raise ValueError(f"no Linear named {wrong_scale!r}")
    return model


def _forward(module, table, scale_error):
    def forward(x):
        y = _FP8Linear.apply(x, module.weight, table, scale_error)
        return y if module.bias is None else y + module.bias
    return forward


# --- calibration of the FP8 model bounds ---------------------------------------------------------

def errors_against_eager(eager: nn.Module, model: nn.Module, ids: torch.Tensor) -> dict:
    """One train step and one forward of ``model`` against ``eager`` on ``ids``: the loss's
    relative difference, every gradient's relative error (worst and median) and the last
    positions' logits error, as benchmarks/model_checks measures them."""
    from benchmarks import model_checks
    from custom_kernels.core.tolerances import relative_error

    def step(m):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = model_checks.gradients(m)
        m.zero_grad(set_to_none=True)
        with torch.no_grad():
            logits = m(input_ids=ids).logits[:, -16:].float()
        return loss.float().item(), grads, logits

    loss_e, grads_e, logits_e = step(eager)
    loss, grads, logits = step(model)
    errors = sorted(model_checks.gradient_error(grads[n], grads_e[n]) for n in grads_e)
    worst = max(grads_e, key=lambda n: model_checks.gradient_error(grads[n], grads_e[n]))
    return {"loss_relative": abs(loss - loss_e) / abs(loss_e), "grad_worst": errors[-1],
            "grad_worst_parameter": worst, "grad_median": errors[len(errors) // 2],
            "logits": relative_error(logits, logits_e)}


def main() -> None:
    import argparse
    import copy

    import transformers

    parser = argparse.ArgumentParser(description="FP8-emulated Llama against its bf16 self")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES))
    args = parser.parse_args()
    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
        num_key_value_heads=max(1, args.hidden // 512), vocab_size=args.vocab,
        max_position_embeddings=8192)
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, args.vocab, (2, args.tokens // 2),
                        generator=torch.Generator().manual_seed(0))
    for recipe in args.recipes:
        model = emulate_fp8(copy.deepcopy(eager), recipe)
        print(recipe, {k: round(v, 5) if isinstance(v, float) else v
                       for k, v in errors_against_eager(eager, model, ids).items()}, flush=True)
        del model


if __name__ == "__main__":
    main()
