"""cutlass_ops.fp8 on the CPU: the recipes' table and rules, the FP8 linear's forward, dgrad and
wgrad against a dequantized reference written apart (each operand quantized along its reduction,
with the granularity the recipe names; float64 products), which one wrong entry of the recipe
misses, token counts that need the wgrad's padding, merged weights, fp16, an FP8 input given by
the kernel that wrote x (x_fp8), the weights' FP8 copies for inference (reuse, refresh, limits),
the custom ops under torch.compile(fullgraph=True), and the refusals. The reference:
tests/fp8_reference.py."""

import copy

import pytest
import torch
import torch.nn.functional as F

from cutlass_ops.fp8 import gemm_steps
from cutlass_ops.fp8 import linear as fp8_linear_module
from cutlass_ops.fp8 import recipes
from cutlass_ops.fp8.linear import Fp8Linear, fp8_linear
from custom_kernels.fp8 import fp8_quant
from custom_kernels.core.errors import UnsupportedInputError

from fp8_reference import (BOUND, E4M3, RECIPES, SPEC, operand, reference, row_error,  # noqa: E402
                           run_linear, wrong_specs)


@pytest.fixture(autouse=True)
def quiet(warnings):
    yield  # the CPU rule's log lines, once per test, kept out of the output


# ---- the recipes ------------------------------------------------------------------------------

def test_the_recipes_table():
    for name, spec in SPEC.items():
        r = recipes.get(name)
        assert r.name == name
        assert r.forward.a.dtype == r.forward.b.dtype == r.dgrad.b.dtype == r.wgrad.b.dtype == E4M3
        assert r.dgrad.a.dtype == r.wgrad.a.dtype == spec["grad"]
        assert (r.forward.a.tensor, r.forward.b.tensor, r.dgrad.a.tensor, r.dgrad.b.tensor,
                r.wgrad.a.tensor, r.wgrad.b.tensor) == ("x", "W", "dy", "W^T", "dy^T", "x^T")
        assert not r.dgrad.fast_accum and not r.wgrad.fast_accum
        assert r.forward.fast_accum == (name != "blockwise")
        assert r.feature_multiple == r.token_multiple == (128 if name == "blockwise" else 16)
        assert name.startswith("tensor") == ("e5m2" in r.gradients)
    blockwise = recipes.get("blockwise")
    assert (blockwise.forward.a.granularity, blockwise.forward.b.granularity,
            blockwise.wgrad.a.granularity, blockwise.wgrad.b.granularity) == (
        "block_1x128", "block_128x128", "block_1x128", "block_128x128")
    assert {g.granularity for gemm in (recipes.get("rowwise").forward,
                                       recipes.get("rowwise").wgrad) for g in (gemm.a, gemm.b)} \
        == {"row"}


@pytest.mark.parametrize("name, shape, dtype, words", [
    ("rowwise", (100, 256), torch.bfloat16, "multiples of 16"),
    ("tensorwise", (256, 200), torch.float16, "multiples of 16"),
    ("blockwise", (256, 192), torch.bfloat16, "multiples of 128"),
    ("rowwise", (256, 256), torch.float32, "float32 weights"),
])
def test_layer_rules_refuse_with_the_reason(name, shape, dtype, words):
    r = recipes.get(name)
    assert words in r.refusal(*shape, dtype)
    with pytest.raises(UnsupportedInputError, match=words):
        Fp8Linear(*shape, dtype=dtype, recipe=name)
    assert r.refusal(256, 384 if name != "blockwise" else 512, torch.bfloat16) is None


def test_an_unknown_recipe_is_refused_naming_the_known_ones():
    with pytest.raises(UnsupportedInputError, match="tensorwise, rowwise, blockwise"):
        recipes.get("fp4")


# ---- numerics against the dequantized reference -----------------------------------------------

@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("tokens", [256, 200])  # 200: the wgrad's tokens padded (16 and 128)
def test_forward_and_backward_match_the_dequantized_reference(recipe, tokens):
    x, w, b, dy, y = run_linear(recipe, tokens)
    ref_y, ref_dx, ref_dw = reference(SPEC[recipe], x.detach(), w.detach(), b.detach(), dy)
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.bfloat16
    assert row_error(y, ref_y) < BOUND
    assert row_error(x.grad, ref_dx) < BOUND
    assert row_error(w.grad, ref_dw) < BOUND
    torch.testing.assert_close(b.grad.float(), dy.float().sum((0, 1)), rtol=1e-2, atol=1e-2)
    # Not the bf16 product: the operands really went through FP8.
    exact = F.linear(x.detach().float(), w.detach().float(), b.detach().float())
    assert row_error(y, exact) > 3 * BOUND / 10


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_reference_check_tells_the_recipes_apart(recipe):
    """Another recipe's quantization misses the bound on every GEMM: the check above can
    fail for a wrong granularity, orientation or FP8 type."""
    x, w, b, dy, y = run_linear(recipe, 256)
    for other in RECIPES:
        if other == recipe:
            continue
        ref_y, ref_dx, ref_dw = reference(SPEC[other], x.detach(), w.detach(), b.detach(), dy)
        assert row_error(y, ref_y) > 2 * BOUND, other
        assert row_error(x.grad, ref_dx) > 2 * BOUND, other
        assert row_error(w.grad, ref_dw) > 2 * BOUND, other


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("tokens", [256, 200])
def test_the_reference_check_fails_for_one_wrong_entry(recipe, tokens):
    """One operand's block, orientation or the gradients' FP8 type changed in the reference:
    an output it reaches misses the bound (the GPU twin checks the same)."""
    x, w, b, dy, y = run_linear(recipe, tokens)
    outputs = (y, x.grad, w.grad)
    for what, spec, reached in wrong_specs(recipe):
        refs = reference(spec, x.detach(), w.detach(), b.detach(), dy)
        assert max(row_error(outputs[i], refs[i]) for i in reached) > BOUND, what


def test_fp16_layers_compute_through_a_bf16_output():
    x, w, b, dy, y = run_linear("rowwise", 64, dtype=torch.float16)
    ref_y, ref_dx, ref_dw = reference(SPEC["rowwise"], x.detach(), w.detach(), b.detach(), dy)
    assert y.dtype == x.grad.dtype == w.grad.dtype == torch.float16
    assert row_error(y, ref_y) < BOUND
    assert row_error(x.grad, ref_dx) < BOUND and row_error(w.grad, ref_dw) < BOUND


@pytest.mark.parametrize("recipe", RECIPES)
def test_merged_weights_are_one_gemm_of_their_concatenation(recipe):
    generator = torch.Generator().manual_seed(3)
    x = operand(128, 256, generator).requires_grad_()
    parts = [operand(n, 256, generator).requires_grad_() for n in (128, 256)]
    whole = torch.cat([p.detach() for p in parts]).requires_grad_()
    dy = operand(128, 384, generator)
    y = fp8_linear(x, parts, None, recipe)
    y.backward(dy)
    x2 = x.detach().clone().requires_grad_()
    y2 = fp8_linear(x2, [whole], None, recipe)
    y2.backward(dy)
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)
    assert torch.equal(torch.cat([p.grad for p in parts]), whole.grad)


def test_frozen_weights_get_only_the_input_gradient():
    generator = torch.Generator().manual_seed(4)
    lin = Fp8Linear(256, 128, dtype=torch.bfloat16, recipe="blockwise")
    lin.weight.requires_grad_(False)
    x = operand(64, 256, generator).requires_grad_()
    dy = operand(64, 128, generator)
    lin(x).backward(dy)
    ref = reference(SPEC["blockwise"], x.detach(), lin.weight, lin.bias.detach(), dy)
    assert lin.weight.grad is None and row_error(x.grad, ref[1]) < BOUND
    assert lin.fp8_weights._copies.keys() == {"forward", "dgrad"}  # frozen: the kept copies


# ---- the module ---------------------------------------------------------------------------------

def test_the_module_keeps_nn_linear_state_and_shares_parameters():
    plain = torch.nn.Linear(256, 128, dtype=torch.bfloat16)
    ours = Fp8Linear.from_linear(plain, "rowwise", activation="silu")
    assert ours.weight is plain.weight and ours.bias is plain.bias
    assert ours.state_dict().keys() == plain.state_dict().keys()
    assert "recipe=rowwise, activation=silu" in repr(ours)
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours(x), F.silu(fp8_linear(x, [plain.weight], plain.bias, "rowwise")))


# ---- the weights' FP8 copies ----------------------------------------------------------------

def counting(monkeypatch):
    calls = []
    original = gemm_steps.quantize

    def spy(t, *args, **kwargs):
        calls.append(tuple(t.shape))
        return original(t, *args, **kwargs)

    monkeypatch.setattr(gemm_steps, "quantize", spy)
    return calls


def test_inference_reuses_the_weight_copy_and_refreshes_it_in_place(monkeypatch):
    lin = Fp8Linear(256, 128, dtype=torch.bfloat16, recipe="rowwise")
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    calls = counting(monkeypatch)
    with torch.no_grad():
        first = lin(x)
        copy_q = lin.fp8_weights._copies["forward"][0]
        assert calls == [(128, 256), (16, 256)]  # the weight, then x
        assert torch.equal(lin(x), first) and calls[2:] == [(16, 256)]  # x only
        lin.weight.mul_(2)  # an in-place write bumps the version: refreshed
        again = lin(x)
    assert lin.fp8_weights._copies["forward"][0] is copy_q  # the same memory, new values
    fresh = fp8_linear(x, [lin.weight.detach()], lin.bias.detach(), "rowwise")
    assert torch.equal(again, fresh) and not torch.equal(again, first)


def test_a_write_the_version_misses_is_caught_by_the_next_optimizer_step():
    lin = Fp8Linear(256, 128, dtype=torch.bfloat16, recipe="tensorwise")
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        first = lin(x)
        lin.weight.data.mul_(2)  # through .data: no version bump (documented)
        assert torch.equal(lin(x), first)
    other = torch.nn.Parameter(torch.zeros(3))
    other.grad = torch.ones(3)
    torch.optim.SGD([other], lr=0.1).step()  # any optimizer step invalidates the copies
    with torch.no_grad():
        fresh = fp8_linear(x, [lin.weight], lin.bias, "tensorwise")
        assert torch.equal(lin(x), fresh) and not torch.equal(fresh, first)


def test_training_calls_quantize_afresh_and_free_the_copies(monkeypatch):
    lin = Fp8Linear(256, 128, dtype=torch.bfloat16, recipe="rowwise")
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        lin(x)
    assert lin.fp8_weights._copies
    calls = counting(monkeypatch)
    lin(x.requires_grad_()).sum().backward()
    assert not lin.fp8_weights._copies
    assert calls.count((128, 256)) == 2  # W for the forward, W^T (from W) for the dgrad


def test_a_tensorwise_backward_reuses_the_forwards_weight_amax(monkeypatch):
    """W^T's tensorwise scale is W's: the forward's amax goes to the backward's quantization of
    W^T (no second pass over W), and the result equals quantizing W^T afresh."""
    seen = []
    original = gemm_steps.quantize

    def spy(t, *args, **kwargs):
        seen.append((tuple(t.shape), kwargs.get("transpose", False), kwargs.get("amax")))
        return original(t, *args, **kwargs)

    monkeypatch.setattr(gemm_steps, "quantize", spy)
    lin = Fp8Linear(256, 128, dtype=torch.bfloat16, recipe="tensorwise")
    x = torch.randn(16, 256, dtype=torch.bfloat16, requires_grad=True)
    lin(x).sum().backward()
    weight_calls = [(t, a) for shape, t, a in seen if shape == (128, 256)]
    assert [t for t, _ in weight_calls] == [False, True]
    forward_amax, backward_amax = (a for _, a in weight_calls)
    assert forward_amax is not None and backward_amax is forward_amax
    assert forward_amax == lin.weight.detach().float().abs().max()
    # (the quantization given an amax equals the one without: test_fp8_quant.py)


def test_a_rowwise_backward_quantizes_the_weight_afresh(monkeypatch):
    """Rowwise W^T's scales are W's columns', not its rows': no amax is handed over."""
    seen = []
    original = gemm_steps.quantize
    monkeypatch.setattr(gemm_steps, "quantize", lambda t, *a, **k: (
        seen.append(k.get("amax")), original(t, *a, **k))[1])
    lin = Fp8Linear(256, 128, dtype=torch.bfloat16, recipe="rowwise")
    lin(torch.randn(16, 256, dtype=torch.bfloat16, requires_grad=True)).sum().backward()
    assert seen and all(a is None for a in seen)


def test_inference_tensors_are_quantized_at_every_call():
    with torch.inference_mode():
        lin = Fp8Linear(256, 128, dtype=torch.bfloat16, recipe="rowwise")
        y = lin(torch.randn(16, 256, dtype=torch.bfloat16))
    assert y.shape == (16, 128) and not lin.fp8_weights._copies


def test_a_copied_module_starts_without_copies():
    lin = Fp8Linear(256, 128, dtype=torch.bfloat16, recipe="rowwise")
    with torch.no_grad():
        lin(torch.randn(16, 256, dtype=torch.bfloat16))
    twin = copy.deepcopy(lin)
    assert not twin.fp8_weights._copies and twin.fp8_weights is not lin.fp8_weights


# ---- an FP8 input a kernel wrote ----------------------------------------------------------------

def given_input(x, recipe):
    """x's forward operand as a norm or SwiGLU kernel writes it: quantize(x) of the recipe's
    granularity, q in x's shape."""
    a = recipes.get(recipe).forward.a
    q, scale = fp8_quant.quantize(x.detach().reshape(-1, x.shape[-1]), a.granularity,
                                  fp8_dtype=a.dtype)
    return q.view(x.shape), scale


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
@pytest.mark.parametrize("tokens", [256, 200])
def test_a_given_fp8_input_replaces_the_forward_quantization_bit_for_bit(recipe, tokens,
                                                                         monkeypatch):
    """x_fp8 equal to quantize(x): the same outputs and gradients; the forward quantizes only
    x^T (for the wgrad), or nothing of x without gradients."""
    x, w, b, dy, y = run_linear(recipe, tokens)
    calls = []
    quantize, pair = gemm_steps.quantize, gemm_steps.quantize_pair
    monkeypatch.setattr(gemm_steps, "quantize", lambda t, *a, **k: calls.append(
        ("quantize", t, k)) or quantize(t, *a, **k))
    monkeypatch.setattr(gemm_steps, "quantize_pair", lambda t, *a, **k: calls.append(
        ("pair", t, k)) or pair(t, *a, **k))
    x2 = x.detach().clone().requires_grad_()
    w2, b2 = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    y2 = fp8_linear(x2, [w2], b2, recipe, x_fp8=given_input(x2, recipe))
    of_x = [(kind, k) for kind, t, k in calls if t.shape != w2.shape]
    assert of_x == [("quantize", {"fp8_dtype": E4M3, "transpose": True})]
    y2.backward(dy)
    for got, want in zip((y2, x2.grad, w2.grad, b2.grad), (y, x.grad, w.grad, b.grad)):
        assert torch.equal(got, want)
    calls.clear()
    with torch.no_grad():
        assert torch.equal(fp8_linear(x2, [w2], b2, recipe, x_fp8=given_input(x2, recipe)), y)
    assert [t.shape for _, t, _ in calls] == [w2.shape]  # the weight alone


def test_a_given_fp8_input_must_be_the_recipes_operand():
    x = torch.randn(32, 256, dtype=torch.bfloat16)
    w = torch.randn(128, 256, dtype=torch.bfloat16)
    q, scale = given_input(x, "rowwise")
    for bad, words in [((q.to(torch.float8_e5m2), scale), "float8_e5m2"),
                       ((q[:16], scale[:16]), "x_fp8 is q"),
                       ((q, given_input(x, "blockwise")[1]), "row scales")]:
        with pytest.raises(UnsupportedInputError, match=words):
            fp8_linear(x, [w], None, "rowwise", x_fp8=bad)
    with pytest.raises(UnsupportedInputError, match="block_1x128 scales"):
        fp8_linear(x, [w], None, "blockwise", x_fp8=(q, scale))
    with pytest.raises(UnsupportedInputError, match="come together"):
        fp8_linear_module.fp8_linear_op(x, [w], None, "rowwise", False, q, None)


# ---- torch.compile ----------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_compiled_fullgraph_matches_eager_forward_and_backward(recipe):
    lin = Fp8Linear(256, 384, dtype=torch.bfloat16, recipe=recipe)
    x = torch.randn(2, 100, 256, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2, 100, 384, dtype=torch.bfloat16)
    y = lin(x)
    y.backward(dy)
    expected = (y.detach(), x.grad, lin.weight.grad, lin.bias.grad)
    x.grad = None
    lin.zero_grad()
    compiled = torch.compile(lin, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    y.backward(dy)
    for got, want in zip((y.detach(), x.grad, lin.weight.grad, lin.bias.grad), expected):
        assert torch.equal(got, want)
    with torch.no_grad():
        assert torch.equal(compiled(x), expected[0])


def test_the_custom_op_passes_opcheck():
    x = torch.randn(32, 256, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(128, 256, dtype=torch.bfloat16, requires_grad=True)
    for keep in (True, False):
        torch.library.opcheck(fp8_linear_module.fp8_linear_op, (x, [w], None, "rowwise", keep),
                              test_utils=("test_schema", "test_faketensor",
                                          "test_autograd_registration"))
        # With an FP8 input too; not test_schema, whose mutation check multiplies the inputs
        # (no CPU kernel for FP8 tensors).
        torch.library.opcheck(fp8_linear_module.fp8_linear_op,
                              (x, [w], None, "rowwise", keep, *given_input(x, "rowwise")),
                              test_utils=("test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_a_compiled_call_with_a_given_fp8_input_matches_eager(recipe):
    x = torch.randn(2, 64, 256, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(128, 256, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2, 64, 128, dtype=torch.bfloat16)

    def call(x, w):
        return fp8_linear(x, [w], None, recipe, x_fp8=given_input(x, recipe))

    results = []
    for f in (call, torch.compile(call, fullgraph=True, backend="aot_eager")):
        x.grad = w.grad = None
        y = f(x, w)
        y.backward(dy)
        results.append((y.detach(), x.grad, w.grad))
    for got, want in zip(*results):
        assert torch.equal(got, want)


# ---- refusals ---------------------------------------------------------------------------------

def test_calls_that_do_not_fit_are_refused():
    w = torch.randn(128, 256, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedInputError, match="x in its weights' dtype"):
        fp8_linear(torch.randn(4, 256), [w], None, "rowwise")
    with pytest.raises(UnsupportedInputError, match="does not match the weights"):
        fp8_linear(torch.randn(4, 128, dtype=torch.bfloat16), [w], None, "rowwise")
    with pytest.raises(UnsupportedInputError, match="one value per output feature"):
        fp8_linear(torch.randn(4, 256, dtype=torch.bfloat16), [w],
                   torch.zeros(3, dtype=torch.bfloat16), "rowwise")
    with pytest.raises(UnsupportedInputError, match="multiples of 128"):
        fp8_linear(torch.randn(4, 256, dtype=torch.bfloat16), [w[:64]], None, "blockwise")
    lin = Fp8Linear(256, 128, dtype=torch.bfloat16, recipe="rowwise").float()
    with pytest.raises(UnsupportedInputError, match="float32 weights"):
        lin(torch.randn(4, 256))
