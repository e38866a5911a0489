"""benchmarks/moe_e2e.py without a GPU: the models' configs (the published shapes, MoE layers
built as convert recognises them), the rows' names, the per-layer report, the arguments, and
the train check bounded by eager's float32 twin (a tiny Qwen3-MoE, CUDA timing stubbed)."""

import copy
import gc
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import e2e, moe_e2e  # noqa: E402
from cutlass_ops import decoder_blocks  # noqa: E402
from model_faults import skip_layer  # noqa: E402


@pytest.mark.parametrize("family, experts, top_k, hidden", [("qwen3-moe", 128, 8, 2048),
                                                             ("mixtral", 8, 2, 4096)])
def test_the_models_have_the_published_shapes_and_moe_layers(family, experts, top_k, hidden):
    config_class, layers, keywords = moe_e2e.MODELS[family]
    config = getattr(transformers, config_class)(num_hidden_layers=1, **keywords)
    assert config.num_experts_per_tok == top_k and config.hidden_size == hidden
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    layer = model.model.layers[0]
    assert decoder_blocks.looks_like_decoder_layer(layer) and decoder_blocks.has_moe_mlp(layer)
    assert layer.mlp.experts.gate_up_proj.shape[0] == experts
    assert layers == {"qwen3-moe": 4, "mixtral": 2}[family]


@pytest.mark.parametrize("case, want", [
    ("train ours vs eager", "train qwen3-moe ours vs eager"),
    ("train ours vs compile", "train qwen3-moe ours vs compile"),
    ("peak memory train ours vs eager", "peak memory train qwen3-moe ours vs eager"),
    ("prefill ours vs eager", "prefill qwen3-moe ours vs eager"),
    ("decode batch 16 ours vs eager", "decode batch 16 qwen3-moe ours vs eager"),
])
def test_rows_carry_the_family_after_their_section(case, want):
    row = moe_e2e.named({"case": case, "ratio": 1.5}, "qwen3-moe")
    assert row == {"case": want, "ratio": 1.5}


def tiny_qwen3_moe():
    config = transformers.Qwen3MoeConfig(hidden_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, num_hidden_layers=2,
                                         vocab_size=101, moe_intermediate_size=32, num_experts=4,
                                         num_experts_per_tok=2, head_dim=16)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_the_layer_report_names_each_decoder_layer_and_experts_module():
    from cutlass_ops.nn import convert

    model = tiny_qwen3_moe()
    report = moe_e2e.layer_report(convert(model, fused_loss=False))
    assert {"model.layers.0", "model.layers.1"} <= set(report)
    assert any(name.endswith("mlp.experts") for name in report)
    assert all(text.startswith("unchanged: ") and "cpu" in text for text in report.values())


def test_quick_arguments():
    args = moe_e2e.parse_args(["--quick", "--models", "mixtral"])
    assert (args.layers, args.tokens, args.new_tokens, args.models) == (1, 1024, 16, ["mixtral"])
    assert moe_e2e.parse_args([]).models == ["qwen3-moe", "mixtral"]


# --- the train check: eager's float32 twin sets each gradient's bound ---------------------------

@pytest.fixture
def cpu_timing(monkeypatch):
    """e2e's peaks and interleaved timing without CUDA, and each first step's model recorded
    (its dtype and a weak reference: the twin must be gone once the check is set)."""
    stepped = []
    real_first_step = e2e.first_step

    def first_step(model, step):
        stepped.append((next(model.parameters()).dtype, weakref.ref(model)))
        return real_first_step(model, step)

    def peak_memory(model, step):
        step()
        model.zero_grad(set_to_none=True)
        return {"peak_gb": 1.0}

    def bench(fns, **_):
        for fn in fns.values():
            fn()
        return {k: SimpleNamespace(median_ms=1.0) for k in fns}
    monkeypatch.setattr(e2e, "first_step", first_step)
    monkeypatch.setattr(e2e, "peak_memory", peak_memory)
    monkeypatch.setattr(e2e, "do_bench_interleaved", bench)
    return stepped


@pytest.mark.parametrize("fault", [None, "skipped layer"])
def test_the_float32_twin_bounds_ours_and_compile_once_and_is_freed(cpu_timing, fault):
    import cutlass_ops

    eager = tiny_qwen3_moe().to(torch.bfloat16)
    ids = torch.randint(0, 101, (2, 32), generator=torch.Generator().manual_seed(1))
    ours = copy.deepcopy(eager)
    cutlass_ops.convert(ours)  # on a CPU it leaves the layers alone
    if fault:
        skip_layer(ours, 1)
    # "compile" stands in for torch.compile(eager): its bound is the twin's too
    variants = {"eager": eager, "ours": ours, "compile": copy.deepcopy(eager)}
    train, twin = moe_e2e.measure_train(variants, ids, 2)
    gc.collect()
    # eager's step, the twin's (float32, once for both variants, right after eager's), theirs
    dtypes = [dtype for dtype, _ in cpu_timing]
    assert dtypes == [torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16]
    assert cpu_timing[1][1]() is None  # the twin and its gradients are freed
    assert set(twin.grad_errors) == {n for n, _ in eager.named_parameters()}
    assert 0 < max(twin.grad_errors.values()) < 1  # bf16's rounding against float32
    for name in ("ours", "compile"):
        check = train[name]["check"]
        assert "float32 twin" in check.gradients.bound
        assert check.gradients.tolerance == max(
            0.05, 2.0 * twin.grad_errors[check.gradients.worst_parameter])
    assert train["compile"]["check"].ok  # an unchanged copy
    assert train["ours"]["check"].ok == (fault is None)
    rows = moe_e2e.train_rows(train, twin, 64)
    row = next(r for r in rows if r["case"] == "train ours vs eager")
    assert row["correct"] == (fault is None)
    detail = row["detail"]
    assert detail["grad_bound"] == train["ours"]["check"].gradients.bound
    assert detail["twin_grad_error_of_worst_parameter"] == round(
        twin.grad_errors[detail["grad_worst_parameter"]], 6)
    assert detail["twin_grad_worst_relative_error"] == round(
        max(twin.grad_errors.values()), 6)
    # the loss check's bound and error
    assert detail["loss_bound"] == 0.01
    assert detail["loss_relative_error"] == round(
        abs(detail["loss_ours"] - detail["loss_eager"]) / abs(detail["loss_eager"]), 6)
    memory = next(r for r in rows if r["case"].startswith("peak memory"))
    assert not any(k.startswith("twin_") for k in memory["detail"])


def test_a_run_keeps_the_other_models_rows_of_the_same_settings(tmp_path, monkeypatch):
    """Two runs (one model each) build one file: the second keeps the first's rows when the
    code, GPU and settings agree, and drops them when a setting differs."""
    import json

    from benchmarks import common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    meta = dict(gpu="G", tokens=4096, new_tokens=128, tune=None,
                layers={"qwen3-moe": 4, "mixtral": 2})
    rows = [{"case": "train qwen3-moe ours vs eager"}, {"case": "train mixtral ours vs eager"}]
    (tmp_path / "moe_e2e.json").write_text(json.dumps(
        {"versions": common.versions(), **meta, "rows": rows}))
    kept = common.labelled_rows("moe_e2e", meta)
    assert [moe_e2e.family_of(r) for r in kept] == ["qwen3-moe", "mixtral"]
    assert all("run" not in r.get("detail", {}) for r in kept)  # this code's own rows
    assert common.labelled_rows("moe_e2e", {**meta, "tune": "quick"}) == []
    monkeypatch.setattr(common, "versions", lambda: {"project": "0.1.0+other"})
    other = common.labelled_rows("moe_e2e", meta)  # other code: kept, labelled with its run
    assert [r["detail"]["run"]["gpu"] for r in other] == ["G", "G"]
    assert other[0]["detail"]["run"]["versions"]["project"] != "0.1.0+other"
    assert moe_e2e.family_of({"case": "peak memory train mixtral ours vs compile"}) == "mixtral"


# --- issue 50: HF's experts pinned, decode against HF's static-cache generate() ---------------

@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
def test_build_pins_the_experts_implementation(monkeypatch, experts):
    """The model is built with ``HF_EXPERTS`` passed through (not transformers' default)."""
    monkeypatch.setattr(moe_e2e, "HF_EXPERTS", experts)
    model = moe_e2e.build("qwen3-moe", 1, device="meta")
    assert model.config._experts_implementation == experts
    assert model.model.layers[0].mlp.experts.config._experts_implementation == experts


def test_the_result_file_records_hf_experts():
    meta = moe_e2e.run_meta(moe_e2e.parse_args([]), "G")
    assert meta["hf_experts_implementation"] == moe_e2e.HF_EXPERTS == "grouped_mm"


def test_experts_in_generate_reports_what_generate_ran_and_removes_its_hook():
    model = tiny_qwen3_moe()
    experts = model.model.layers[0].mlp.experts
    assert moe_e2e.experts_in_generate(model) == ["grouped_mm"]  # a CPU: no decode switch
    assert not experts._forward_pre_hooks
    model.set_experts_implementation("eager")
    assert moe_e2e.experts_in_generate(model) == ["eager"]


NEW_TOKENS = 3
DECODE_MS = {"eager": 30.0, "ours": 5.0, e2e.HF_STATIC: 8.0, moe_e2e.HF_STATIC_NO_COMPILE: 20.0}


@pytest.fixture
def fake_decode(monkeypatch):
    """e2e.measure_decode without CUDA: eager's greedy tokens for every variant (real, on the
    CPU), each variant's time from DECODE_MS; a peer whose keywords are in ``failing`` raises.
    A 16-token prompt: the checks' cost on a CPU is the prompt's."""
    calls, failing = [], set()
    monkeypatch.setattr(e2e, "PROMPT", 16)
    monkeypatch.setattr(moe_e2e, "GRAPHED_DECODE", False)  # no CUDA graphs on the CPU

    def measure_decode(variants, batch, new_tokens, reps, vocab, options=None, **keywords):
        assert keywords == {"calls": {"ours": e2e.graphed_generate}}  # cutlass_ops.generate
        calls.append((batch, dict(options or {})))
        for name, keywords in (options or {}).items():
            if name in failing:
                raise RuntimeError(f"{name} failed")
        prompt = torch.randint(0, vocab, (batch, e2e.PROMPT),
                               generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            tokens = variants["eager"].generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return {name: {"tokens": tokens, "ms": DECODE_MS[name]} for name in variants}
    monkeypatch.setattr(e2e, "measure_decode", measure_decode)
    return calls, failing


@pytest.mark.parametrize("fault", [None, "skipped layer"])
def test_decode_rows_are_against_hf_static_compile_and_eager(fake_decode, fault):
    calls, _ = fake_decode
    eager = tiny_qwen3_moe().eval()
    ours = copy.deepcopy(eager)
    if fault:
        skip_layer(ours, 1)
    args = moe_e2e.parse_args(["--new-tokens", str(NEW_TOKENS)])
    rows = moe_e2e.decode_section(eager, ours, args)
    assert [r["case"] for r in rows] == [
        f"decode batch {b} ours vs {ref}" for b in (1, 16) for ref in (e2e.HF_STATIC, "eager")]
    assert [options for _, options in calls] == [
        {e2e.HF_STATIC: {"cache_implementation": "static"}}] * 2
    for row in rows:
        batch = int(row["case"].split()[2])
        reference = row["case"].split(" vs ")[1]
        assert row["reference_name"] == reference
        assert row["ours"] == round(batch * NEW_TOKENS / DECODE_MS["ours"] * 1e3, 1)
        assert row["reference"] == round(batch * NEW_TOKENS / DECODE_MS[reference] * 1e3, 1)
        assert row["ratio"] == round(row["ours"] / row["reference"], 4)
        detail = row["detail"]
        # the twin's bound and ours' measured errors
        assert {"logits_bound", "worst_step_bound", "median_step_bound",
                "teacher_forced_worst_logits_error",
                "teacher_forced_median_logits_error"} <= set(detail)
        assert detail["hf_experts_in_generate"] == ["grouped_mm"]
        assert row["correct"] == (fault is None)
        if reference == e2e.HF_STATIC:
            assert detail["eager"] == round(batch * NEW_TOKENS / DECODE_MS["eager"] * 1e3, 1)
            assert detail["reference_settings"]["cache_implementation"] == "static"
        assert "hf_static_failures" not in detail


def test_decode_falls_back_to_the_static_cache_without_compile_and_says_why(fake_decode):
    calls, failing = fake_decode
    failing.add(e2e.HF_STATIC)
    models = {"eager": tiny_qwen3_moe().eval()}
    models["ours"] = copy.deepcopy(models["eager"])
    decode, peer, failures = moe_e2e.measure_decode(models, 1, NEW_TOKENS, 3, 101)
    assert peer == moe_e2e.HF_STATIC_NO_COMPILE
    assert failures == {e2e.HF_STATIC: f"RuntimeError: {e2e.HF_STATIC} failed"}
    assert calls[-1][1] == {peer: {"cache_implementation": "static", "disable_compile": True}}
    assert set(decode) == {"eager", "ours", peer}
    failing.add(peer)
    decode, peer, failures = moe_e2e.measure_decode(models, 1, NEW_TOKENS, 3, 101)
    assert peer is None and set(failures) == {e2e.HF_STATIC, moe_e2e.HF_STATIC_NO_COMPILE}
    assert set(decode) == {"eager", "ours"}


def test_no_compile_decodes_against_eager_only(fake_decode):
    eager = tiny_qwen3_moe().eval()
    args = moe_e2e.parse_args(["--new-tokens", str(NEW_TOKENS), "--no-compile"])
    rows = moe_e2e.decode_section(eager, copy.deepcopy(eager), args)
    assert [r["case"] for r in rows] == ["decode batch 1 ours vs eager",
                                         "decode batch 16 ours vs eager"]


def test_prefill_rows_name_their_bound():
    logits = torch.ones(2, 16, 8)
    prefill = {name: {"ms": ms, "logits": logits * (1 + error)} for name, ms, error in
               [("eager", 10.0, 0.0), ("ours", 5.0, 0.01), ("compile", 8.0, 0.0)]}
    rows = moe_e2e.prefill_rows(prefill, 64)
    assert [r["case"] for r in rows] == ["prefill ours vs eager", "prefill ours vs compile"]
    for row in rows:
        assert "0.02" in row["detail"]["logits_bound"]
        assert row["detail"]["logits_error_vs_eager"] == pytest.approx(0.01, abs=1e-4)


def test_a_run_keeps_the_other_sections_of_its_model():
    rows = [{"case": c} for c in ("train qwen3-moe ours vs eager",
                                  "peak memory train qwen3-moe ours vs eager",
                                  "decode batch 1 qwen3-moe ours vs hf static compile",
                                  "decode batch 1 mixtral ours vs eager")]
    kept = moe_e2e.kept_rows(rows, ["qwen3-moe"], ["decode"])
    assert [r["case"] for r in kept] == [rows[0]["case"], rows[1]["case"], rows[3]["case"]]
    assert moe_e2e.kept_rows(rows, ["qwen3-moe", "mixtral"], list(moe_e2e.SECTIONS)) == []


def test_an_fp8_row_names_what_convert_did_or_why_there_is_no_fp8_model():
    row = {"case": "train ours fp8 blockwise vs ours bf16", "detail": {}}
    got = moe_e2e.fp8_detail(row, {}, {"ours fp8 blockwise": "converted 9 of 9; 4 layers FP8"})
    assert got["detail"]["fp8_conversion"] == "converted 9 of 9; 4 layers FP8"
    row = {"case": "prefill ours fp8 blockwise vs ours bf16", "detail": {}}
    got = moe_e2e.fp8_detail(row, {"ours fp8 blockwise": "made no layer FP8"}, {})
    assert got["detail"]["fp8_conversion"] == "made no layer FP8"
    assert moe_e2e.named(got, "mixtral")["case"] == \
        "prefill mixtral ours fp8 blockwise vs ours bf16"
    assert moe_e2e.parse_args(["--no-fp8"]).no_fp8 and not moe_e2e.parse_args([]).no_fp8


# --- torchao's MoE FP8 training peer (benchmarks/torchao_moe.py) --------------------------------

def test_torchao_converts_the_experts_modules_only():
    from benchmarks import torchao_moe

    model = tiny_qwen3_moe()
    found = [name for name, m in model.named_modules() if torchao_moe.is_experts(m, name)]
    assert found == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def test_torchao_peer_missing_says_why(monkeypatch):
    """Without torchao's moe_training the peer is missing with the reason; where torchao's FP8
    grouped GEMM never runs in the probe forward (the experts stayed bf16) it is missing too,
    rather than a bf16 model timed under torchao's name."""
    import importlib

    from benchmarks import torchao_moe

    real = importlib.import_module

    def no_torchao(name, *args):
        if name.startswith("torchao"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args)
    monkeypatch.setattr(importlib, "import_module", no_torchao)
    peer, why, _ = torchao_moe.build(tiny_qwen3_moe(), torch.zeros(1, 8, dtype=torch.long))
    assert peer is None and "not importable" in why

    calls = []
    fake = SimpleNamespace(_quantize_then_scaled_grouped_mm=lambda *a, **k: calls.append(a))
    model = tiny_qwen3_moe()
    ids = torch.randint(0, 101, (1, 8))
    assert torchao_moe._fp8_calls_of_one_step(model, ids, fake) == 0
    assert all(p.grad is None for p in model.parameters())  # the probe's gradients dropped
    original = fake._quantize_then_scaled_grouped_mm

    class CallingIt(torch.nn.Module):  # a model whose experts reach torchao's GEMM twice
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(2))

        def forward(self, **kwargs):
            fake._quantize_then_scaled_grouped_mm(1)
            fake._quantize_then_scaled_grouped_mm(2)
            return SimpleNamespace(loss=self.weight.sum())
    assert torchao_moe._fp8_calls_of_one_step(CallingIt(), ids, fake) == 2
    assert fake._quantize_then_scaled_grouped_mm is original and calls == [(1,), (2,)]


def test_the_torchao_row_is_correct_only_when_both_steps_pass():
    from benchmarks import e2e_fp8, model_checks

    def entry(ms, ok):
        grads = model_checks.GradientCheck("p", 0.1, 0.2, 0 if ok else 1, 10)
        return {"ms": ms, "loss": 5.0, "peak_gb": 2.0,
                "check": model_checks.TrainCheck(5.0, 5.0, grads)}

    ours, peer = e2e_fp8.fp8_name("blockwise"), "torchao moe fp8"
    row = moe_e2e.torchao_row({ours: entry(8.0, True), peer: entry(10.0, True)}, None, {}, 4096)
    assert row["case"] == "train ours fp8 blockwise vs torchao moe fp8" and row["correct"]
    assert row["ratio"] == round(round(4096 / 8.0 * 1e3, 1) / round(4096 / 10.0 * 1e3, 1), 4)
    assert row["detail"]["peer_recipe"] == "rowwise" and row["detail"]["peer_check"]
    assert moe_e2e.named(row, "qwen3-moe")["case"] == \
        "train qwen3-moe ours fp8 blockwise vs torchao moe fp8"
    assert not moe_e2e.torchao_row({ours: entry(8.0, True), peer: entry(10.0, False)}, None,
                                   {}, 4096)["correct"]
    missing = moe_e2e.torchao_row({ours: entry(8.0, True)}, "torchao is not importable", {},
                                  4096)
    assert missing["ratio"] is None and not missing["correct"]
    assert missing["detail"]["missing"] == "torchao is not importable"
    assert missing["ours"] == round(4096 / 8.0 * 1e3, 1) and missing["reference"] is None
    assert moe_e2e.parse_args(["--no-torchao"]).no_torchao


@pytest.mark.parametrize("sizes", [[3, 0, 17], [0, 0, 0, 5], [16, 32, 1], [0, 40]])
def test_padded_grouped_mm_equals_the_unpadded_product_and_its_gradients(sizes):
    """torchao's routed GEMM pads each expert's rows to a multiple of 16 (torch's FP8 grouped
    GEMM asserts on the device otherwise): the same output and gradients as torch's grouped GEMM
    on the unpadded groups, for skewed, empty and already aligned groups."""
    from benchmarks import torchao_moe

    torch.manual_seed(len(sizes))
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    rows = int(offs[-1])
    x = torch.randn(rows, 32, requires_grad=True)
    w = torch.randn(len(sizes), 32, 24, requires_grad=True)
    place, padded_ends, capacity = torchao_moe.padded_groups(offs, rows)
    assert (padded_ends % 16 == 0).all() and int(padded_ends[-1]) <= capacity
    starts = torch.cat([padded_ends.new_zeros(1), padded_ends[:-1]]).long()
    assert place.unique().numel() == rows  # each row its own place, inside its own group
    for e, (lo, hi) in enumerate(zip([0] + offs[:-1].tolist(), offs.tolist())):
        assert place[lo:hi].tolist() == list(range(int(starts[e]), int(starts[e]) + hi - lo))
    want, got = torch._grouped_mm(x, w, offs=offs), torchao_moe.padded_grouped_mm(x, w, offs)
    torch.testing.assert_close(got, want)
    grad = torch.randn_like(want)
    wanted = torch.autograd.grad(want, (x, w), grad)
    for a, b in zip(wanted, torch.autograd.grad(got, (x, w), grad)):
        torch.testing.assert_close(b, a)


def _stand_in_torchao(monkeypatch, quantize_):
    import types

    tensor = types.ModuleType("torchao.prototype.moe_training.tensor")
    tensor.TrainingWeightWrapperBaseTensor = type("Wrapper", (torch.Tensor,), {})
    tensor._quantize_then_scaled_grouped_mm = lambda *a, **k: None
    config = types.ModuleType("torchao.prototype.moe_training.config")
    config.Float8TrainingOpConfig = lambda **options: options
    quantization = types.ModuleType("torchao.quantization")
    quantization.quantize_ = lambda model, options, filter_fn: quantize_(tensor, model, filter_fn)
    for name, module in (("torchao", types.ModuleType("torchao")),
                         ("torchao.quantization", quantization),
                         ("torchao.prototype.moe_training.config", config),
                         ("torchao.prototype.moe_training.tensor", tensor)):
        monkeypatch.setitem(sys.modules, name, module)
    return tensor


def test_torchao_peer_routes_hf_experts_through_padded_groups(monkeypatch):
    """A stand-in torchao that wraps the experts' weights: its probe train step reaches the
    FP8 GEMM through Hugging Face's grouped GEMM, every group it is given a multiple of 16
    rows; a probe step that raises (a prototype's failure) leaves the peer missing with why;
    experts left bf16 likewise."""
    import transformers.integrations.moe as hf_moe

    from benchmarks import torchao_moe

    monkeypatch.setattr(hf_moe, "_grouped_mm", hf_moe._grouped_mm)  # restored after the test
    # The models first: transformers' modeling imports look torchao up, and must not find the
    # stand-in (a module without a spec) in sys.modules.
    models = [tiny_qwen3_moe() for _ in range(3)]
    seen = []

    def wrap_experts(tensor, model, filter_fn):
        wrapper = tensor.TrainingWeightWrapperBaseTensor
        for name, module in model.named_modules():
            if filter_fn(module, name):
                for pname, p in list(module.named_parameters(recurse=False)):
                    setattr(module, pname, torch.nn.Parameter(p.data.as_subclass(wrapper)))
        real = torch._grouped_mm

        def fp8_grouped_mm(a, b, offs=None, **kwargs):
            if isinstance(b, wrapper):
                tensor._quantize_then_scaled_grouped_mm()
                seen.append(torch.diff(offs, prepend=offs.new_zeros(1)))
            return real(a, b, offs=offs, **kwargs)
        monkeypatch.setattr(torch, "_grouped_mm", fp8_grouped_mm)
    _stand_in_torchao(monkeypatch, wrap_experts)
    ids = torch.randint(0, 101, (1, 8))
    peer, why, settings = torchao_moe.build(models[0], ids)
    assert why is None and peer is not None and settings == torchao_moe.SETTINGS
    assert hf_moe._grouped_mm.routes_torchao and seen
    assert all((sizes % 16 == 0).all() for sizes in seen)

    def raising(tensor, model, filter_fn):
        model.forward = lambda **kw: 1 / 0
    _stand_in_torchao(monkeypatch, raising)
    peer, why, _ = torchao_moe.build(models[1], ids)
    assert peer is None and "first train step raised ZeroDivisionError" in why

    _stand_in_torchao(monkeypatch, lambda tensor, model, filter_fn: None)  # the experts stay bf16
    peer, why, _ = torchao_moe.build(models[2], ids)
    assert peer is None and "never called" in why

