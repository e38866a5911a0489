"""cutlass_ops.convert(model, fp8=...) on the CPU (the FP8 layers quantize as on a GPU and multiply
in float32): the report's recipe or reason per layer, the LM head's option, include / exclude,
an unknown recipe refused before anything changes, fp8=None unchanged, the state_dict and
parameters kept, fused decoder blocks running FP8 GEMMs (all or nothing; their decode graphs
keyed on parameter versions; their norms and SwiGLU writing the GEMMs' FP8 inputs, the same bits
as the blocks quantizing them, eagerly, compiled and in generate()), training, generate() making
the weights' copies once, and an FSDP2 step at world size 1 against the same step in one
process."""

import copy

import pytest
import torch
from torch import nn

import cutlass_ops
from cutlass_ops import decoder_blocks, norm_probe
from cutlass_ops.block_gemms import BF16
from cutlass_ops.fp8 import gemm_steps
from cutlass_ops.fp8 import Fp8Linear, FusedGemms, convert_fp8
from custom_kernels import swiglu as swiglu_module
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.core.tolerances import relative_error
from custom_kernels.norms.modules import RMSNorm

transformers = pytest.importorskip("transformers")

RECIPES = ["tensorwise", "rowwise", "blockwise"]
PROJECTIONS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def tiny_llama(head_dim=128, layers=2):
    """bf16, hidden 256, one KV head: k and v are ``head_dim`` wide (128: every recipe takes
    every projection; 64: blockwise refuses k and v)."""
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=layers,
                                      num_attention_heads=256 // head_dim, num_key_value_heads=1,
                                      head_dim=head_dim, vocab_size=256,
                                      max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def layer_names(layers=2):
    return [f"model.layers.{i}.{p}" for i in range(layers) for p in PROJECTIONS]


@pytest.fixture(autouse=True)
def quiet(warnings):
    yield


# ---- the report -------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", RECIPES)
def test_every_projection_runs_the_recipe_and_the_state_dict_is_kept(recipe):
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    report = cutlass_ops.convert(model, fp8=recipe)
    assert report.fp8 == {name: recipe for name in layer_names()}
    for name in layer_names():
        assert type(model.get_submodule(name)) is Fp8Linear
        assert f"FP8 {recipe}" in next(d.reason for d in report.decisions if d.name == name)
    head = next(d for d in report.decisions if d.name == "lm_head")
    assert head.fp8 is None and "the LM head stays bf16" in head.reason
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
    assert all(p is params[n] for n, p in model.named_parameters())  # optimizers keep working


def test_the_lm_head_runs_fp8_when_asked():
    model = tiny_llama()
    report = cutlass_ops.convert(model, fp8="rowwise", fp8_lm_head=True)
    assert report.fp8["lm_head"] == "rowwise" and type(model.lm_head) is Fp8Linear
    reason = next(d.reason for d in report.decisions if d.name == "lm_head")
    assert "with labels the fused head and loss" in reason  # convert routed the loss


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.ok = nn.Linear(256, 256, dtype=torch.bfloat16)
        self.odd = nn.Linear(256, 100, dtype=torch.bfloat16)
        self.narrow = nn.Linear(256, 192, dtype=torch.bfloat16)
        self.wide = nn.Linear(256, 256)  # float32
        self.left = nn.Linear(256, 256, dtype=torch.bfloat16)

    def forward(self, x):
        return self.ok(x)


@pytest.mark.parametrize("recipe, refused", [
    ("rowwise", {"odd": "multiples of 16", "wide": "float32 weights"}),
    ("blockwise", {"odd": "multiples of 128", "narrow": "multiples of 128",
                   "wide": "float32 weights"}),
])
def test_layers_that_cannot_take_the_recipe_say_why(recipe, refused):
    model = Mixed()
    report = cutlass_ops.convert(model, fp8=recipe, exclude=("left",))
    assert set(report.fp8) == {"ok", "narrow", "odd", "wide"} - set(refused)
    for name, words in refused.items():
        assert words in report.skipped[name] and "not FP8" in report.skipped[name], name
        assert type(getattr(model, name)) is nn.Linear
    assert report.skipped["left"] == "excluded by the caller"
    assert type(model.left) is nn.Linear


def test_an_unknown_recipe_changes_nothing():
    model = tiny_llama()
    kinds = [type(m) for m in model.modules()]
    with pytest.raises(UnsupportedInputError, match="unknown FP8 recipe"):
        cutlass_ops.convert(model, fp8="e4m3")
    assert [type(m) for m in model.modules()] == kinds


def test_without_fp8_the_conversion_is_unchanged():
    plain, explicit = tiny_llama(), tiny_llama()
    one = cutlass_ops.convert(plain)
    two = cutlass_ops.convert(explicit, fp8=None, fp8_lm_head=True)
    assert one.decisions == two.decisions and not two.fp8
    assert not any(isinstance(m, Fp8Linear) for m in explicit.modules())


# ---- fused decoder blocks ------------------------------------------------------------------

def fused(model):
    for module in list(model.modules()):
        if decoder_blocks.looks_like_decoder_layer(module):
            assert decoder_blocks.fuse(module, require_gpu=False) is None
    return model


def calls_of(monkeypatch):
    calls = []
    for name in ("merged_linear", "linear_residual"):
        original = getattr(FusedGemms, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(FusedGemms, name, spy)
    return calls


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_fused_blocks_run_their_gemms_fp8_like_the_fp8_linears(recipe, monkeypatch):
    """A fused block's FP8 GEMMs quantize as the FP8 Linears of the unfused layer: rowwise and
    blockwise scales do not depend on how the weights are merged, so the forward agrees to the
    rounding of the block's other kernels; the gradients to FP8's own noise."""
    model = tiny_llama()
    unfused = copy.deepcopy(model)
    choices = convert_fp8(fused(model), recipe)
    convert_fp8(unfused, recipe)
    assert {c.name: c.recipe for c in choices if c.recipe} == dict.fromkeys(
        ["model.layers.0", "model.layers.1", *layer_names()], recipe)
    for layer in model.model.layers:
        assert isinstance(decoder_blocks.gemms_of(layer.self_attn), FusedGemms)
        assert isinstance(decoder_blocks.gemms_of(layer.mlp), FusedGemms)
    calls = calls_of(monkeypatch)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    ours, theirs = model(ids, labels=ids), unfused(ids, labels=ids)
    # per layer: QKV and gate+up merged, o_proj and down_proj with their residual
    assert sorted(calls) == ["linear_residual"] * 4 + ["merged_linear"] * 4
    assert relative_error(ours.logits.float(), theirs.logits.float()) < 1e-2
    ours.loss.backward()
    theirs.loss.backward()
    grads = dict(unfused.named_parameters())
    for name, p in model.named_parameters():
        assert relative_error(p.grad.float(), grads[name].grad.float()) < 0.15, name


def fp8_blocks(recipe, layers=2):
    """tiny_llama with our RMSNorms (as convert makes them on a GPU), fused blocks and FP8
    GEMMs."""
    model = tiny_llama(layers=layers)
    for layer in model.model.layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            setattr(layer, name, norm_probe.drop_in(getattr(layer, name)))
    convert_fp8(fused(model), recipe)
    return model


def quantizing_themselves(model):
    """A copy of ``model`` whose blocks quantize every GEMM input in a pass of its own."""
    twin = copy.deepcopy(model)
    for layer in twin.model.layers:
        for module in (layer.self_attn, layer.mlp):
            decoder_blocks.gemms_of(module).input_fp8 = None
    return twin


def fp8_writers(monkeypatch, tokens):
    """Spies: the calls of RMSNorm.forward_fp8 and swiglu_fp8, and the activations (``tokens``
    rows) fp8_linear quantizes for a forward GEMM (weights and transposes left out)."""
    calls = {"norm": 0, "swiglu": 0, "forward operands": 0}
    norm_fp8, swiglu_fp8 = RMSNorm.forward_fp8, swiglu_module.swiglu_fp8
    quantize, pair = gemm_steps.quantize, gemm_steps.quantize_pair

    def count(key, original):
        def spy(*args, **kwargs):
            calls[key] += 1
            return original(*args, **kwargs)
        return spy

    def forward_operand(original):
        def spy(t, *args, transpose=False, **kwargs):
            if not transpose and t.shape[0] == tokens:
                calls["forward operands"] += 1
            return original(t, *args, **kwargs) if original is pair else \
                original(t, *args, transpose=transpose, **kwargs)
        return spy

    monkeypatch.setattr(RMSNorm, "forward_fp8", count("norm", norm_fp8))
    monkeypatch.setattr(swiglu_module, "swiglu_fp8", count("swiglu", swiglu_fp8))
    monkeypatch.setattr(gemm_steps, "quantize", forward_operand(quantize))
    monkeypatch.setattr(gemm_steps, "quantize_pair", forward_operand(pair))
    return calls


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_blocks_read_the_fp8_outputs_of_their_norms_and_swiglu(recipe, monkeypatch):
    """Rowwise and blockwise blocks: both norms write the QKV and gate+up GEMMs' FP8 input, the
    SwiGLU kernel down_proj's; o_proj alone quantizes its input. The same bits as the blocks
    that quantize every input themselves (q and scale are quantize(y)'s), forward and
    backward. Tensorwise blocks quantize every input (a tensor's amax needs a pass of its
    own)."""
    model = fp8_blocks(recipe)
    twin = quantizing_themselves(model)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    calls = fp8_writers(monkeypatch, tokens=2 * 64)
    with torch.no_grad():
        logits = model(ids).logits
    fused = recipe != "tensorwise"
    assert calls == {"norm": 4 * fused, "swiglu": 2 * fused,
                     "forward operands": 2 if fused else 8}
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, logits)
    if not fused:
        return
    losses = [m(input_ids=ids, labels=ids).loss for m in (model, twin)]
    assert torch.equal(losses[0], losses[1])
    for loss in losses:
        loss.backward()
    grads = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name].grad), name


def test_a_norm_with_hooks_keeps_its_call(monkeypatch):
    model = fp8_blocks("rowwise", layers=1)
    seen = []
    model.model.layers[0].input_layernorm.register_forward_hook(
        lambda module, args, out: seen.append(out.shape))
    calls = fp8_writers(monkeypatch, tokens=16)
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 16)))
    assert seen == [(1, 16, 256)] and calls["norm"] == 1  # the post-attention norm's


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_fp8_blocks_generate_like_blocks_quantizing_themselves(recipe):
    model = fp8_blocks(recipe)
    twin = quantizing_themselves(model)
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        ours, theirs = model.generate(ids, **kwargs), twin.generate(ids, **kwargs)
    assert torch.equal(ours.sequences, theirs.sequences)
    for a, b in zip(ours.logits, theirs.logits):
        assert torch.equal(a, b)


def test_a_block_with_a_projection_the_recipe_refuses_stays_16_bit():
    model = fused(tiny_llama(head_dim=64))  # k_proj and v_proj 256 -> 64
    choices = {c.name: c for c in convert_fp8(model, "blockwise")}
    for i, layer in enumerate(model.model.layers):
        assert choices[f"model.layers.{i}"].recipe is None
        assert choices[f"model.layers.{i}"].reason.startswith(
            "self_attn.k_proj: 256x64: blockwise needs in_features and out_features multiples "
            "of 128")
        assert decoder_blocks.gemms_of(layer.self_attn) is BF16
        assert decoder_blocks.gemms_of(layer.mlp) is BF16
        assert all(type(layer.get_submodule(p)) is nn.Linear for p in PROJECTIONS)
        assert all(choices[f"model.layers.{i}.{p}"].recipe is None for p in PROJECTIONS)
    twin = fused(tiny_llama(head_dim=64))
    assert {c.name for c in convert_fp8(twin, "rowwise") if c.recipe} >= set(layer_names())


def test_a_block_refused_names_the_projection():
    model = fused(tiny_llama())
    model.model.layers[1].mlp.up_proj.weight.data = \
        model.model.layers[1].mlp.up_proj.weight.data.float()
    choices = {c.name: c for c in convert_fp8(model, "rowwise")}
    assert choices["model.layers.1"].recipe is None
    assert choices["model.layers.1"].reason.startswith("mlp.up_proj: float32 weights")
    assert "its decoder block's GEMMs stay 16-bit" in \
        choices["model.layers.1.mlp.gate_proj"].reason


@pytest.mark.parametrize("norms", ["Hugging Face's", "ours (FP8 outputs)"])
def test_a_compiled_fused_fp8_model_matches_eager(norms):
    if norms == "Hugging Face's":
        model = fused(tiny_llama())
        convert_fp8(model, "rowwise")
    else:
        model = fp8_blocks("rowwise")
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    ours, theirs = compiled(input_ids=ids, labels=ids).loss, model(input_ids=ids, labels=ids).loss
    ours.backward()
    theirs.backward()
    assert torch.equal(ours, theirs)
    grads = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(grads[name].grad, p.grad), name
    with torch.no_grad():
        assert torch.equal(compiled(input_ids=ids).logits, model(input_ids=ids).logits)


def test_decode_graphs_of_fp8_blocks_are_keyed_on_parameter_versions():
    model = fused(tiny_llama())
    bf16_layer = model.model.layers[1]
    convert_fp8(model, "rowwise", include=("model.layers.0",) + tuple(
        f"model.layers.0.{p}" for p in PROJECTIONS))
    fp8_layer = model.model.layers[0]
    assert decoder_blocks.gemms_of(bf16_layer.self_attn) is BF16
    keys = [decoder_blocks._weight_pointers(layer) for layer in (fp8_layer, bf16_layer)]
    with torch.no_grad():
        for layer in (fp8_layer, bf16_layer):
            layer.mlp.down_proj.weight.mul_(2)
    assert decoder_blocks._weight_pointers(fp8_layer) != keys[0]
    assert decoder_blocks._weight_pointers(bf16_layer) == keys[1]


# ---- training, generate ----------------------------------------------------------------------

@pytest.mark.parametrize("recipe", RECIPES)
def test_a_converted_model_trains(recipe):
    reference, model = tiny_llama(), tiny_llama()
    cutlass_ops.convert(model, fp8=recipe)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    first = reference(input_ids=ids, labels=ids).loss.item()
    assert abs(losses[0] - first) < 2e-2 * first
    assert losses[-1] < losses[0] - 0.1


def test_generate_makes_each_weight_copy_once(monkeypatch):
    model = tiny_llama()
    cutlass_ops.convert(model, fp8="rowwise")
    weights = {tuple(p.shape) for n, p in model.named_parameters() if "proj" in n}
    calls = []
    original = gemm_steps.quantize

    def spy(t, *args, **kwargs):
        calls.append(t)
        return original(t, *args, **kwargs)

    monkeypatch.setattr(gemm_steps, "quantize", spy)
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             pad_token_id=0)
    assert out.shape == (2, 11)
    weight_calls = [t for t in calls if t.dtype == torch.bfloat16 and
                    any(t.data_ptr() == p.data_ptr() for p in model.parameters())]
    assert len(weight_calls) == 14 and {tuple(t.shape) for t in weight_calls} == weights
    assert len(calls) > 14 * 6  # the activations, at every step


# ---- FSDP2 ----------------------------------------------------------------------------------

def test_fsdp2_at_world_size_1_trains_like_one_process(tmp_path):
    import fp8_steps

    reference = fp8_steps.single("cpu", "rowwise")
    got = fp8_steps.run(1, "cpu", "rowwise", str(tmp_path / "rank0.pt"))
    assert got["fp8"] == reference["fp8"] and len(got["fp8"]) == 14
    torch.testing.assert_close(got["loss"], reference["loss"], rtol=1e-3, atol=1e-3)
    assert got["grads"].keys() == reference["grads"].keys()
    for name, grad in reference["grads"].items():
        assert relative_error(got["grads"][name], grad) < 1e-2, name
    assert list(got["state"]) == list(reference["state"])
    for name, value in reference["state"].items():
        assert torch.equal(got["state"][name], value), name


def test_an_moe_block_runs_its_attention_and_shared_expert_fp8_and_its_experts_16_bit(
        monkeypatch):
    """A fused Qwen2-MoE layer: merged QKV, o_proj and the shared expert's merged gate+up and
    down_proj through FP8 GEMMs, the routed experts left 16-bit (named in the report)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2MoeConfig(hidden_size=256, moe_intermediate_size=128,
                                         shared_expert_intermediate_size=256, num_experts=4,
                                         num_experts_per_tok=2, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         vocab_size=256)
    torch.manual_seed(0)
    model = fused(transformers.AutoModelForCausalLM.from_config(config).bfloat16())
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.shared_expert, decoder_blocks.FusedMLP)
    choices = {c.name: c for c in convert_fp8(model, "rowwise")}
    block = choices["model.layers.0"]
    assert block.recipe == "rowwise" and "experts stay 16-bit" in block.reason
    for child in ("self_attn.q_proj", "self_attn.o_proj", "mlp.shared_expert.gate_proj",
                  "mlp.shared_expert.down_proj"):
        assert choices[f"model.layers.0.{child}"].recipe == "rowwise", child
    assert isinstance(decoder_blocks.gemms_of(layer.mlp.shared_expert), FusedGemms)
    assert decoder_blocks.gemms_of(layer.mlp) is BF16
    calls = calls_of(monkeypatch)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    assert calls.count("merged_linear") == 2  # QKV, the shared expert's gate+up


def test_an_fp8_layer_needs_an_sm90_gpu_and_off_one_asks_none(monkeypatch):
    """The GPU refusal (cutlass_ops.conversion_refusals' words) applies on a CUDA device only:
    off a GPU the FP8 layers compute in float32 and no GPU is asked."""
    from cutlass_ops.fp8 import recipes
    from cutlass_ops.fp8.convert import refusal

    layer, recipe = nn.Linear(256, 256).to(torch.bfloat16), recipes.get("tensorwise")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA L4")
    assert refusal(layer, recipe) is None
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda", 0)))
    assert refusal(layer, recipe) == "NVIDIA L4 is not an sm90 GPU: FP8 layers need one"
