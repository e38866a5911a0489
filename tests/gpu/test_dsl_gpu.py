"""The CuTe DSL GEMM path on the GPU (skipped without ``cutlass-ops[dsl]``): configs of both
schedules, swapped or not, against a float32 product on random data, for the layouts and dtypes
the path takes, batched, at edge sizes, inside a CUDA graph; misaligned input refused by name."""

import dataclasses
import math

import pytest
import torch

from cutlass_ops.gemms import dsl
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.core.tolerances import GEMM, relative_error, relative_tolerance

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(dsl.unavailable() is not None, reason="no cutlass-ops[dsl]")]

CONFIGS = [dsl.DslConfig.from_name(n) for n in (
    "dsl-sm90-pingpong-t128x192-c2x1", "dsl-sm90-cooperative-t256x128-c1x2",
    "dsl-sm90-pingpong-t128x208-c2x1-swap", "dsl-sm90-cooperative-t128x256-c2x1-swap")]


def random(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def check(out, a, b, dtype):
    reference = a.float() @ b.float()
    assert relative_error(out, reference) <= relative_tolerance(dtype, GEMM)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n, k", [(1000, 4104, 520), (16, 4096, 4096), (4096, 1024, 8)])
def test_nn_linear_layout_against_float32(config, dtype, m, n, k):
    x, w = random(m, k, dtype=dtype, scale=1 / math.sqrt(k)), random(n, k, dtype=dtype)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    assert dsl.plan(config, x, w.t(), out)() is out
    check(out, x, w.t(), dtype)


@pytest.mark.parametrize("config", dsl.SMALL_SEEDS, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, n, k", [(16, 4096, 4096), (100, 1000, 520), (4096, 24, 264),
                                     (1, 128, 64)])
def test_small_configs_against_float32(config, dtype, m, n, k):
    x, w = random(m, k, dtype=dtype, scale=1 / math.sqrt(k)), random(n, k, dtype=dtype)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    dsl.plan(config, x, w.t(), out)()
    check(out, x, w.t(), dtype)


@pytest.mark.parametrize("config", [*CONFIGS[:2], dsl.SMALL_SEEDS[0], dsl.SMALL_SEEDS[3]],
                         ids=lambda c: c.name)
def test_other_majors_batched_float32_out_and_bias(config):
    a = random(3, 256, 512, scale=1 / 16).transpose(-1, -2)  # (L, M, K), M-major
    b = random(3, 256, 384)  # (L, K, N), N-major
    out = torch.empty(3, 512, 384, device="cuda", dtype=torch.float32)
    dsl.plan(config, a, b, out)()
    check(out, a, b, torch.float32)
    x, w, bias = random(300, 256, scale=1 / 16), random(512, 256), random(512)
    y = torch.empty(300, 512, device="cuda", dtype=torch.bfloat16)
    dsl.plan(config, x, w.t(), y, bias=bias)()
    assert relative_error(y, x.float() @ w.float().t() + bias.float()) <= \
        relative_tolerance(torch.bfloat16, GEMM)


@pytest.mark.parametrize("config", [CONFIGS[0], dsl.SMALL_SEEDS[0],
                                    dataclasses.replace(CONFIGS[0], dynamic=True)],
                         ids=lambda c: c.name)
def test_a_launch_replays_in_a_cuda_graph_on_new_data(config):
    """Replayed twice: a dynamic scheduler's tile counter must be zeroed by every replay."""
    x, w = random(512, 1024, scale=1 / 32), random(2048, 1024)
    out = torch.empty(512, 2048, device="cuda", dtype=torch.bfloat16)
    launch = dsl.plan(config, x, w.t(), out)
    launch()  # compile / load before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for _ in range(2):
        x.copy_(random(512, 1024, scale=1 / 32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out, x, w.t(), torch.bfloat16)


@pytest.mark.parametrize("change, words", [
    (lambda x, w, o: (random(64, 129)[:, :128], w.t(), o), "16-byte"),
    (lambda x, w, o: (x, w.t().float(), o), "one dtype"),
    (lambda x, w, o: (x, w[:, :64].t(), o), "do not make a GEMM"),
    (lambda x, w, o: (x, w.t(), o.half()), "out must be"),
])
def test_bad_input_is_refused_by_name(change, words):
    x, w = random(64, 128), random(256, 128)
    out = torch.empty(64, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(UnsupportedInputError, match=words):
        dsl.plan(CONFIGS[0], *change(x, w, out))


def tuned_dsl_winner(tmp_path, monkeypatch):
    """x (512 x 1024), w (2048 x 1024) and the DSL config a private tuning cache names as the
    winner of x @ w^T, dispatch's caches emptied."""
    from cutlass_ops.gemms import dispatch, inputs
    from custom_kernels.core.device import current_scope
    from cutlass_ops.gemms.gemm_entries import gemm_cache

    monkeypatch.setenv("CUTLASS_OPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dispatch, "_routes", {})
    monkeypatch.setattr(dispatch, "_entries_by_scope", {})
    x, w = random(512, 1024, scale=1 / 32), random(2048, 1024)
    problem = inputs.check_product(x, w.t()).problem
    winner = CONFIGS[0]
    gemm_cache(current_scope()).put(problem, {
        "winner": winner.to_dict(), "winner_name": winner.name, "backend": "dsl",
        "winner_ms": 0.01, "torch_ms": 0.011, "prefer": "cutlass", "problem": problem.to_dict()})
    return x, w, winner


def test_dispatch_runs_a_tuned_dsl_winner_and_falls_back_when_it_cannot(tmp_path, monkeypatch):
    """A tuning entry whose winner is a DSL kernel: cutlass_ops.matmul runs it (the dsl route),
    for the tuned shape and a nearby one, and inside a CUDA graph."""
    import cutlass_ops
    from cutlass_ops.gemms import dispatch

    x, w, winner = tuned_dsl_winner(tmp_path, monkeypatch)
    before = dispatch.calls["dsl"]
    y = cutlass_ops.matmul(x, w.t())
    assert cutlass_ops.explain(x, w.t()).choice == winner and dispatch.calls["dsl"] == before + 1
    check(y, x, w.t(), torch.bfloat16)
    x2 = random(500, 1024, scale=1 / 32)  # untuned M: the nearest tuned shape's kernel
    check(cutlass_ops.matmul(x2, w.t()), x2, w.t(), torch.bfloat16)
    assert dispatch.calls["dsl"] == before + 2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cutlass_ops.matmul(x, w.t())
    x.copy_(random(512, 1024, scale=1 / 32))
    graph.replay()
    torch.cuda.synchronize()
    check(captured, x, w.t(), torch.bfloat16)


def test_a_dsl_winner_runs_under_compile_fullgraph_forward_and_backward(tmp_path, monkeypatch):
    """cutlass_ops::linear (the op nn.Linear's replacement calls) compiled with fullgraph, its
    forward dispatching a tuned DSL winner, twice (the second call warm)."""
    import cutlass_ops.ops  # noqa: F401 - registers the cutlass_ops:: ops
    from cutlass_ops.gemms import dispatch

    x, w, _ = tuned_dsl_winner(tmp_path, monkeypatch)
    before = dispatch.calls["dsl"]
    compiled = torch.compile(lambda x, w: torch.ops.cutlass_ops.linear(x, w), fullgraph=True)
    for _ in range(2):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = compiled(xg, wg)
        check(y, x, w.t(), torch.bfloat16)
        y.float().sum().backward()
        ones = torch.ones(512, 2048, device="cuda")
        assert relative_error(xg.grad, ones @ w.float()) < 2e-2
    assert dispatch.calls["dsl"] >= before + 2


def test_one_runner_serves_alternating_signatures_and_data():
    """One runner (dispatch keeps one per route) on two shapes, alternating, each call on new
    data, with and without alpha / bias: every result right."""
    run = dsl.runner(CONFIGS[0])
    for _ in range(3):
        for m in (256, 384):
            x, w = random(m, 512, scale=1 / 16), random(1024, 512)
            bias = random(1024)
            for alpha, b in ((1.0, None), (0.5, bias)):
                out = torch.full((m, 1024), float("nan"), device="cuda", dtype=torch.bfloat16)
                run(x, w.t(), out, b, None, alpha)
                expected = alpha * (x.float() @ w.float().t()) + (
                    b.float() if b is not None else 0)
                assert relative_error(out, expected) <= relative_tolerance(torch.bfloat16, GEMM)


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[2]], ids=lambda c: c.name)
@pytest.mark.parametrize("epilogue", [dict(bias="n"), dict(bias="n", residual=True),
                                      dict(residual=True)])
def test_fused_epilogues_verify_in_the_tuners_session(config, epilogue):
    """The tuner's own session (random operands, alpha 0.75, beta 0.5, the float32 reference in
    our epilogue's order) accepts the DSL kernel for every epilogue dsl.refusal lets through."""
    from cutlass_ops.gemms.config import Epilogue, GemmOperands, GemmProblem
    from tuning.backend import GpuSession

    operands = GemmOperands.make("bf16", epilogue=Epilogue(**epilogue))  # x W^T
    problem = GemmProblem(operands, 300, 1024, 512)
    assert dsl.refusal(problem) is None
    session = GpuSession(problem, torch.cuda.current_device())
    try:
        assert session.verify(config) is None
        assert session.time_ms(config, 5) > 0  # captured in a CUDA graph
    finally:
        session.close()


def test_a_second_process_runs_a_compiled_kernel_without_compiling():
    """The kernel objects persist under our cache root: another process loads the kernel this
    one compiled (no new object file) and gets the right result."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    x, w = random(256, 512, scale=1 / 16), random(1024, 512)
    out = torch.empty(256, 1024, device="cuda", dtype=torch.bfloat16)
    dsl.plan(CONFIGS[1], x, w.t(), out)()
    root = Path(os.environ[dsl.CACHE_ENV])
    before = sorted(str(p) for p in root.rglob("*.o"))
    assert before, f"no compiled kernel under {root}"
    code = (
        "import json, time, torch\n"
        "from cutlass_ops.gemms import dsl\n"
        "x = torch.randn(256, 512, device='cuda').bfloat16() / 16\n"
        "w = torch.randn(1024, 512, device='cuda').bfloat16()\n"
        "out = torch.empty(256, 1024, device='cuda', dtype=torch.bfloat16)\n"
        f"launch = dsl.plan(dsl.DslConfig.from_name({CONFIGS[1].name!r}), x, w.t(), out)\n"
        "start = time.perf_counter(); launch(); torch.cuda.synchronize()\n"
        "first = time.perf_counter() - start\n"
        "error = ((out.float() - x.float() @ w.float().t()).norm()\n"
        "         / (x.float() @ w.float().t()).norm()).item()\n"
        "print(json.dumps({'first_launch_s': first, 'error': error}))\n")
    root_dir = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(root_dir), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, env=env, cwd=root_dir)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["error"] < 1e-2
    assert sorted(str(p) for p in root.rglob("*.o")) == before  # loaded, not compiled
    assert report["first_launch_s"] < 1.0, report  # a compile takes about 2 s
