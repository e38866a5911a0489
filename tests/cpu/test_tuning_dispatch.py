import logging

import pytest
import torch

import cutlass_ops
from custom_kernels.core import cache_dir
from cutlass_ops.gemms.config import GemmConfig, GemmOperands, GemmProblem
from cutlass_ops.gemms import dispatch
from cutlass_ops.gemms.choice import Choice
from custom_kernels.core.device import named_spec

OPS = GemmOperands.make("bf16")
H100 = named_spec("H100")
WINNER = Choice(GemmConfig(kernel_schedule="cooperative", tile=(128, 256, 64)))
SMALL = Choice(GemmConfig(tile=(64, 16, 128)), swap_ab=True)


def entry(problem, choice=WINNER, prefer="cutlass"):
    return {"winner": choice.to_dict() if choice else None, "winner_ms": 1.0, "torch_ms": 1.1,
            "prefer": prefer, "problem": problem.to_dict()}


def entries_for(*items):
    return {p.name: entry(p, *rest) for p, *rest in items}


def decide(problem, entries, built=(), online="off"):
    from tuning.online import ONLINE

    return dispatch.decide(problem, entries, H100, is_built=lambda c: True,
                           built_choices=lambda: list(built), online=online, tuner=ONLINE)


def test_exact_hit_runs_the_winner_or_torch_when_torch_won():
    p = GemmProblem(OPS, 4096, 4096, 4096)
    d = decide(p, entries_for((p,)))
    assert (d.source, d.choice) == ("exact", WINNER)
    d = decide(p, entries_for((p, WINNER, "torch")))
    assert (d.source, d.choice) == ("exact", None) and "torch.matmul was faster" in d.reason


def test_exact_hit_whose_kernel_is_not_built_does_not_compile_on_a_call():
    p = GemmProblem(OPS, 4096, 4096, 4096)
    d = dispatch.decide(p, entries_for((p,)), H100, is_built=lambda c: False,
                        built_choices=lambda: [SMALL], online="off")
    assert d.source == "heuristic" and d.choice is not None


def test_nearest_tuned_shape_of_the_same_operands():
    near = GemmProblem(OPS, 128, 4096, 4096)
    far = GemmProblem(OPS, 200, 1024, 1024)  # closer in M, but other weights
    other_ops = GemmProblem(GemmOperands.make("f16"), 200, 4096, 4096)
    entries = {**entries_for((near, SMALL), (far, WINNER)), **entries_for((other_ops,))}
    d = decide(GemmProblem(OPS, 200, 4096, 4096), entries)
    assert (d.source, d.choice) == ("nearest", SMALL) and "128x4096x4096" in d.reason


def test_nearest_that_preferred_torch_keeps_torch():
    near = GemmProblem(OPS, 128, 4096, 4096)
    d = decide(GemmProblem(OPS, 200, 4096, 4096), entries_for((near, WINNER, "torch")))
    assert d.source == "nearest" and d.choice is None


def test_untuned_shape_gets_the_best_built_kernel_at_once():
    d = decide(GemmProblem(OPS, 8192, 8192, 8192), {}, built=[SMALL, WINNER])
    assert (d.source, d.choice) == ("heuristic", WINNER)


def test_nothing_built_falls_back_to_torch_unless_online():
    p = GemmProblem(OPS, 1000, 4096, 4096)
    d = decide(p, {})
    assert d.source == "torch" and "cutlass-tune tune 1000x4096x4096" in d.reason
    d = decide(p, {}, online="compile")
    assert d.source == "online" and d.choice is not None


def test_online_mode_is_validated(monkeypatch):
    with pytest.raises(ValueError):
        dispatch.set_online("sometimes")
    monkeypatch.setenv("CUTLASS_OPS_ONLINE", "compile")
    assert dispatch.online_mode() == "compile"
    dispatch.set_online("off")
    assert dispatch.online_mode() == "off"
    dispatch.set_online(None)


def test_unsupported_inputs_run_on_torch_with_one_log_line(caplog):
    dispatch._logged.clear()
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with caplog.at_level(logging.WARNING, logger="cutlass_ops"):
        for _ in range(3):
            out = cutlass_ops.matmul(a, b)
    torch.testing.assert_close(out, a @ b)
    assert dispatch.calls["torch"] >= 3
    lines = [r.getMessage() for r in caplog.records if "torch.matmul" in r.getMessage()]
    assert len(lines) == 1 and "cpu" in lines[0]
    assert cutlass_ops.explain(a, b).source == "torch"
    # Bad shapes get torch's own error, not a wrong answer.
    with pytest.raises(RuntimeError):
        cutlass_ops.matmul(a, torch.randn(15, 4))


def test_built_choices_reads_the_artifact_cache(monkeypatch, tmp_path):
    from cutlass_ops.gemms import build, emit, loader as kernels

    if not build.nvcc_available():
        pytest.skip("nvcc not found")
    monkeypatch.setenv("CUTLASS_OPS_CACHE_DIR", str(tmp_path))
    config = GemmConfig(tile=(64, 16, 128))
    swapped = SMALL.operands_for(OPS)
    path = emit._emitted_path(swapped, config)
    cache_dir.atomic_write_text(path, "// fake emitted source")
    spec = kernels.build_spec(swapped, config, "// fake emitted source")
    spec.directory.mkdir(parents=True)
    assert dispatch.built_choices(OPS, "sm90a") == []
    (spec.directory / "kernel.so").write_bytes(b"")
    assert dispatch.built_choices(OPS, "sm90a") == [Choice(config, swap_ab=True)]
    assert kernels.is_built(swapped, config)


class _FakeKernel:
    def __init__(self):
        self.launches = []

    def run(self, args, workspace_ptr, workspace_bytes, stream):
        self.launches.append((args.a, args.b, args.c, args.d, args.m, args.n))

    run_checked = run


@pytest.mark.parametrize("swap", [False, True])
def test_fast_path_swaps_in_the_pointers_plan_would_use(monkeypatch, swap):
    """After the first (fully checked) launch, a call with the same signature reuses the launch
    arguments with this call's pointers: they must be the ones plan() would have set."""
    from cutlass_ops.gemms import plan as gemm_api, runtime

    kernel = _FakeKernel()

    def fake_plan(a, b, c=None, *, config, out=None, out_dtype=None, **_):
        args = runtime.GemmArgs(m=a.shape[0], n=b.shape[1], a=a.data_ptr(), b=b.data_ptr(),
                                c=out.data_ptr(), d=out.data_ptr())

        def launch():
            kernel.run(args, 0, 0, 0)
            return out

        launch.kernel, launch.args, launch.workspace_bytes = kernel, args, 0
        return launch

    monkeypatch.setattr(gemm_api, "plan", fake_plan)
    monkeypatch.setattr(dispatch, "_current_stream", lambda index: 0)
    route = dispatch._cutlass_route(
        dispatch.Decision("exact", Choice(GemmConfig(), swap_ab=swap), "test"), None, None)
    for _ in range(3):  # the first launch goes through plan, the others through the fast path
        a, b = torch.randn(16, 32), torch.randn(32, 8)
        out = route.run(a, b)
        assert out.shape == (16, 8) and out.is_contiguous()
        want = ((b.data_ptr(), a.data_ptr()) if swap else (a.data_ptr(), b.data_ptr())) + (
            out.data_ptr(), out.data_ptr())
        assert kernel.launches[-1][:4] == want
        # Sizes come from the first launch's checked arguments (same signature).
        assert kernel.launches[-1][4:] == kernel.launches[0][4:]
    assert len(kernel.launches) == 3


def test_fused_epilogue_is_its_own_tuned_problem():
    from cutlass_ops.gemms.config import Epilogue

    fused = GemmProblem(OPS.with_epilogue(Epilogue.parse("bias,gelu_tanh")), 128, 4096, 4096)
    plain = GemmProblem(OPS, 128, 4096, 4096)
    assert decide(fused, entries_for((plain, WINNER))).source != "exact"  # no borrowing
    assert decide(fused, entries_for((fused, SMALL))) == dispatch.Decision(
        "exact", SMALL, "tuned for this shape")


@pytest.mark.parametrize("activation", ["identity", "relu", "gelu", "gelu_tanh", "silu"])
def test_epilogue_arguments_on_torch_match_the_formula(activation):
    """Off the GPU the epilogue runs in torch: act(alpha * a @ b + bias) + beta * residual."""
    from cutlass_ops.gemms import epilogues

    a, b, bias, res = torch.randn(8, 16), torch.randn(16, 4), torch.randn(4), torch.randn(8, 4)
    got = cutlass_ops.matmul(a, b, bias=bias, activation=activation, residual=res, alpha=0.5,
                             beta=2.0)
    want = epilogues.activate(0.5 * (a @ b) + bias, activation) + 2.0 * res
    torch.testing.assert_close(got, want)
    # beta = 0 ignores the residual, NaNs included, as torch.addmm ignores C.
    nan = torch.full((8, 4), float("nan"))
    torch.testing.assert_close(cutlass_ops.matmul(a, b, residual=nan, beta=0.0), a @ b)
    with pytest.raises(ValueError):
        cutlass_ops.matmul(a, b, activation="tanh")


def test_fast_path_sets_bias_residual_and_scalars(monkeypatch):
    from cutlass_ops.gemms import plan as gemm_api, runtime

    seen = []

    class Kernel:
        def run(self, args, workspace_ptr, workspace_bytes, stream):
            seen.append((args.c, args.d, args.bias, args.alpha, args.beta))

        run_checked = run

    def fake_plan(a, b, c=None, *, alpha, beta, bias, activation, config, out, **_):
        assert activation == "relu"
        args = runtime.GemmArgs(a=a.data_ptr(), b=b.data_ptr(), c=c.data_ptr(),
                                d=out.data_ptr(), alpha=alpha, beta=beta, bias=bias.data_ptr())

        def launch():
            Kernel().run(args, 0, 0, 0)
            return out

        launch.kernel, launch.args, launch.workspace_bytes = Kernel(), args, 0
        return launch

    monkeypatch.setattr(gemm_api, "plan", fake_plan)
    monkeypatch.setattr(dispatch, "_current_stream", lambda index: 0)
    route = dispatch._cutlass_route(dispatch.Decision("exact", Choice(GemmConfig()), "test"),
                                    None, None, "relu")
    for alpha, beta in ((1.0, 1.0), (0.5, 2.0), (2.0, 0.25)):
        a, b, bias, res = torch.randn(16, 32), torch.randn(32, 8), torch.randn(8), \
            torch.randn(16, 8)
        out = route.run(a, b, bias, res, alpha, beta)
        assert seen[-1] == (res.data_ptr(), out.data_ptr(), bias.data_ptr(), alpha, beta)
