"""benchmarks/model_checks.py on a CPU, with a tiny random-weight Hugging Face Llama: the e2e
benchmark's checks pass an unchanged copy and fail a copy with a decoder layer skipped or an MLP
zeroed, which the old loss-only check (within 1% of eager's) passed; parameters are matched by
name through wrappers, and a parameter without a match is an error, never skipped."""

import copy
import math
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import model_checks  # noqa: E402
from model_faults import skip_layer, zero_mlp  # noqa: E402

VOCAB, PROMPT, FED = 256, 8, 8
DTYPES = [torch.float32, torch.bfloat16]


def tiny_llama(dtype=torch.float32, layers=3):
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype)


def tokens(batch=2, length=32):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


def train_step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = model_checks.gradients(model)
    model.zero_grad(set_to_none=True)
    return loss.float().item(), grads


def check(model, eager, ids):
    """The benchmark's train check of ``model`` against ``eager``, and both steps' gradients."""
    reference, got = train_step(eager, ids), train_step(model, ids)
    result = model_checks.check_train_step(*got, *reference,
                                           model_checks.gradient_tolerance(eager))
    return result, got[1], reference[1]


BROKEN = {"skipped layer": lambda m: skip_layer(m, 1), "zeroed MLP": lambda m: zero_mlp(m, 1)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_unchanged_copy_passes_the_train_check(dtype):
    eager = tiny_llama(dtype)
    result = check(copy.deepcopy(eager), eager, tokens())[0]
    assert result.ok and result.loss_ok
    assert result.gradients.worst_error == 0.0 and result.gradients.failing == 0
    assert result.gradients.parameters == len(list(eager.parameters()))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("broken", list(BROKEN))
def test_the_old_loss_check_passes_a_broken_model_and_the_gradients_fail_it(broken, dtype):
    eager = tiny_llama(dtype)
    model = BROKEN[broken](copy.deepcopy(eager))
    ids = tokens()
    result, got, expected = check(model, eager, ids)
    # The blind spot: the loss alone stays within 1% (the old train rows' whole check) ...
    assert model_checks.loss_within(result.loss, result.reference_loss)
    assert result.loss != result.reference_loss  # ... though the model did change
    # ... and the gradients catch it: the layer's own parameters get none (skipped) or zeros
    # (the zeroed MLP's gate and up projections), an error of 1, and the other layers' move.
    assert not result.ok and not result.gradients.ok
    assert result.gradients.worst_error >= 1.0
    own = [n for n in expected if n.startswith("model.layers.1.mlp.gate_proj")]
    assert own and all(model_checks.gradient_error(got[n], expected[n]) == 1.0 for n in own)
    detail = result.detail()
    assert detail["grad_worst_parameter"] == result.gradients.worst_parameter
    assert detail["grad_failing_parameters"] >= 3


def test_a_small_gradient_change_in_one_parameter_is_named():
    eager = tiny_llama()
    ids = tokens()
    loss, grads = train_step(eager, ids)
    bent = dict(grads)
    name = "model.layers.2.self_attn.o_proj.weight"
    bent[name] = grads[name] * 1.2  # 20% off, in one parameter of 30
    result = model_checks.compare_gradients(bent, grads, 0.05)
    assert not result.ok and result.failing == 1
    assert result.worst_parameter == name and result.worst_error == pytest.approx(0.2)


def test_nan_and_missing_gradients_fail_and_agreeing_absent_ones_pass():
    ref = {"a": torch.ones(3), "b": None, "c": torch.zeros(2)}
    assert model_checks.compare_gradients(dict(ref), ref, 1e-3).ok
    nan = model_checks.compare_gradients({**ref, "a": torch.full((3,), math.nan)}, ref, 1e-3)
    assert not nan.ok and nan.worst_parameter == "a"
    extra = model_checks.compare_gradients({**ref, "b": torch.ones(1)}, ref, 1e-3)
    assert not extra.ok and extra.worst_error == math.inf
    assert not model_checks.compare_gradients({**ref, "c": torch.ones(2)}, ref, 1e-3).ok
    missing = model_checks.compare_gradients({**ref, "a": None}, ref, 1e-3)
    assert not missing.ok and missing.worst_error == 1.0


# --- the float32 twin's bound (a MoE router's gate gradient is too fragile for a fixed one) --

def test_twin_bounds_follow_the_twin_with_the_dtype_floor():
    from custom_kernels.core.tolerances import (MODEL_GRADIENTS, MODEL_LOGITS,
                                                TWIN_MODEL_MARGINS, twin_model_tolerance)

    assert TWIN_MODEL_MARGINS == {MODEL_LOGITS: 2.0, MODEL_GRADIENTS: 2.0}
    assert twin_model_tolerance(1e-4) == 0.05  # a close twin: the bf16 model bound
    assert twin_model_tolerance(0.06) == pytest.approx(0.12)  # a far one: twice its error
    assert twin_model_tolerance(1e-4, "float16", MODEL_LOGITS) == 0.01
    assert twin_model_tolerance(0.3, torch.float32, MODEL_LOGITS) == pytest.approx(0.6)
    assert math.isnan(twin_model_tolerance(math.nan))
    with pytest.raises(ValueError, match="no twin margin"):
        twin_model_tolerance(0.1, family="gemm")
    bounds = model_checks.twin_gradient_tolerances({"a": 0.001, "b": 0.4})
    assert bounds["a"] == 0.05 and bounds["b"] == pytest.approx(0.8)
    assert bounds.rule == ("per parameter max(0.05, 2.0 x the float32 twin's error against "
                           "eager); a lost gradient always fails")
    fp16 = model_checks.twin_gradient_tolerances({"a": 0.001}, torch.float16)
    assert fp16["a"] == 0.01 and fp16.rule.startswith("per parameter max(0.01, ")
    nan = model_checks.twin_gradient_tolerances({"a": math.nan})
    assert not model_checks.compare_gradients({"a": torch.ones(2)}, {"a": torch.ones(2)},
                                              nan).ok  # a NaN twin passes nothing
    check = model_checks.compare_gradients({"a": torch.ones(2)}, {"a": torch.ones(2)}, bounds)
    assert check.detail()["grad_bound"] == bounds.rule


def test_a_twin_bound_passes_what_eager_itself_misses_and_fails_a_lost_gradient():
    expected = {"w": torch.ones(4), "e": torch.zeros(2)}  # e: an expert eager routed no token to
    bounds = model_checks.twin_gradient_tolerances({"w": 0.06, "e": math.inf})
    got = {"w": torch.ones(4) * 1.1, "e": torch.ones(2)}  # 0.1 off; e reached, as in the twin
    check = model_checks.compare_gradients(got, expected, bounds)
    assert check.ok and check.worst_parameter == "w"  # the infinite bound is never "worst"
    assert check.tolerance == pytest.approx(0.12)
    assert not model_checks.compare_gradients({**got, "w": torch.ones(4) * 1.2}, expected,
                                              bounds).ok
    assert not model_checks.compare_gradients({**got, "w": None}, expected, bounds).ok
    nan = model_checks.compare_gradients({**got, "e": torch.full((2,), math.nan)}, expected,
                                         bounds)
    assert not nan.ok and nan.worst_parameter == "e"


def test_the_float32_twin_bound_passes_a_copy_and_fails_a_skipped_layer():
    eager, ids = tiny_llama(torch.bfloat16), tokens()
    reference = train_step(eager, ids)
    twin = train_step(copy.deepcopy(eager).float(), ids)[1]
    errors = {n: model_checks.gradient_error(twin[n], g) for n, g in reference[1].items()}
    assert 0 < max(errors.values()) < 0.05  # bf16's own rounding, against float32
    bounds = model_checks.twin_gradient_tolerances(errors)
    assert model_checks.check_train_step(*train_step(copy.deepcopy(eager), ids), *reference,
                                         bounds).ok
    skipped = skip_layer(copy.deepcopy(eager), 1)
    check = model_checks.check_train_step(*train_step(skipped, ids), *reference, bounds)
    assert check.loss_ok and not check.ok and check.gradients.worst_error >= 1.0


def test_parameters_without_a_match_raise_and_are_never_skipped():
    eager = tiny_llama()
    _, grads = train_step(eager, tokens())
    fewer = {k: v for k, v in grads.items() if not k.startswith("model.layers.2.")}
    with pytest.raises(model_checks.ParameterMismatch, match="only in the reference"):
        model_checks.compare_gradients(fewer, grads, 0.05)
    more = {**grads, "model.layers.3.mlp.up_proj.weight": torch.ones(1)}
    with pytest.raises(model_checks.ParameterMismatch, match="only in the model checked"):
        model_checks.compare_gradients(more, grads, 0.05)
    with pytest.raises(model_checks.ParameterMismatch, match="shape"):
        model_checks.compare_gradients({"w": torch.ones(2)}, {"w": torch.ones(3)}, 0.05)


def test_wrapper_prefixes_map_to_the_wrapped_models_names():
    eager = tiny_llama(layers=1)
    compiled = torch.compile(eager)  # OptimizedModule: "_orig_mod." before every name
    assert next(n for n, _ in compiled.named_parameters()).startswith("_orig_mod.")
    assert model_checks.canonical_parameters(compiled).keys() == \
        dict(eager.named_parameters()).keys()
    assert model_checks.canonical_name("module._orig_mod.lm_head.weight") == "lm_head.weight"


def test_convert_keeps_every_parameter_name():
    """What the name mapping relies on: convert() renames nothing (on a CPU it leaves the
    Linears alone; the GPU test of e2e checks the fused model's names through the same
    ``matched_names``)."""
    import cutlass_ops

    eager = tiny_llama(torch.bfloat16, layers=2)
    ours = copy.deepcopy(eager)
    cutlass_ops.convert(ours)
    expected = model_checks.canonical_parameters(eager)
    assert model_checks.matched_names(model_checks.canonical_parameters(ours), expected) == \
        list(expected)


# --- decoding ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_teacher_forced_decode_passes_an_identical_copy(dtype):
    eager = tiny_llama(dtype).eval()
    result = model_checks.teacher_forced_decode(copy.deepcopy(eager), eager,
                                                tokens(length=PROMPT + FED), PROMPT)
    assert result.ok and len(result.step_errors) == FED
    assert max(result.step_errors) == 0.0 and result.top1_agreement == 1.0
    assert result.detail()["teacher_forced_steps"] == FED


def test_teacher_forced_steps_match_a_full_forward_of_the_same_tokens():
    """The stepping goes through the KV cache: step i's logits are those of position
    prompt - 1 + i of one forward over every token."""
    eager = tiny_llama().eval()
    ids = tokens(length=PROMPT + FED)
    with torch.no_grad():
        full = eager(input_ids=ids).logits[:, PROMPT - 1:-1].float()
    stepper = model_checks._Stepper(eager)
    with torch.no_grad():
        steps = [stepper(ids[:, :PROMPT])] + [stepper(ids[:, t:t + 1])
                                              for t in range(PROMPT, PROMPT + FED - 1)]
    torch.testing.assert_close(torch.stack(steps, 1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("graphed", [False, True], ids=["dynamic cache", "graphed decode"])
def test_teacher_forced_decode_through_the_graphed_decoder_passes_an_identical_copy(graphed):
    """The graphed decoder's static cache and step (eager on a CPU) give the same logits."""
    eager = tiny_llama(torch.float32).eval()
    result = model_checks.teacher_forced_decode(copy.deepcopy(eager), eager,
                                                tokens(length=PROMPT + FED), PROMPT,
                                                graphed=graphed)
    assert result.ok and len(result.step_errors) == FED and result.top1_agreement == 1.0
    assert max(result.step_errors) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("graphed", [False, True], ids=["dynamic cache", "graphed decode"])
def test_teacher_forced_decode_fails_a_copy_whose_last_layer_is_skipped(dtype, graphed):
    eager = tiny_llama(dtype).eval()
    model = skip_layer(copy.deepcopy(eager), len(eager.model.layers) - 1)
    result = model_checks.teacher_forced_decode(model, eager, tokens(length=PROMPT + FED),
                                                PROMPT, graphed=graphed)
    assert not result.ok
    assert min(result.step_errors) > 5 * result.tolerance  # every step, not one unlucky one
    assert result.detail()["teacher_forced_worst_logits_error"] == \
        pytest.approx(result.worst_error, abs=1e-6)


def test_generated_agreement_counts_generated_tokens_only():
    prompt = torch.arange(8).repeat(2, 1)
    a = torch.cat([prompt, torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])], 1)
    b = torch.cat([prompt, torch.tensor([[1, 2, 0, 0], [5, 0, 0, 0]])], 1)
    assert model_checks.generated_agreement(a, b, 8) == pytest.approx(3 / 8)
    # The old figure counted the prompt: (16 + 3) / 24.
    assert (a == b).float().mean().item() == pytest.approx(19 / 24)
    with pytest.raises(ValueError, match="no generated tokens"):
        model_checks.generated_agreement(a[:, :8], b[:, :8], 8)


def test_twin_decode_check_allows_the_twins_near_ties_not_a_systematic_error():
    """An MoE router's near-tie throws one step far for any two implementations: ours may be
    as far as twice the float32 twin at its worst and at its median step, no farther."""
    from benchmarks.model_checks import DecodeCheck, twin_decode_check

    twin = DecodeCheck((0.01, 0.012, 0.30, 0.011), 0.95, 0.05)  # one flip of 0.30
    flip = DecodeCheck((0.012, 0.45, 0.013, 0.011), 0.94, 0.05)  # its own flip, elsewhere
    judged = twin_decode_check(flip, twin)
    assert judged["correct"] and judged["worst_step_bound"] == pytest.approx(0.60)
    assert judged["median_step_bound"] == pytest.approx(0.05)  # the bf16 logits bound
    systematic = DecodeCheck((0.08, 0.09, 0.07, 0.085), 0.9, 0.05)  # every step off
    assert not twin_decode_check(systematic, twin)["correct"]
    wild = DecodeCheck((0.01, 0.7, 0.01, 0.01), 0.9, 0.05)  # farther than any twin flip
    assert not twin_decode_check(wild, twin)["correct"]
    assert not twin_decode_check(DecodeCheck((float("nan"),) * 4, 0.0, 0.05), twin)["correct"]


def test_norm_ratio_and_the_emulation_bound_s_edges():
    """The FP8 check's norm ratio: 0 for a lost gradient, inf for one the reference lacks, NaN
    for NaN (each outside any window), 1 where neither has one."""
    ones = torch.ones(4)
    assert model_checks.norm_ratio(ones * 0.5, ones) == pytest.approx(0.5)
    assert model_checks.norm_ratio(None, ones) == 0.0
    assert model_checks.norm_ratio(ones, torch.zeros(4)) == math.inf
    assert model_checks.norm_ratio(None, None) == model_checks.norm_ratio(torch.zeros(4),
                                                                         None) == 1.0
    assert math.isnan(model_checks.norm_ratio(ones * math.nan, ones))
    bound = model_checks.fp8_gradient_bound({"w": ones, "b": None}, {"w": ones, "b": None})
    assert bound.check({"w": ones, "b": None}).ok
    for bad in (ones * math.nan, ones * 0.7, ones * 1.3, None):
        assert not bound.check({"w": bad, "b": None}).ok
    assert not bound.check({"w": ones, "b": ones}).ok  # a gradient the emulation has not
