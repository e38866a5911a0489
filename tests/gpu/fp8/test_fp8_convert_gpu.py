"""FP8 layers and convert(model, fp8=...) on an sm90 GPU: each recipe's forward, dgrad and wgrad
against the dequantized reference (tests/fp8_reference.py: on the CPU, the library's
quantization rule, float64 products), which one wrong granularity, orientation or FP8 type
misses, and within FP8's error of the bf16 product; torch.compile(fullgraph=True) of a layer and
of a converted model's train step; CUDA graphs (the weights' FP8 copies read by a captured
graph, refreshed in place; a graph captured before any copy quantizes inside itself); generate()
with and without the decode step graphs, after the weights change in place too; a converted
model's train step against the bf16 one; the blocks' norms and SwiGLU writing their GEMMs' FP8
inputs, bit for bit against blocks quantizing them, in a forward, a train step and generate()
through the decode graphs (blockwise at M % 4 != 0); FSDP2 at world size 1 against one process."""

import copy

import pytest
import torch

import cutlass_ops
from cutlass_ops import decoder_blocks, module_state, step_graphs
from cutlass_ops.fp8.linear import Fp8Linear, fp8_linear
from custom_kernels import swiglu as swiglu_module
from custom_kernels.core.tolerances import relative_error
from custom_kernels.norms.modules import RMSNorm
from fp8_reference import BOUND, RECIPES, SPEC, reference, row_error, run_linear, wrong_specs

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

# FP8 against the bf16 product, each output row: e4m3 operands round by up to 2^-4 (about 3%
# rms on a product of two), e5m2 gradients (tensorwise) by 2^-3.
FP8_FORWARD, FP8_BACKWARD = 0.08, 0.15


# ---- one layer ---------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("tokens", [256, 200, 16])
def test_each_recipe_matches_the_dequantized_reference(recipe, tokens):
    x, w, b, dy, y = run_linear(recipe, tokens, device="cuda")
    ref_y, ref_dx, ref_dw = reference(SPEC[recipe], x.detach(), w.detach(), b.detach(), dy)
    assert row_error(y, ref_y) < BOUND
    assert row_error(x.grad, ref_dx) < BOUND
    assert row_error(w.grad, ref_dw) < BOUND
    torch.testing.assert_close(b.grad.float(), dy.float().sum((0, 1)), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("tokens", [256, 200])
def test_the_reference_check_fails_for_a_wrong_granularity_orientation_or_type(recipe, tokens):
    """The check above is not loose: the reference with one operand's block, orientation or
    the gradients' FP8 type changed misses the bound on an output it reaches."""
    x, w, b, dy, y = run_linear(recipe, tokens, device="cuda")
    outputs = (y, x.grad, w.grad)
    for what, spec, reached in wrong_specs(recipe):
        refs = reference(spec, x.detach(), w.detach(), b.detach(), dy)
        assert max(row_error(outputs[i], refs[i]) for i in reached) > BOUND, what


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_is_within_fp8_error_of_bf16(recipe):
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 1024, device="cuda", generator=generator).bfloat16().requires_grad_()
    w = (torch.randn(768, 1024, device="cuda", generator=generator) / 32).bfloat16() \
        .requires_grad_()
    dy = torch.randn(512, 768, device="cuda", generator=generator).bfloat16()
    y = fp8_linear(x, [w], None, recipe)
    y.backward(dy)
    grads = x.grad, w.grad
    x.grad = w.grad = None
    bf16 = torch.nn.functional.linear(x, w)
    bf16.backward(dy)
    assert row_error(y, bf16) < FP8_FORWARD
    assert row_error(grads[0], x.grad) < FP8_BACKWARD
    assert row_error(grads[1], w.grad) < FP8_BACKWARD


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_compiled_layer_matches_eager(recipe):
    lin = Fp8Linear(1024, 768, device="cuda", dtype=torch.bfloat16, recipe=recipe)
    x = torch.randn(4, 128, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(4, 128, 768, device="cuda", dtype=torch.bfloat16)
    y = lin(x)
    y.backward(dy)
    expected = (y.detach(), x.grad, lin.weight.grad, lin.bias.grad)
    x.grad = None
    lin.zero_grad()
    compiled = torch.compile(lin, fullgraph=True)
    y = compiled(x)
    y.backward(dy)
    for got, want in zip((y.detach(), x.grad, lin.weight.grad, lin.bias.grad), expected):
        assert relative_error(got, want) < 1e-2  # the same kernels; Inductor sums the bias's
    with torch.no_grad():
        assert relative_error(compiled(x), expected[0]) < 1e-2


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_captured_graph_reads_the_weight_copies_refreshed_in_place(recipe):
    lin = Fp8Linear(1024, 768, device="cuda", dtype=torch.bfloat16, recipe=recipe).eval()
    static = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin(static)  # the copies, made eagerly
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = lin(static)
        static.copy_(torch.randn_like(static))
        graph.replay()
        assert torch.equal(out, lin(static))
        lin.weight.mul_(-0.5)
        lin(static)  # an eager call refreshes the copies the graph reads
        graph.replay()
        fresh = fp8_linear(static, [lin.weight], lin.bias, recipe)
    assert lin.fp8_weights.captured and torch.equal(out, fresh)


def test_a_graph_captured_before_any_copy_quantizes_the_weight_itself():
    lin = Fp8Linear(1024, 768, device="cuda", dtype=torch.bfloat16, recipe="rowwise").eval()
    static = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        copy.deepcopy(lin)(static)  # warm-up (lazy initialisations) without lin's own copies
        side = torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            out = lin(static)
        assert not lin.fp8_weights._copies  # memory of the graph's pool is never kept
        lin.weight.mul_(2)
        graph.replay()
        assert torch.equal(out, fp8_linear(static, [lin.weight], lin.bias, "rowwise"))


# ---- converted models ----------------------------------------------------------------------

def tiny_llama(recipe=None, layers=2):
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=layers, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=1024,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    report = cutlass_ops.convert(model, fp8=recipe)
    return model, report


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_converted_model_fuses_its_blocks_and_trains_like_bf16(recipe):
    bf16, _ = tiny_llama()
    model, report = tiny_llama(recipe)
    assert len(report.fp8) == 2 + 14  # both decoder blocks and their projections
    assert all(report.fp8[f"model.layers.{i}"] == recipe for i in range(2))
    ids = torch.randint(0, 1024, (4, 128), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(0))
    losses = []
    for m in (model, bf16):
        m.train()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 2e-2 * losses[1]
    theirs = dict(bf16.named_parameters())
    for name, p in model.named_parameters():  # emulated on a CPU: worst 0.15 (q/k projections)
        assert relative_error(p.grad, theirs[name].grad) < 0.25, name


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_a_compiled_converted_model_trains_like_eager(recipe):
    model, _ = tiny_llama(recipe)
    model.train()
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, fullgraph=True)
    ids = torch.randint(0, 1024, (2, 128), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    eager_loss = model(input_ids=ids, labels=ids).loss
    compiled_loss = compiled(input_ids=ids, labels=ids).loss
    eager_loss.backward()
    compiled_loss.backward()
    assert abs(eager_loss.item() - compiled_loss.item()) < 1e-2 * eager_loss.item()
    theirs = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        assert relative_error(theirs[name].grad, p.grad) < 0.1, name


def generate(model, prompt, steps=8):
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=steps, min_new_tokens=steps,
                              do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0)


def graph_count(model) -> int:
    holders = [module_state.get(layer, step_graphs.Holder) for layer in model.model.layers]
    return sum(len(h.graphs) for h in holders if h is not None)


@pytest.mark.parametrize("recipe", RECIPES)
def test_generate_with_decode_graphs_matches_without_and_bf16(recipe, monkeypatch):
    bf16, _ = tiny_llama()
    model, _ = tiny_llama(recipe)
    prompt = torch.randint(0, 1024, (2, 12), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(2))
    graphed = generate(model, prompt)
    assert graph_count(model) > 0
    monkeypatch.setenv("CUTLASS_OPS_STEP_GRAPHS", "0")
    eager = generate(model, prompt)
    reference = generate(bf16, prompt)
    assert torch.equal(graphed.sequences, eager.sequences)
    for a, b in zip(graphed.logits, eager.logits):
        assert relative_error(a, b) < 1e-2
    assert relative_error(eager.logits[0], reference.logits[0]) < 0.1  # FP8 against bf16


def test_generate_after_the_weights_change_in_place_matches_a_fresh_conversion():
    model, _ = tiny_llama("rowwise")
    prompt = torch.randint(0, 1024, (1, 12), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(3))
    generate(model, prompt)
    state = {k: v + 0.02 * torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(state)  # copy_ into the same memory: versions move, addresses stay
    after = generate(model, prompt)
    fresh, _ = tiny_llama("rowwise")
    fresh.load_state_dict(state)
    expected = generate(fresh, prompt)
    assert torch.equal(after.sequences, expected.sequences)
    for a, b in zip(after.logits, expected.logits):
        assert relative_error(a, b) < 1e-2


# ---- the norms' and SwiGLU's FP8 outputs ----------------------------------------------------

def quantizing_themselves(model):
    """A copy of ``model`` whose blocks quantize every GEMM input in a pass of its own."""
    twin = copy.deepcopy(model)
    for layer in twin.model.layers:
        for module in (layer.self_attn, layer.mlp):
            decoder_blocks.gemms_of(module).input_fp8 = None
    return twin


def fp8_writers(monkeypatch):
    """Counts of RMSNorm.forward_fp8 and swiglu_fp8 calls (Python calls: not graph replays)."""
    calls = {"norm": 0, "swiglu": 0}

    def count(key, original):
        def spy(*args, **kwargs):
            calls[key] += 1
            return original(*args, **kwargs)
        return spy

    monkeypatch.setattr(RMSNorm, "forward_fp8", count("norm", RMSNorm.forward_fp8))
    monkeypatch.setattr(swiglu_module, "swiglu_fp8", count("swiglu", swiglu_module.swiglu_fp8))
    return calls


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_fp8_blocks_read_their_norms_and_swiglus_fp8_outputs_bit_for_bit(recipe, monkeypatch):
    """Both norms write the QKV and gate+up GEMMs' FP8 input, the SwiGLU kernel down_proj's:
    the same logits and loss as blocks quantizing every input themselves (q and scale are
    quantize(y)'s bit for bit, y the plain kernels'); gradients the same but for the attention
    backward's own summation order."""
    model, _ = tiny_llama(recipe)
    twin = quantizing_themselves(model)
    ids = torch.randint(0, 1024, (2, 128), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(4))
    calls = fp8_writers(monkeypatch)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        assert calls == {"norm": 4, "swiglu": 2}
        assert torch.equal(twin(input_ids=ids).logits, logits)
    assert calls == {"norm": 4, "swiglu": 2}
    losses = []
    for m in (model, twin):
        m.train()
        losses.append(m(input_ids=ids, labels=ids).loss)
        losses[-1].backward()
    assert torch.equal(losses[0], losses[1])
    theirs = dict(twin.named_parameters())
    for name, p in model.named_parameters():
        assert relative_error(p.grad, theirs[name].grad) < 1e-2, name


@pytest.mark.parametrize("recipe, prompt", [("rowwise", (2, 12)), ("blockwise", (2, 12)),
                                            ("blockwise", (1, 13))])
def test_fp8_blocks_generate_with_decode_graphs_like_blocks_quantizing_themselves(
        recipe, prompt, monkeypatch):
    """generate() through the decode step graphs, the FP8 outputs inside them; blockwise at
    token counts scaled_mm pads (prefill M 13, decode M 1 and 2: M % 4 != 0)."""
    model, _ = tiny_llama(recipe)
    twin = quantizing_themselves(model)
    ids = torch.randint(0, 1024, prompt, device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(5))
    calls = fp8_writers(monkeypatch)
    ours = generate(model, ids)
    assert graph_count(model) > 0 and calls["norm"] > 0 and calls["swiglu"] > 0
    theirs = generate(twin, ids)
    assert torch.equal(ours.sequences, theirs.sequences)
    for a, b in zip(ours.logits, theirs.logits):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.distributed.is_nccl_available(), reason="no NCCL")
@pytest.mark.parametrize("recipe", RECIPES)
def test_fsdp2_at_world_size_1_trains_like_one_process(tmp_path, recipe):
    import fp8_steps

    reference = fp8_steps.single("cuda", recipe)
    got = fp8_steps.run(1, "cuda", recipe, str(tmp_path / "rank0.pt"))
    assert got["fp8"] == reference["fp8"] and len(got["fp8"]) == 16  # blocks and projections
    assert abs(float(got["loss"]) - float(reference["loss"])) < 1e-2 * float(reference["loss"])
    assert got["grads"].keys() == reference["grads"].keys()
    for name, grad in reference["grads"].items():
        assert relative_error(got["grads"][name], grad) < 3e-2, name
    for name, value in reference["state"].items():
        assert torch.equal(got["state"][name].cpu(), value), name
