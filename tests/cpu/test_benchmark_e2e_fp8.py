"""benchmarks/e2e.py's FP8 rows (benchmarks/e2e_fp8.py) on a CPU: the row names, the best
recipe, variants that are missing (convert refusing fp8=, a step that raises, torchao not
installed) reported as rows rather than crashes, the peers' processes and the merging of their
results, and the FP8 check: a tiny random Llama converted FP8 (convert's CPU path) passes the
bound set by the recipe's float32 emulation, a copy with one layer's scale applied twice or a
layer skipped fails it, and the FP8 model fails the bf16 bound that the check replaces."""

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
    assert list(rows) == [e2e_fp8.TRAIN_FP8, e2e_fp8.MEMORY_FP8, e2e_fp8.TRAIN_TORCHAO]
    row = rows[e2e_fp8.TRAIN_FP8]
    assert row["detail"]["recipe"] == "rowwise" and row["correct"], row["detail"]
    assert row["ratio"] == round(row["ours"] / row["reference"], 4)
    assert "TypeError" in row["detail"]["recipes"]["tensorwise"]["error"]
    assert "ZeroDivisionError" in row["detail"]["recipes"]["blockwise"]["error"]
    torchao = rows[e2e_fp8.TRAIN_TORCHAO]
    assert torchao["reference"] is None and torchao["ratio"] is None
    assert not torchao["correct"] and "not installed" in torchao["detail"]["missing"]

    prefill = e2e.measure_prefill({k: v for k, v in variants.items()}, ids, 2,
                                  fragile=set(conversions))
    prefill.update({n: {"error": why} for n, why in missing.items()})
    (row,) = e2e_fp8.prefill_rows(prefill, 256, e2e_fp8.RECIPES, emulations, peers)
    assert row["case"] == e2e_fp8.PREFILL_FP8 and row["detail"]["recipe"] == "rowwise"
    assert row["correct"] and row["detail"]["logits_error_vs_eager"] <= \
        row["detail"]["logits_tolerance"]


def entry(ms, ok, peak=2.0):
    grads = model_checks.GradientCheck("p", 0.1, 0.2, 0 if ok else 1, 10)
    return {"ms": ms, "loss": 5.0, "peak_gb": peak,
            "check": model_checks.TrainCheck(5.0, 5.0, grads)}


def test_best_recipe_is_the_fastest_correct_one_else_the_fastest_measured():
    ok = lambda e: e["ok"]  # noqa: E731
    entries = {"a": {"ms": 1.0, "ok": False}, "b": {"ms": 2.0, "ok": True},
               "c": {"ms": 3.0, "ok": True}, "d": {"error": "x"}}
    assert e2e_fp8.best(entries, ok) == "b"
    assert e2e_fp8.best({k: {**v, "ok": False} for k, v in entries.items()}, ok) == "a"
    assert e2e_fp8.best({"d": {"error": "x"}}, ok) is None


def test_rows_name_each_row_s_best_recipe_and_the_faster_torchao():
    train = {"eager": entry(12.0, True, 3.0), "ours": entry(10.0, True, 2.5),
             "ours fp8 tensorwise": entry(7.0, False, 2.0),  # fastest, but wrong
             "ours fp8 rowwise": entry(8.0, True, 2.2), "ours fp8 blockwise": entry(9.0, True, 1.9)}
    peers = {"torchao-tensorwise": {"train": {"ms": 8.5, "correct": True},
                                    "eager": {"train_ms": 12.1}, "versions": {"torchao": "0.18.0"}},
             "torchao-rowwise": {"train": {"ms": 9.5, "correct": True}},
             "liger": {"error": "liger_kernel is not installed"}}
    rows = e2e_fp8.train_rows(train, peers, 4096, e2e_fp8.RECIPES)
    assert [r["case"] for r in rows] == [
        "train ours fp8 vs ours bf16", "peak memory train ours fp8 vs ours bf16",
        "train ours fp8 vs torchao float8"]
    fp8, memory, torchao = rows
    assert fp8["detail"]["recipe"] == "rowwise" and fp8["correct"]
    assert fp8["ours"] == round(4096 / 8.0 * 1e3, 1) and fp8["reference_name"] == "ours bf16"
    assert fp8["detail"]["recipes"]["tensorwise"]["correct"] is False
    # The memory row is the train row's recipe (blockwise's smaller peak is in detail).
    assert memory["detail"]["recipe"] == "rowwise" and memory["ratio"] == round(2.5 / 2.2, 4)
    assert memory["detail"]["recipes_gb"]["blockwise"] == 1.9
    assert torchao["reference_name"] == "torchao float8 tensorwise + compile"
    assert torchao["ratio"] == round(torchao["ours"] / torchao["reference"], 4) < 1.1
    assert torchao["detail"]["peers"]["torchao-tensorwise"]["eager_ms_in_its_process"] == 12.1
    assert "not installed" in torchao["detail"]["peers"]["liger"]["error"]
    # No recipe ran: every row says so, with the figures it has.
    nothing = {k: v for k, v in train.items() if not k.startswith("ours fp8")}
    for row in e2e_fp8.train_rows(nothing, peers, 4096, e2e_fp8.RECIPES):
        assert row["ours"] is None and row["ratio"] is None and not row["correct"]
        assert "no FP8 recipe ran" in row["detail"]["missing"]
        assert row["reference"] is not None


def test_fp8_only_runs_keep_the_rows_they_do_not_write_again():
    old = [{"case": c} for c in ("train ours vs eager", "decode batch 1 ours vs eager",
                                 "train ours vs compile")]
    new = [{"case": "train ours vs eager", "new": True}, {"case": e2e_fp8.TRAIN_FP8}]
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
    assert args.sections == ["train", "prefill"] and args.peers == list(e2e_fp8.TORCHAO)
    assert args.recipes == list(e2e_fp8.RECIPES)
    full = e2e.parse_args([])
    assert full.peers == list(e2e_fp8.PEERS) and full.sections == list(e2e.SECTIONS)
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
