"""benchmarks/e2e.py's FP8 rows (benchmarks/e2e_fp8.py) on a CPU: one row per recipe against
torchao's recipe of the same name (blockwise's against ours bf16), no best-of; variants that are
missing (convert refusing fp8=, a step that raises, torchao not installed) reported as rows
rather than crashes; the peers' processes, the merging of their results, and torchao's fused
loss step; and the FP8 gradient check, which compares each gradient with the recipe's float32
emulation's directly: a tiny random Llama converted FP8 (convert's CPU path) passes it, a
gradient at half (or twice) its value fails it however noisy the parameter, and so does a
skipped layer (no gradient, zeros, another parameter's), one layer's scale applied twice, and
the FP8 model fails the bf16 bound that the check replaces."""

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from benchmarks import e2e, e2e_fp8, fp8_emulation, model_checks  # noqa: E402
from model_faults import skip_layer  # noqa: E402

VOCAB = 512


def tiny_llama(layers=2):
    """Sizes every recipe takes (multiples of 128 for blockwise): hidden 256, 2 heads of 128,
    one KV head."""
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def tokens():
    return torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(1))


# --- the check -----------------------------------------------------------------------------------

def step(model, ids):
    return e2e.first_step(model, e2e.train_step(model, ids))


@pytest.fixture(scope="module")
def rowwise():
    """eager, its step, and the rowwise emulation's per-parameter bounds."""
    eager, ids = tiny_llama(), tokens()
    reference = step(eager, ids)
    bounds = e2e_fp8.Emulations(eager, ids).tolerances("rowwise")(*reference)
    return eager, ids, reference, bounds


def test_convert_fp8_passes_the_emulation_bound_and_fails_the_bf16_one(rowwise):
    import cutlass_ops

    eager, ids, reference, bounds = rowwise
    model = copy.deepcopy(eager)
    assert cutlass_ops.convert(model, fp8="rowwise").fp8  # some layers are FP8
    loss, grads = step(model, ids)
    check = model_checks.check_train_step(loss, grads, *reference, bounds)
    assert check.ok, check.detail()
    assert "emulation" in check.detail()["grad_bound"]
    assert check.gradients.tolerance > 0.05  # wider than bf16's where the emulation is
    # The bound it replaces: bf16's fails a correct FP8 model (FP8 moves every gradient more).
    bf16 = model_checks.check_train_step(loss, grads, *reference,
                                         model_checks.gradient_tolerance(eager))
    assert not bf16.ok and bf16.loss_ok
    # One layer's gradients at half their value, the rest honest: that layer fails.
    halved = {n: g * 0.5 if n.startswith("model.layers.1.") else g for n, g in grads.items()}
    check = model_checks.check_train_step(loss, halved, *reference, bounds)
    assert not check.ok and check.gradients.failing == sum(
        n.startswith("model.layers.1.") for n in grads)


@pytest.mark.parametrize("fault", ["wrong scale", "skipped layer"])
def test_the_fp8_check_fails_a_planted_fault(rowwise, fault):
    eager, ids, reference, bounds = rowwise
    model = fp8_emulation.emulate_fp8(
        copy.deepcopy(eager), "rowwise",
        wrong_scale="model.layers.1.mlp.down_proj" if fault == "wrong scale" else None)
    if fault == "skipped layer":
        skip_layer(model, 1)
    loss, grads = step(model, ids)
    check = model_checks.check_train_step(loss, grads, *reference, bounds)
    assert check.loss_ok  # the loss alone would pass it
    assert not check.ok and check.gradients.failing >= 1


def test_a_lost_gradient_fails_however_wide_the_bound():
    expected = {"w": torch.ones(4), "v": torch.ones(2)}
    wide = model_checks.Tolerances({"w": 5.0, "v": 5.0})
    assert model_checks.compare_gradients(dict(expected), expected, wide).ok
    assert not model_checks.compare_gradients({**expected, "w": None}, expected, wide).ok
    assert not model_checks.compare_gradients({**expected, "w": torch.zeros(4)}, expected,
                                              wide).ok
    with pytest.raises(model_checks.ParameterMismatch, match="no tolerance"):
        model_checks.compare_gradients(expected, expected, model_checks.Tolerances({"w": 1.0}))


def test_fp8_bounds_follow_the_emulation_with_the_bf16_floor():
    from custom_kernels.core.tolerances import FP8_MODEL_MARGINS, MODEL_LOGITS

    bounds = model_checks.fp8_gradient_tolerances({"a": 0.001, "b": 0.4})
    assert bounds["a"] == 0.05 and bounds["b"] == pytest.approx(0.4 * 1.5)
    assert FP8_MODEL_MARGINS[MODEL_LOGITS] == 1.5
    nan = model_checks.fp8_gradient_tolerances({"a": float("nan")})
    assert not model_checks.compare_gradients({"a": torch.ones(2)}, {"a": torch.ones(2)},
                                              nan).ok  # a NaN emulation passes nothing


# --- the gradient check against the emulation, on fake gradients ---------------------------------

def noisy(g, level, seed):
    """``g`` plus noise of ``level`` x its norm, independent of it (seeded)."""
    noise = torch.randn(g.shape, generator=torch.Generator().manual_seed(seed))
    return g + noise * (level * g.norm() / noise.norm())


@pytest.fixture
def fake():
    """Eager's gradients of three parameters, the emulation's (eager's plus FP8-like noise: 2%
    on "quiet", 40% on "noisy" and "other", as a deep model's norm weights get) and the
    emulation's bound; the parameters' sizes those of norm weights and a small projection."""
    torch.manual_seed(0)
    eager = {"quiet": torch.randn(64, 64), "noisy": torch.randn(4096), "other": torch.randn(4096)}
    levels = {"quiet": 0.02, "noisy": 0.4, "other": 0.4}
    emulated = {n: noisy(g, levels[n], seed=1) for n, g in eager.items()}
    return eager, emulated, model_checks.fp8_gradient_bound(emulated, eager)


def check(fake, **changes):
    """The emulation check of the emulation's gradients with ``changes`` made (name: tensor)."""
    eager, emulated, bound = fake
    return model_checks.check_train_step(5.0, {**emulated, **changes}, 5.0, eager, bound)


def test_an_honest_fp8_gradient_passes_with_its_own_noise(fake):
    """Another implementation of the recipe carries its own noise, as large as the emulation's
    and independent of it: about sqrt(2) x as far from the emulation as the emulation is from
    eager, within the margin, and of the same norm."""
    eager, emulated, bound = fake
    honest = {n: noisy(g, level, seed=2) for (n, g), level in
              zip(eager.items(), (0.02, 0.4, 0.4))}
    result = check(fake, **honest)
    assert result.ok, result.detail()
    detail = result.detail()
    assert detail["grad_reference"] == "the recipe's float32 emulation"
    assert 0.3 < detail["grad_worst_relative_error"] <= detail["grad_tolerance"]
    assert 0.9 < detail["grad_norm_ratio"] < 1.1 and detail["grad_norm_ratio_window"] == [0.8, 1.25]
    assert "float32 emulation" in detail["grad_bound"] and "norm" in detail["grad_bound"]


@pytest.mark.parametrize("name", ["quiet", "noisy"])
def test_a_gradient_at_half_its_value_fails(fake, name):
    """On the quiet parameter the distance fails it (0.5 against a bound of 0.05); on the noisy
    one the distance alone would pass it (0.5 within 1.5 x 0.4) and the norm fails it."""
    eager, emulated, bound = fake
    result = check(fake, **{name: emulated[name] * 0.5})
    assert not result.ok and result.gradients.failing == 1
    if name == "noisy":
        error = model_checks.gradient_error(emulated[name] * 0.5, emulated[name])
        assert error == pytest.approx(0.5) and error < bound.tolerances[name]
        detail = result.detail()
        assert detail["grad_norm_ratio_furthest_parameter"] == "noisy"
        assert detail["grad_norm_ratio"] == pytest.approx(0.5)
    assert not check(fake, **{name: emulated[name] * 2.0}).ok  # twice its value too


@pytest.mark.parametrize("skipped", ["none", "zeros", "another parameter's"])
def test_a_skipped_layer_s_gradient_fails(fake, skipped):
    """A layer skipped: its parameter gets no gradient, zeros, or (its input passed through)
    what another parameter of its shape gets."""
    eager, emulated, bound = fake
    got = {"none": None, "zeros": torch.zeros(4096),
           "another parameter's": emulated["other"]}[skipped]
    result = check(fake, noisy=got)
    assert not result.ok and result.gradients.failing == 1
    assert check(fake).ok  # the emulation itself passes


def test_the_emulation_s_gradients_wait_on_the_host():
    grads = {"w": torch.ones(3)}
    bound = model_checks.fp8_gradient_bound(grads, {"w": torch.ones(3) * 1.01}, store="meta")
    assert bound.reference["w"].device.type == "meta"
    with pytest.raises(model_checks.ParameterMismatch):
        model_checks.fp8_gradient_bound(grads, {"v": torch.ones(3)})
    with pytest.raises(model_checks.ParameterMismatch):
        model_checks.fp8_gradient_bound(grads, grads).check({"v": torch.ones(3)})


# --- measuring in one process (CUDA timing and memory stubbed) ----------------------------------

@pytest.fixture
def cpu_timing(monkeypatch):
    """e2e's peaks and interleaved timing without CUDA: fixed peaks, each variant's time its
    position (eager slowest), so the choice of the best recipe is known."""
    order = {}

    def bench(fns, **_):
        for fn in fns.values():
            fn()
        return {k: SimpleNamespace(median_ms=order.setdefault(k, 10.0 - len(order)))
                for k in fns}

    def peak_memory(model, step):
        step()
        model.zero_grad(set_to_none=True)
        return {"peak_gb": 1.0}
    monkeypatch.setattr(e2e, "peak_memory", peak_memory)
    monkeypatch.setattr(e2e, "do_bench_interleaved", bench)
    return order


def test_missing_and_failing_recipes_are_rows_not_crashes(cpu_timing, monkeypatch):
    import cutlass_ops

    eager, ids = tiny_llama(layers=1), tokens()
    real = cutlass_ops.convert

    def convert(model, **options):
        if options.get("fp8") == "tensorwise":  # what convert raised before it took fp8=
            raise TypeError("convert() got an unexpected keyword argument 'fp8'")
        return real(model, **options)
    monkeypatch.setattr(cutlass_ops, "convert", convert)
    models, missing, conversions = e2e_fp8.fp8_variants(eager, e2e_fp8.RECIPES)
    assert list(missing) == ["ours fp8 tensorwise"] and "TypeError" in missing[
        "ours fp8 tensorwise"]
    assert set(models) == set(conversions) == {"ours fp8 rowwise", "ours fp8 blockwise"}
    models["ours fp8 blockwise"].forward = lambda *a, **k: 1 / 0  # its step raises
    variants = {"eager": eager, "ours": copy.deepcopy(eager), **models}
    emulations = e2e_fp8.Emulations(eager, ids)
    tolerances = {n: emulations.tolerances(n.rsplit(" ", 1)[1]) for n in conversions}
    train = e2e.measure_train(variants, ids, 2, tolerances, fragile=set(conversions))
    assert "ZeroDivisionError" in train["ours fp8 blockwise"]["error"]
    with pytest.raises(ZeroDivisionError):  # a variant not marked fragile still raises
        e2e.measure_train({"eager": eager, "x": models["ours fp8 blockwise"]}, ids, 2)
    train.update({n: {"error": why} for n, why in missing.items()})
    peers = {"torchao-tensorwise": {"error": "torchao is not installed"}}
    rows = {r["case"]: r for r in e2e_fp8.train_rows(train, peers, 256, e2e_fp8.RECIPES)}
    assert list(rows) == [
        *(f"{kind} ours fp8 tensorwise vs torchao tensorwise"
          for kind in ("train", "peak memory train")),  # not converted: no row against bf16
        *(f"{kind} ours fp8 rowwise vs torchao rowwise" for kind in ("train", "peak memory train")),
        "train ours fp8 rowwise vs ours bf16",  # its peer missing, ours bf16 measured beside it
        *(f"{kind} ours fp8 blockwise vs ours bf16" for kind in ("train", "peak memory train"))]
    tensorwise = rows["train ours fp8 tensorwise vs torchao tensorwise"]
    assert tensorwise["ours"] is None and tensorwise["ratio"] is None and not tensorwise["correct"]
    assert "TypeError" in tensorwise["detail"]["missing"]
    assert "not installed" in tensorwise["detail"]["missing"]
    rowwise = rows["train ours fp8 rowwise vs torchao rowwise"]  # torchao rowwise never ran
    assert rowwise["ours"] is not None and rowwise["reference"] is None
    assert not rowwise["correct"] and "torchao-rowwise has no train figure" in \
        rowwise["detail"]["missing"]
    assert rowwise["detail"]["grad_failing_parameters"] == 0  # ours' check is still recorded
    against_bf16 = rows["train ours fp8 rowwise vs ours bf16"]
    assert against_bf16["reference_name"] == "ours bf16"
    assert against_bf16["correct"] == train["ours fp8 rowwise"]["check"].ok
    assert against_bf16["detail"]["reference_ms"] == round(train["ours"]["ms"], 3)
    blockwise = rows["train ours fp8 blockwise vs ours bf16"]
    assert "ZeroDivisionError" in blockwise["detail"]["missing"]
    assert "no blockwise recipe" in blockwise["detail"]["no_torchao_peer"]

    prefill = e2e.measure_prefill({k: v for k, v in variants.items()}, ids, 2,
                                  fragile=set(conversions))
    prefill.update({n: {"error": why} for n, why in missing.items()})
    peers["torchao-rowwise"] = {"prefill": {"ms": 50.0, "correct": True}}
    rows = {r["case"]: r for r in e2e_fp8.prefill_rows(prefill, 256, e2e_fp8.RECIPES,
                                                       emulations, peers)}
    row = rows["prefill ours fp8 rowwise vs torchao rowwise"]
    assert row["correct"] and row["reference_name"] == "torchao float8 rowwise + compile"
    assert rows["prefill ours fp8 rowwise vs ours bf16"]["correct"]
    assert "prefill ours fp8 tensorwise vs ours bf16" not in rows  # not converted
    assert row["detail"]["logits_error_vs_eager"] <= row["detail"]["logits_tolerance"]
    assert row["ratio"] == round(row["ours"] / row["reference"], 4)
    assert not rows["prefill ours fp8 tensorwise vs torchao tensorwise"]["correct"]
    blockwise = rows["prefill ours fp8 blockwise vs ours bf16"]  # its forward raises
    assert blockwise["ours"] is None and "ZeroDivisionError" in blockwise["detail"]["missing"]
    assert blockwise["reference"] is not None


def entry(ms, ok, peak=2.0):
    grads = model_checks.GradientCheck("p", 0.1, 0.2, 0 if ok else 1, 10)
    return {"ms": ms, "loss": 5.0, "peak_gb": peak,
            "check": model_checks.TrainCheck(5.0, 5.0, grads)}


def peer(ms, peak=14.5, eager_ms=12.1, **settings):
    return {"train": {"ms": ms, "correct": True, "loss": 5.0, "peak_gb": peak},
            "eager": {"train_ms": eager_ms}, "versions": {"torchao": "0.18.0"},
            "settings": settings}


def test_each_recipe_has_its_own_rows_against_torchao_s_same_recipe():
    train = {"eager": entry(12.0, True, 3.0), "ours": entry(10.0, True, 2.5),
             "ours fp8 tensorwise": entry(7.0, False, 2.0),  # fastest, but wrong
             "ours fp8 rowwise": entry(8.0, True, 2.2), "ours fp8 blockwise": entry(9.0, True, 1.9)}
    peers = {"torchao-tensorwise": peer(8.5, loss="liger fused linear cross-entropy 0.8.5"),
             "torchao-rowwise": peer(9.5), "torchao-rowwise-hf-loss": peer(11.0),
             "liger": {"error": "liger_kernel is not installed"}}
    rows = {r["case"]: r for r in e2e_fp8.train_rows(train, peers, 4096, e2e_fp8.RECIPES)}
    tensorwise = rows["train ours fp8 tensorwise vs torchao tensorwise"]
    # No best-of: the wrong tensorwise is its own row, not correct, against torchao's tensorwise.
    assert not tensorwise["correct"] and tensorwise["ours"] == round(4096 / 7.0 * 1e3, 1)
    assert tensorwise["reference_name"] == "torchao float8 tensorwise + compile"
    assert tensorwise["reference"] == round(4096 / 8.5 * 1e3, 1)
    assert tensorwise["ratio"] == round(tensorwise["ours"] / tensorwise["reference"], 4)
    detail = tensorwise["detail"]
    assert detail["peers"]["torchao-tensorwise"]["settings"]["loss"].startswith("liger fused")
    assert detail["peers"]["torchao-tensorwise"]["eager_ms_in_its_process"] == 12.1
    assert "not installed" in detail["peers"]["liger"]["error"]
    assert detail["weaker_references_tokens_per_s"] == {
        "eager": round(4096 / 12.0 * 1e3, 1), "ours bf16": round(4096 / 10.0 * 1e3, 1)}
    assert detail["grad_tolerance"] == 0.2 and detail["grad_worst_relative_error"] == 0.1
    rowwise = rows["train ours fp8 rowwise vs torchao rowwise"]
    assert rowwise["correct"] and rowwise["reference"] == round(4096 / 9.5 * 1e3, 1)
    assert rowwise["detail"]["weaker_references_tokens_per_s"][
        "torchao float8 rowwise + compile, HF full-logits loss"] == round(4096 / 11.0 * 1e3, 1)
    memory = rows["peak memory train ours fp8 rowwise vs torchao rowwise"]
    assert memory["ratio"] == round(14.5 / 2.2, 4) and memory["detail"]["recipe"] == "rowwise"
    for recipe, ours_ms in (("tensorwise", 7.0), ("rowwise", 8.0)):  # the FP8 speedup's rows
        row = rows[f"train ours fp8 {recipe} vs ours bf16"]
        assert row["ratio"] == round(round(4096 / ours_ms * 1e3, 1) / round(4096 / 10.0 * 1e3, 1),
                                     4)
        assert row["correct"] == rows[f"train ours fp8 {recipe} vs torchao {recipe}"]["correct"]
        assert "peers" not in row["detail"]
    blockwise = rows["train ours fp8 blockwise vs ours bf16"]
    assert blockwise["reference_name"] == "ours bf16" and blockwise["correct"]
    assert blockwise["detail"]["reference_correct"] is True
    assert "ours bf16" not in blockwise["detail"]["weaker_references_tokens_per_s"]
    # No recipe ran: every row says so, with the figures it has.
    nothing = {k: v for k, v in train.items() if not k.startswith("ours fp8")}
    for row in e2e_fp8.train_rows(nothing, peers, 4096, e2e_fp8.RECIPES):
        assert row["ours"] is None and row["ratio"] is None and not row["correct"]
        assert "not measured" in row["detail"]["missing"]
        assert row["reference"] is not None


def test_the_reference_is_torchao_s_faster_configuration_of_the_recipe():
    """Liger's fused loss is not always torchao's faster configuration: where HF's compiled
    loss is faster, it is the row's reference and the Liger one a weaker reference."""
    train = {"eager": entry(12.0, True, 3.0), "ours": entry(10.0, True, 2.5),
             "ours fp8 tensorwise": entry(7.0, True, 2.0)}
    peers = {"torchao-tensorwise": peer(11.0), "torchao-tensorwise-hf-loss": peer(8.0)}
    row = e2e_fp8.train_rows(train, peers, 4096, ["tensorwise"])[0]
    assert row["reference_name"] == "torchao float8 tensorwise + compile, HF full-logits loss"
    assert row["reference"] == round(4096 / 8.0 * 1e3, 1)
    assert row["ratio"] == round(row["ours"] / row["reference"], 4)
    assert row["detail"]["weaker_references_tokens_per_s"][
        "torchao float8 tensorwise + compile"] == round(4096 / 11.0 * 1e3, 1)
    del peers["torchao-tensorwise-hf-loss"]  # measured alone: the Liger one is the reference
    alone = e2e_fp8.train_rows(train, peers, 4096, ["tensorwise"])[0]
    assert alone["reference"] == round(4096 / 11.0 * 1e3, 1)


def test_torchao_s_fused_loss_step_is_hf_s_causal_lm_loss():
    """The torchao peer's step with a fused loss computes what HF's labels=ids loss does
    (positions shifted, the mean over every predicted token): here with torch's own linear and
    cross-entropy in Liger's place."""
    model, ids = tiny_llama(layers=1).float(), tokens()

    def loss_fn(weight, hidden, labels):
        return torch.nn.functional.cross_entropy(hidden @ weight.t(), labels)
    fused = e2e_fp8._fused_loss_step(model, model.model, loss_fn, ids)
    loss, grads = e2e.first_step(model, fused)
    reference, expected = e2e.first_step(model, e2e.train_step(model, ids))
    assert loss == pytest.approx(reference, rel=1e-5)
    assert all(model_checks.gradient_error(grads[n], g) < 1e-4 for n, g in expected.items())


def test_peer_names_and_recipes():
    assert e2e_fp8.torchao_recipe("torchao-rowwise-hf-loss") == "rowwise"
    assert e2e_fp8.torchao_recipe("liger") is None
    assert e2e_fp8.peer_name("torchao-tensorwise") == "torchao float8 tensorwise + compile"
    assert e2e_fp8.torchao_variant("blockwise") is None
    assert e2e_fp8.PEER_PACKAGES["torchao-tensorwise-hf-loss"] == "torchao"


def test_fp8_only_runs_keep_the_rows_they_do_not_write_again():
    old = [{"case": c} for c in ("train ours vs eager", "decode batch 1 ours vs eager",
                                 "train ours vs compile")]
    new = [{"case": "train ours vs eager", "new": True},
           {"case": e2e_fp8.train_case("rowwise")}]
    assert e2e.replaced_rows(old, new) == old[1:]


# --- peers in their own processes ----------------------------------------------------------------

ARGS = SimpleNamespace(layers=2, tokens=1024, reps=3)


def fake_peer(body: str):
    """A command writing what ``body`` (Python, with ``out`` the result path and ``meta``) says,
    in place of e2e.py --only-variant."""
    def command(variant, args, out):
        meta = json.dumps(e2e_fp8.peer_meta(variant, args))
        script = f"import json, sys, time\nout = {str(out)!r}\nmeta = json.loads({meta!r})\n"
        return [sys.executable, "-c", script + body]
    return command


@pytest.fixture
def installed(monkeypatch):
    monkeypatch.setattr(e2e_fp8, "peer_unavailable", lambda variant: None)


def test_a_peer_s_result_is_merged_and_reused(tmp_path, installed):
    body = ("json.dump({'meta': meta, 'train': {'ms': 9.0, 'correct': True}, "
            "'eager': {'train_ms': 12.0}}, open(out, 'w'))")
    result = e2e_fp8.run_peer("torchao-rowwise", ARGS, tmp_path, 60, command=fake_peer(body))
    assert result["train"]["ms"] == 9.0 and "error" not in result
    assert (tmp_path / "torchao-rowwise.json").exists()
    again = e2e_fp8.run_peer("torchao-rowwise", ARGS, tmp_path, 60,
                             command=fake_peer("raise SystemExit(3)"))
    assert again == result  # the same code, model, tokens and reps: reused
    fresh = e2e_fp8.run_peer("torchao-rowwise", ARGS, tmp_path, 60, fresh=True,
                             command=fake_peer("print('boom'); raise SystemExit(3)"))
    assert "exit code 3" in fresh["error"] and "boom" in fresh["error"]
    other = SimpleNamespace(layers=8, tokens=4096, reps=3)  # another model: not reused
    assert e2e_fp8.load_peer(tmp_path / "torchao-rowwise.json",
                             e2e_fp8.peer_meta("torchao-rowwise", other)) is None


def test_a_peer_that_writes_another_run_s_result_or_hangs_is_an_error(tmp_path, installed):
    stale = "meta['tokens'] = 1; json.dump({'meta': meta}, open(out, 'w'))"
    result = e2e_fp8.run_peer("liger", ARGS, tmp_path, 60, command=fake_peer(stale))
    assert "without a result for this run" in result["error"]
    hung = e2e_fp8.run_peers(["torchao-tensorwise"], ARGS, tmp_path, 1,
                             command=fake_peer("print('compiling', flush=True); time.sleep(30)"))
    assert "did not finish within 1 s" in hung["torchao-tensorwise"]["error"]
    assert "compiling" in hung["torchao-tensorwise"]["error"]


def test_a_peer_that_is_not_installed_never_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e_fp8, "installed", lambda package: False)
    started = []
    result = e2e_fp8.run_peer("torchao-tensorwise", ARGS, tmp_path, 60,
                              command=lambda *a: started.append(a) or ["false"])
    assert not started and "pip install torchao==0.18.0" in result["error"]
    assert "liger-kernel==0.8.5" in e2e_fp8.peer_unavailable("liger")


def test_the_peer_command_is_this_e2e_with_the_run_s_sizes(tmp_path):
    command = e2e_fp8.peer_command("liger", ARGS, tmp_path / "liger.json")
    assert command[1].endswith("benchmarks/e2e.py")
    assert command[2:] == ["--only-variant", "liger", "--json", str(tmp_path / "liger.json"),
                           "--layers", "2", "--tokens", "1024", "--reps", "3"]
    args = e2e.parse_args(command[2:])
    assert args.only_variant == "liger" and args.layers == 2 and args.tokens == 1024


def test_fp8_only_selects_the_fp8_variants_and_torchao_peers():
    args = e2e.parse_args(["--fp8-only"])
    assert args.sections == ["train", "prefill"]
    assert args.peers == [*e2e_fp8.TORCHAO, *e2e_fp8.TORCHAO_HF_LOSS]
    assert args.recipes == list(e2e_fp8.RECIPES)
    full = e2e.parse_args([])
    assert full.peers == list(e2e_fp8.DEFAULT_PEERS) and full.sections == list(e2e.SECTIONS)
    assert "torchao-rowwise-hf-loss" in full.peers  # both of torchao's configurations
    assert e2e.parse_args(["--peers", "torchao-rowwise-hf-loss"]).peers == [
        "torchao-rowwise-hf-loss"]
    assert e2e.parse_args(["--no-fp8"]).peers == [] == e2e.parse_args(["--no-fp8"]).recipes
    assert e2e.parse_args(["--fp8-only", "--peers", "none"]).peers == []


def test_tune_lists_each_recipe_s_fp8_gemms():
    """--tune tunes what convert(model, fp8=recipe) runs: forward, dgrad and wgrad per Linear
    shape, with each recipe's scaling (cutlass-tune --fp8 --model's list)."""
    model = tiny_llama(layers=1)
    problems = e2e.fp8_problems(model, SimpleNamespace(recipes=["rowwise", "blockwise"],
                                                       tokens=256))
    scalings = {p.operands.scaling.value for p in problems}
    assert scalings == {"rowwise", "blockwise"} and len(problems) % 3 == 0
    assert e2e.fp8_problems(model, SimpleNamespace(recipes=[], tokens=256)) == []


def test_a_torchao_peer_s_process_records_its_loss_and_checks_against_the_emulation(
        monkeypatch):
    """measure_peer's wiring for torchao with Liger's fused loss, on a CPU: torchao and Liger
    stubbed (no conversion; torch's linear and cross-entropy as the fused loss), no compile, CUDA
    timing and memory stubbed. It records its loss in its settings, checks its gradients against
    the recipe's emulation and its logits by the emulation's bound; the HF-loss peer, and
    torchao without Liger, record theirs."""
    import types

    float8 = types.ModuleType("torchao.float8")
    float8.Float8LinearConfig = SimpleNamespace(from_recipe_name=lambda name: name)
    float8.convert_to_float8_training = lambda model, config, module_filter_fn: model
    fused = types.ModuleType("liger_kernel.transformers.fused_linear_cross_entropy")

    class LigerFusedLinearCrossEntropyLoss:
        def __call__(self, weight, hidden, labels):
            return torch.nn.functional.cross_entropy((hidden @ weight.t()).float(), labels)
    fused.LigerFusedLinearCrossEntropyLoss = LigerFusedLinearCrossEntropyLoss
    monkeypatch.setitem(sys.modules, "torchao.float8", float8)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.fused_linear_cross_entropy",
                        fused)
    monkeypatch.setattr(e2e_fp8, "installed", lambda package: True)
    monkeypatch.setattr(e2e_fp8, "_version", lambda package: "0.0")
    monkeypatch.setattr(e2e_fp8, "_time", lambda fn, reps: fn() is not None and 1.0)
    monkeypatch.setattr(e2e_fp8, "peer_meta", lambda variant, args: {"variant": variant})
    monkeypatch.setattr(torch, "compile", lambda module: module)
    monkeypatch.setattr(e2e, "llama", lambda layers: tiny_llama(layers))
    monkeypatch.setattr(e2e, "token_ids", lambda count: tokens()[:, :32])
    monkeypatch.setattr(e2e, "peak_memory", lambda model, step: {"peak_gb": 1.0})
    args = SimpleNamespace(layers=1, tokens=256, reps=2)
    fused_result = e2e_fp8.measure_peer("torchao-rowwise", args)
    assert fused_result["settings"]["loss"].startswith("liger fused linear cross-entropy")
    assert fused_result["versions"] == {"torchao": "0.0", "liger-kernel": "0.0"}
    train = fused_result["train"]
    assert train["correct"] and train["grad_reference"] == "the recipe's float32 emulation"
    assert train["loss"] == pytest.approx(fused_result["eager"]["loss"], rel=1e-2)
    assert fused_result["prefill"]["correct"] and fused_result["prefill"]["ms"] == 1.0
    hf = e2e_fp8.build_peer("torchao-rowwise-hf-loss", tiny_llama(1), tokens()[:, :32])
    assert hf.settings["loss"].startswith("hf full logits") and hf.forward().shape[-1] == VOCAB
    monkeypatch.setattr(e2e_fp8, "installed", lambda package: package != "liger_kernel")
    assert "not installed" in e2e_fp8.build_peer("torchao-tensorwise", tiny_llama(1),
                                                 tokens()).settings["loss_note"]


# --- mixture-of-experts models: the experts' emulation ------------------------------------------

def tiny_qwen3_moe():
    """Expert widths blockwise takes (multiples of 128), routers scaled so that each token's
    experts are clear-cut (FP8 noise then moves no token to other experts)."""
    config = transformers.Qwen3MoeConfig(
        hidden_size=256, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        vocab_size=VOCAB, norm_topk_prob=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(30.0)
    return model


def fp8_experts_model(eager, scale=1.0):
    """``eager``'s copy with its experts as ``convert`` leaves them on a GPU, then FP8
    blockwise (``convert_fp8``; off CUDA the experts' quantization runs in torch). ``scale``:
    the experts' down_proj gradients multiplied by it (a planted fault)."""
    from cutlass_ops.fp8 import fp8_experts
    from cutlass_ops.fp8.convert import convert_fp8
    from cutlass_ops.moe.experts import GroupedExperts

    model = copy.deepcopy(eager)
    for layer in model.model.layers:
        layer.mlp.experts = GroupedExperts(layer.mlp.experts)
    convert_fp8(model, "blockwise")
    experts = [layer.mlp.experts for layer in model.model.layers]
    assert all(isinstance(e, fp8_experts.Fp8GroupedExperts) for e in experts)
    if scale != 1.0:
        experts[1].down_proj.register_hook(lambda g: g * scale)
    return model


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_fp8_experts_pass_the_blockwise_emulation_bound_and_a_halved_gradient_fails(scale):
    """Blockwise emulation quantizes the experts' GEMMs as Fp8GroupedExperts does (forward and
    dgrad, weight gradients in high precision): FP8 experts pass its bound; one expert
    weight's gradient at half its value fails it."""
    eager = tiny_qwen3_moe()
    ids = tokens()
    reference = step(eager, ids)
    emulations = e2e_fp8.Emulations(eager, ids)
    bounds = emulations.tolerances("blockwise")(*reference)
    loss, grads = step(fp8_experts_model(eager, scale), ids)
    check = model_checks.check_train_step(loss, grads, *reference, bounds)
    if scale == 1.0:
        assert check.ok, check.detail()
    else:
        assert check.loss_ok and not check.ok
        assert check.detail()["grad_worst_parameter"] == "model.layers.1.mlp.experts.down_proj"


def test_the_experts_emulation_quantizes_only_under_blockwise():
    eager = tiny_qwen3_moe()
    experts = eager.model.layers[0].mlp.experts
    assert fp8_emulation.is_experts(experts)
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    index = torch.randint(0, 4, (16, 2), generator=torch.Generator().manual_seed(0))
    weights = torch.full((16, 2), 0.5, dtype=torch.bfloat16)
    exact = experts(x, index, weights)
    tensorwise = fp8_emulation.emulate_fp8(copy.deepcopy(eager), "tensorwise")
    assert torch.equal(tensorwise.model.layers[0].mlp.experts(x, index, weights), exact)
    blockwise = fp8_emulation.emulate_fp8(copy.deepcopy(eager), "blockwise")
    got = blockwise.model.layers[0].mlp.experts(x, index, weights)
    error = float((got.float() - exact.float()).norm() / exact.float().norm())
    assert 1e-3 < error < 0.1  # FP8's rounding, no more


def test_a_recipe_with_the_lm_head_converts_emulates_and_is_compared_with_the_head_fp8(
        monkeypatch):
    """``R+lm_head``: convert with ``fp8_lm_head=True``, an emulation whose head is FP8 too, and
    rows of its own against R's torchao peer, saying the head differs."""
    import cutlass_ops

    seen = []
    real = cutlass_ops.convert
    monkeypatch.setattr(cutlass_ops, "convert",
                        lambda model, **options: seen.append(options) or real(model, **options))
    eager = tiny_llama(layers=1)
    models, missing, _ = e2e_fp8.fp8_variants(eager, ["tensorwise+lm_head"])
    assert not missing and list(models) == ["ours fp8 tensorwise+lm_head"]
    assert seen == [{"fp8": "tensorwise", "fp8_lm_head": True}]
    assert e2e_fp8.split_variant("rowwise+lm_head") == ("rowwise", True)
    assert e2e_fp8.split_variant("rowwise") == ("rowwise", False)
    emulations = e2e_fp8.Emulations(eager, tokens())
    assert "forward" in vars(emulations._model("tensorwise+lm_head").lm_head)
    assert "forward" not in vars(emulations._model("tensorwise").lm_head)
    train = {"eager": entry(12.0, True, 3.0), "ours": entry(10.0, True, 2.5),
             "ours fp8 tensorwise+lm_head": entry(7.0, True, 2.0)}
    rows = {r["case"]: r for r in e2e_fp8.train_rows(
        train, {"torchao-tensorwise": peer(8.5)}, 4096, ["tensorwise+lm_head"])}
    row = rows["train ours fp8 tensorwise+lm_head vs torchao tensorwise"]
    assert row["correct"] and row["ratio"] == pytest.approx(8.5 / 7.0, abs=1e-3)
    assert "FP8 here" in row["detail"]["lm_head"]
    args = e2e.parse_args(["--fp8-only", "--recipes", "tensorwise", "tensorwise+lm_head"])
    assert args.recipes == ["tensorwise", "tensorwise+lm_head"]
    # The tune of the FP8 GEMMs names each recipe once.
    asked = []
    monkeypatch.setattr("tuning.cli._fp8_model_problems",
                        lambda namespace, model: asked.append(namespace.fp8) or [])
    e2e.fp8_problems(eager, args)
    assert asked == ["tensorwise"]
