"""Tests for tuning.shapes: shape strings, shape files, Linear harvesting and model loading."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tuning.shapes import (
    format_shape,
    harvest_linear_shapes,
    load_model,
    parse_shape,
    read_shapes_file,
)

torch = pytest.importorskip("torch")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16x4096x4096", (16, 4096, 4096, 1)),
        ("16X4096X4096", (16, 4096, 4096, 1)),
        ("  1x2x3x4 \n", (1, 2, 3, 4)),
        ("8x8x8X1", (8, 8, 8, 1)),
    ],
)
def test_parse_shape_accepts_three_or_four_sizes(text, expected):
    assert parse_shape(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "16x4096",
        "1x2x3x4x5",
        "0x8x8",
        "8x8x8x0",
        "-1x8x8",
        "8.0x8x8",
        "a x b x c",
        "8 x 8 x 8",
        "+8x8x8",
        "1_0x8x8",
        "８x8x8",
        "8x8x8x",
    ],
)
def test_parse_shape_rejects_bad_input_with_the_text_and_expected_form(text):
    with pytest.raises(ValueError) as error:
        parse_shape(text)
    assert repr(text) in str(error.value)
    assert "MxNxK" in str(error.value)


def test_format_shape_omits_a_batch_of_one():
    assert format_shape(16, 4096, 1024) == "16x4096x1024"
    assert format_shape(16, 4096, 1024, 1) == "16x4096x1024"
    assert format_shape(16, 4096, 1024, 8) == "16x4096x1024x8"


sizes = st.integers(min_value=1, max_value=10**9)


@given(sizes, sizes, sizes, sizes)
def test_format_then_parse_round_trips(m, n, k, batch):
    assert parse_shape(format_shape(m, n, k, batch)) == (m, n, k, batch)


@given(sizes, sizes, sizes, sizes, st.sampled_from(["x", "X"]), st.sampled_from(["", " ", "\t"]))
def test_parse_then_format_is_canonical(m, n, k, batch, separator, padding):
    text = padding + separator.join(map(str, (m, n, k, batch))) + padding
    assert format_shape(*parse_shape(text)) == format_shape(m, n, k, batch)


def test_read_shapes_file_skips_blanks_and_comments(tmp_path):
    shapes_file = tmp_path / "shapes.txt"
    shapes_file.write_text(
        "# decode shapes\n\n16x4096x4096\n   \n32x11008x4096  # MLP up\n  8x8x8x4\n"
    )
    assert read_shapes_file(shapes_file) == [
        (16, 4096, 4096, 1),
        (32, 11008, 4096, 1),
        (8, 8, 8, 4),
    ]
    assert read_shapes_file(str(shapes_file)) == read_shapes_file(shapes_file)


def test_read_shapes_file_names_file_and_line_of_a_bad_shape(tmp_path):
    shapes_file = tmp_path / "shapes.txt"
    shapes_file.write_text("# header\n16x4096x4096\n16x4096 # too short\n")
    with pytest.raises(ValueError, match=r"shapes\.txt, line 3: .*'16x4096'"):
        read_shapes_file(shapes_file)


def small_model():
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 64),
        torch.nn.Linear(64, 128),  # same size as the first layer: its shapes appear once
    )


def test_harvest_forward_shapes_deduplicated_in_layer_order():
    assert harvest_linear_shapes(small_model(), 16) == [(16, 128, 64, 1), (16, 64, 128, 1)]


def test_harvest_backward_adds_input_and_weight_gradients():
    assert harvest_linear_shapes(small_model(), 16, backward=True) == [
        (16, 128, 64, 1),  # layer 1: y = x W^T
        (16, 64, 128, 1),  # layer 1: dX = dY W (also layer 2's forward)
        (128, 64, 16, 1),  # layer 1: dW = dY^T X
        (64, 128, 16, 1),  # layer 2: dW (its forward and dX were already seen)
    ]


def test_harvest_shapes_match_the_matmuls_torch_runs():
    layer = torch.nn.Linear(24, 40)
    x = torch.randn(5, 24, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    forward, grad_input, grad_weight = harvest_linear_shapes(layer, 5, backward=True)
    # (M, N, K) of each product matches the tensors it produces.
    assert (forward[0], forward[1]) == tuple(y.shape)
    assert (grad_input[0], grad_input[1]) == tuple(x.grad.shape)
    assert (grad_weight[0], grad_weight[1]) == tuple(layer.weight.grad.shape)


def test_harvest_rejects_non_positive_tokens():
    with pytest.raises(ValueError, match="tokens"):
        harvest_linear_shapes(small_model(), 0)


def test_harvest_a_model_without_linear_layers_is_empty():
    assert harvest_linear_shapes(torch.nn.ReLU(), 16) == []


MODEL_MODULE = """
import torch


def build():
    return torch.nn.Sequential(torch.nn.Linear(4096, 11008), torch.nn.Linear(11008, 4096))


def not_a_module():
    return 42


NOT_CALLABLE = 3
"""


@pytest.fixture
def model_package(tmp_path, monkeypatch):
    package = tmp_path / "shapes_test_models"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "toy.py").write_text(MODEL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    # The test owns this import; drop it afterwards so other tests start clean.
    yield "shapes_test_models.toy"
    for name in ("shapes_test_models.toy", "shapes_test_models"):
        sys.modules.pop(name, None)


def test_load_model_builds_on_the_meta_device(model_package):
    model = load_model(f"{model_package}:build")
    assert isinstance(model, torch.nn.Module)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert harvest_linear_shapes(model, 16) == [(16, 11008, 4096, 1), (16, 4096, 11008, 1)]


def test_load_model_on_cpu_gets_real_parameters(model_package):
    model = load_model(f"{model_package}:build", device="cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize("spec", ["", "no_colon", ":build", "pkg.mod:", "a:b:c"])
def test_load_model_rejects_malformed_specs(spec):
    with pytest.raises(ValueError, match="package.module:callable"):
        load_model(spec)


@pytest.mark.parametrize(
    ("attribute", "message"),
    [
        ("missing", "has no 'missing'"),
        ("NOT_CALLABLE", "not callable"),
        ("not_a_module", "returned int"),
    ],
)
def test_load_model_explains_bad_targets(model_package, attribute, message):
    with pytest.raises(ValueError, match=message):
        load_model(f"{model_package}:{attribute}")


def test_load_model_explains_an_import_error():
    with pytest.raises(ValueError, match="cannot import 'no_such_package_for_shapes_test.models'"):
        load_model("no_such_package_for_shapes_test.models:build")


def test_model_problems_cover_the_linears_and_the_chunked_head():
    import torch

    from tuning.shapes import model_problems

    class Lm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 128, bias=True)
            self.lm_head = torch.nn.Linear(64, 1000, bias=False)

    problems = model_problems(Lm(), 256, backward=True, loss_chunk_rows=32)
    found = {(p.m, p.n, p.k, p.operands.layout_a.value, p.operands.layout_b.value,
              p.operands.epilogue.is_default) for p in problems}
    assert (256, 128, 64, "row", "col", False) in found  # proj forward, bias fused
    assert (256, 64, 128, "row", "row", True) in found  # proj dX
    assert (128, 64, 256, "col", "row", True) in found  # proj dW
    assert {(32, 1000, 64, "row", "col", True), (32, 64, 1000, "row", "row", True),
            (1000, 64, 32, "col", "row", True)} <= found  # the head on a chunk of 32 rows
    assert len(problems) == len(set(problems))


def test_a_model_s_experts_give_grouped_problems_with_its_top_k():
    """A Hugging Face Qwen3-MoE (tiny, meta device): its experts' gate+up and down GEMMs over
    tokens x num_experts_per_tok routed rows, forward and backward."""
    transformers = pytest.importorskip("transformers")
    from tuning.grouped_search import moe_problems
    from tuning.shapes import model_grouped_problems

    config = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32,
                                         num_experts=8, num_experts_per_tok=2,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=128)
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config)
    problems = model_grouped_problems(model, 512, backward=True)
    expected = moe_problems(8, 64, 64, 1024, backward=True) + \
        moe_problems(8, 64, 32, 1024, backward=True)
    assert problems == list(dict.fromkeys(expected))  # both layers share their problems
    assert model_grouped_problems(torch.nn.Linear(4, 4), 512) == []


def test_an_moe_model_s_problems_are_its_fused_attention_s_and_its_linears():
    """A mixture-of-experts decoder layer fuses its attention half: the merged QKV GEMM and
    o_proj with the residual are harvested, and nothing of a dense MLP it does not have."""
    transformers = pytest.importorskip("transformers")
    from tuning.shapes import model_problems

    config = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=48,
                                         num_experts=8, num_experts_per_tok=2, head_dim=16,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=128)
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config)
    problems = model_problems(model, 256, backward=True)
    found = {(p.m, p.n, p.k, p.operands.epilogue.is_default) for p in problems}
    qkv = 4 * 16 + 2 * 2 * 16  # q, then k and v
    assert (256, qkv, 64, True) in found  # the merged QKV forward
    assert any((m, n, k) == (256, 64, 64) and not plain for m, n, k, plain in found)  # o_proj
    assert not any(n == 2 * 48 and k == 64 for _, n, k, _ in found)  # no merged gate+up


def test_an_moe_model_s_shared_experts_give_their_merged_gate_up():
    transformers = pytest.importorskip("transformers")
    from tuning.shapes import model_problems

    config = transformers.Qwen2MoeConfig(hidden_size=64, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=40, num_experts=4,
                                         num_experts_per_tok=2, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         vocab_size=128)
    with torch.device("meta"):
        model = transformers.Qwen2MoeForCausalLM(config)
    shapes = {(p.m, p.n, p.k) for p in model_problems(model, 256)}
    assert (256, 80, 64) in shapes  # the shared expert's gate+up as one GEMM
    assert (256, 64, 40) in shapes  # its down_proj


def test_experts_without_a_top_k_are_refused_by_name():
    from tuning.shapes import model_grouped_problems

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.empty(4, 16, 8))
            self.down_proj = torch.nn.Parameter(torch.empty(4, 8, 8))
            self.act_fn = torch.nn.SiLU()

    with pytest.raises(ValueError, match="top_k"):
        model_grouped_problems(torch.nn.Sequential(Experts()), 64)
