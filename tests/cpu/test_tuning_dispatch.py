import logging

import pytest
import torch

import cutlass_ops
from custom_kernels.core import cache_dir, fallback
from cutlass_ops.gemms.config import GemmConfig, GemmOperands, GemmProblem
from cutlass_ops.gemms import dispatch
from cutlass_ops.gemms.choice import Choice
from custom_kernels.core.device import named_spec

OPS = GemmOperands.make("bf16")
H100 = named_spec("H100")
WINNER = Choice(GemmConfig(kernel_schedule="cooperative", tile=(128, 256, 64)))
SMALL = Choice(GemmConfig(tile=(64, 16, 128)), swap_ab=True)


def entry(problem, choice=WINNER, prefer="cutlass"):
    return {"winner": choice.to_dict() if choice else None,
            "winner_ms": 1.0 if choice else None, "torch_ms": 1.1,
            "prefer": prefer, "problem": problem.to_dict()}


def entries_for(*items):
    """Records as dispatch reads them: stored entries parsed by the GEMM schema."""
    from cutlass_ops.gemms.gemm_entries import SCHEMA
    from tuning_fakes import SCOPE

    return {p.name: SCHEMA.parse(p.name, entry(p, *rest), SCOPE) for p, *rest in items}


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
    fallback.logged.clear()
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
    """Records the launch arguments of each run (a copy of the struct)."""

    def __init__(self):
        self.launches = []

    def workspace_bytes(self, args):
        return 0

    def run_checked(self, args, workspace_ptr, workspace_bytes, stream):
        self.launches.append(bytes(args))


@pytest.fixture
def fake_kernel(monkeypatch):
    from cutlass_ops.gemms import loader, plan

    kernel = _FakeKernel()
    monkeypatch.setattr(loader, "kernel_for", lambda operands, config: kernel)
    monkeypatch.setattr(plan, "device_facts", lambda index: (132, 90, "H100"))
    monkeypatch.setattr(dispatch, "_current_stream", lambda index: 0)
    return kernel


def on_gpu0(checked):
    """A problem checked on CPU tensors, as if they were on cuda:0 (the device index is an
    argument of the launch)."""
    import dataclasses

    return dataclasses.replace(checked, device=torch.device("cuda", 0))


def planned_args(a, b, c=None, **kwargs) -> bytes:
    """The launch arguments plan() builds for these tensors (CPU tensors: checks only)."""
    from cutlass_ops.gemms import inputs, plan

    checked = on_gpu0(inputs.check_gemm(a, b, c, **kwargs))
    return bytes(plan._launch_args(checked, GemmConfig(), 132))


@pytest.mark.parametrize("swap", [False, True])
def test_fast_path_launches_what_plan_would(fake_kernel, swap):
    """Every call of a cutlass route (the first one too) launches the route's checked arguments
    with its own pointers: those plan() builds for the call's tensors; swapped, those it builds
    for D^T = B^T A^T written through D's transposed view."""
    from cutlass_ops.gemms import inputs

    def bf16(*shape):
        return torch.randn(*shape).to(torch.bfloat16)

    a, b = bf16(16, 32), bf16(32, 8)
    checked = on_gpu0(inputs.check_product(a, b))
    route = dispatch._cutlass_route(
        dispatch.Decision("exact", Choice(GemmConfig(), swap_ab=swap), "test"), checked, None)
    for _ in range(3):
        a, b = bf16(16, 32), bf16(32, 8)
        out = route.run(a, b)
        assert out.shape == (16, 8) and out.is_contiguous() and out.dtype == torch.bfloat16
        want = (planned_args(b.t(), a.t(), out=out.t()) if swap else
                planned_args(a, b, out=out))
        assert fake_kernel.launches[-1] == want
    assert len(fake_kernel.launches) == 3


def test_fast_path_sets_bias_residual_and_scalars(fake_kernel):
    from cutlass_ops.gemms import inputs

    def bf16(*shape):
        return torch.randn(*shape).to(torch.bfloat16)

    a, b, bias, res = bf16(16, 32), bf16(32, 8), bf16(8), bf16(16, 8)
    checked = on_gpu0(inputs.check_epilogue(inputs.check_product(a, b), c=res, beta=1.0,
                                            bias=bias, activation="relu"))
    assert checked.problem.operands.epilogue.name == "bias_n-relu-res"
    route = dispatch._cutlass_route(dispatch.Decision("exact", Choice(GemmConfig()), "test"),
                                    checked, None, "relu")
    for alpha, beta in ((1.0, 1.0), (0.5, 2.0), (2.0, 0.25)):
        a, b, bias, res = bf16(16, 32), bf16(32, 8), bf16(8), bf16(16, 8)
        out = route.run(a, b, bias, res, alpha, beta)
        assert fake_kernel.launches[-1] == planned_args(
            a, b, res, alpha=alpha, beta=beta, bias=bias, activation="relu", out=out)


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


def test_a_dsl_winner_is_decided_and_needs_the_extra_to_be_ready(monkeypatch):
    from cutlass_ops.gemms import dsl

    config = dsl.DslConfig.from_name("dsl-sm90-pingpong-t128x192-c2x1")
    p = GemmProblem(OPS, 4096, 4096, 4096)
    d = decide(p, entries_for((p, config)))
    assert d.source == "exact" and d.choice == config and d.choice.backend == "dsl"
    near = GemmProblem(OPS, 4000, 4096, 4096)  # any shape: the DSL kernel takes every size
    assert decide(near, entries_for((p, config))).choice == config
    # Ready only with the extra installed (nothing to find in an artifact cache).
    assert not dispatch._ready(config, p, is_built=lambda *a: True)
    monkeypatch.setattr(dsl, "unavailable", lambda: None)
    assert dispatch._ready(config, p, is_built=lambda *a: False)


# --- the whole call (issue 52): the kernel inside CUDA graphs only, where torch's eager call wins

def whole_call_entries(problem, ours_ms, torch_ms):
    from cutlass_ops.gemms.gemm_entries import SCHEMA
    from tuning_fakes import SCOPE

    raw = {**entry(problem), "whole_call_ms": ours_ms, "torch_whole_call_ms": torch_ms}
    return {problem.name: SCHEMA.parse(problem.name, raw, SCOPE)}


def test_a_kernel_whose_eager_call_loses_runs_inside_graphs_only():
    p = GemmProblem(OPS, 16, 4096, 4096)
    d = decide(p, whole_call_entries(p, 0.045, 0.027))
    assert (d.source, d.choice, d.graphs_only) == ("exact", WINNER, True)
    assert "inside CUDA graphs only" in d.reason and "27.0 us against 45.0" in d.reason
    # A nearer shape's record says the same for an untuned M.
    d = decide(GemmProblem(OPS, 32, 4096, 4096), whole_call_entries(p, 0.045, 0.027))
    assert (d.source, d.graphs_only) == ("nearest", True)
    # Where the eager call wins too, or was not timed, the kernel runs everywhere.
    assert not decide(p, whole_call_entries(p, 0.020, 0.027)).graphs_only
    assert not decide(p, entries_for((p,))).graphs_only


def test_a_kernel_whose_eager_call_wins_where_torch_s_kernel_did_runs_eagerly_only():
    """The mirror: torch.matmul's kernel was faster, the winner's whole eager call too (its
    launch costs the host less): the kernel eagerly, torch.matmul inside CUDA graphs."""
    p = GemmProblem(OPS, 128, 4096, 4096)
    raw = {**entry(p, prefer="torch"), "whole_call_ms": 0.031, "torch_whole_call_ms": 0.036}
    from cutlass_ops.gemms.gemm_entries import SCHEMA
    from tuning_fakes import SCOPE

    entries = {p.name: SCHEMA.parse(p.name, raw, SCOPE)}
    d = decide(p, entries)
    assert (d.source, d.choice, d.eager_only, d.graphs_only) == ("exact", WINNER, True, False)
    assert "31.0 us against 36.0" in d.reason and "inside CUDA graphs" in d.reason
    # The winner not built (online off): torch, as before, not a compile on a call.
    unbuilt = dispatch.decide(p, entries, H100, is_built=lambda c: False,
                              built_choices=lambda: [], online="off")
    assert unbuilt.choice is None and not unbuilt.eager_only
    # Nor where the eager call lost too.
    lost = {**raw, "whole_call_ms": 0.040}
    assert decide(p, {p.name: SCHEMA.parse(p.name, lost, SCOPE)}).choice is None
    # A nearer shape's record does not carry it: the host's share is the tuned shape's own.
    near = decide(GemmProblem(OPS, 96, 4096, 4096), entries)
    assert near.choice is None and not near.eager_only


@pytest.mark.parametrize("bad, why", [
    ({"whole_call_ms": 0.02}, "one whole-call time without the other"),
    ({"whole_call_ms": -1.0, "torch_whole_call_ms": 0.02}, "whole_call_ms"),
    ({"whole_call_ms": 0.02, "torch_whole_call_ms": 0.03, "winner": None, "winner_ms": None,
      "prefer": "torch"}, "a whole-call time without a winner"),
])
def test_whole_call_times_are_validated_as_input(bad, why):
    from cutlass_ops.gemms.gemm_entries import SCHEMA
    from custom_kernels.core.tuned_fields import EntryRejected
    from tuning_fakes import SCOPE

    p = GemmProblem(OPS, 16, 4096, 4096)
    with pytest.raises(EntryRejected, match=why):
        SCHEMA.parse(p.name, {**entry(p), **bad}, SCOPE)


@pytest.mark.parametrize("flag, kind, captured, eager", [
    ("graphs_only", "graphs only", "k", "t"), ("eager_only", "eager only", "t", "k")])
def test_a_split_route_runs_one_side_while_capturing_and_the_other_otherwise(
        monkeypatch, flag, kind, captured, eager):
    """Graphs-only: the kernel captured, torch.matmul eagerly; eager-only the mirror. The first
    eager call runs the captured side too (what a capture needs, made outside it)."""
    ran = []
    kernel = dispatch.Decision("exact", WINNER, "")
    torch_route = dispatch.Decision("torch", None, "")
    sides = {"k": dispatch.Route(kernel, lambda *a: ran.append("k")),
             "t": dispatch.Route(torch_route, lambda *a: ran.append("t"))}
    decision = dispatch.Decision("exact", WINNER, "", **{flag: True})
    route = dispatch._split_route(decision, sides[captured], sides[eager], kind)
    for capturing in (False, True, False, True):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda c=capturing: c)
        route.run(1, 2)
    assert ran == [captured, eager, captured, eager, captured] and route.kind == kind
