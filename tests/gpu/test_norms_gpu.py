"""Fused norms on the GPU (marker gpu): forward and backward against a float32 torch reference for
each dtype, with and without residual, at the issue's hidden sizes and row counts; the scalar path
(odd hidden, misaligned pointers, strided rows); opcheck; torch.compile(fullgraph=True); CUDA graph
replay; the modules.

The candidates of a quick tune are each checked too (the tuner rejects a wrong one; here none may
be wrong), and the eager path (kernels launched directly) must equal the custom ops bit for bit.

All kernels are compiled once, in parallel, by the session fixture (a few hundred NVRTC compiles);
set CUTLASS_OPS_TEST_CACHE_DIR to keep them between runs.
"""

import itertools
import os

import pytest
import torch

from custom_kernels.norms import modules
from custom_kernels.norms import norm_ops as norms
from custom_kernels.norms import norm_config as nc

pytestmark = pytest.mark.gpu

HIDDEN = [256, 1000, 4096, 8192, 32768, 65536, 262144]
ROWS = [1, 7, 4096, 32768]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# Relative Frobenius error against the float32 reference.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
CHUNK = 1 << 25  # reference elements per chunk


def _rows_for(hidden, rows):
    return 8192 if hidden == 262144 and rows == 32768 else rows


@pytest.fixture(scope="session", autouse=True)
def compiled():
    problems = []
    for kind, direction, hidden, dtype, aligned, residual in itertools.product(
            nc.KINDS, nc.DIRECTIONS, HIDDEN + [4097, 4096], DTYPES, (True, False),
            (True, False)):
        name = NAMES[dtype]
        aligned = aligned and hidden % (16 // dtype.itemsize) == 0
        problems.append(nc.NormProblem(kind, direction, hidden, name, name, name, aligned,
                                       residual))
    problems += [nc.NormProblem(k, d, 4096, "bfloat16", "float32", "float32", True, r)
                 for k in nc.KINDS for d in nc.DIRECTIONS for r in (True, False)]
    norms.precompile(problems, workers=min(16, os.cpu_count() or 4))


def _rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _fits(rows, hidden, dtype, residual):
    """Skip what does not fit: inputs, outputs and gradients, the float32 reference's y, h and
    dx (held as chunk lists, then concatenated: 24 bytes an element at the peak) plus a float32
    chunk."""
    tensors = 8 if residual else 6
    need = rows * hidden * (tensors * dtype.itemsize + 24) + 16 * CHUNK * 4
    free, _ = torch.cuda.mem_get_info()
    return need < 0.85 * free


def _reference(kind, x, w, b, res, dy, dres, eps):
    """float32 forward and backward, chunk by chunk of rows; dW/dB summed over chunks."""
    hidden = x.shape[-1]
    step = max(1, CHUNK // hidden)
    ys, hs, dxs = [], [], []
    dw = torch.zeros(hidden, device=x.device)
    db = torch.zeros(hidden, device=x.device)
    for start in range(0, x.shape[0], step):
        sl = slice(start, start + step)
        # Fresh leaves every chunk: for float32 inputs ``.float()`` returns the tensor itself,
        # so without ``detach()`` the same ``w`` would collect ``.grad`` over the chunks and
        # ``dw += wf.grad`` would add running sums (chunk k counted n - k + 1 times).
        xf = x[sl].detach().float().requires_grad_()
        rf = res[sl].detach().float().requires_grad_() if res is not None else None
        wf = w.detach().float().requires_grad_()
        bf = b.detach().float().requires_grad_() if b is not None else None
        h = xf + rf if rf is not None else xf
        if kind == "rms":
            y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * wf
        else:
            y = torch.nn.functional.layer_norm(h, (hidden,), wf, bf, eps)
        loss = (y * dy[sl].float()).sum()
        if rf is not None:
            loss = loss + (h * dres[sl].float()).sum()
        loss.backward()
        ys.append(y.detach())
        hs.append(h.detach())
        dxs.append(xf.grad)
        dw += wf.grad
        if bf is not None:
            db += bf.grad
    return torch.cat(ys), torch.cat(hs), torch.cat(dxs), dw, db


def _run(kind, x, w, b, res, eps, out_dtype=None):
    if kind == "rms":
        return norms.rms_norm(x, w, eps, residual=res, out_dtype=out_dtype)
    return norms.layer_norm(x, w, b, eps, residual=res, out_dtype=out_dtype)


def _inputs(rows, hidden, dtype, residual, kind, weight_dtype=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    wd = weight_dtype or dtype

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).to(dt)

    x = randn(rows, hidden)
    w = (1 + 0.5 * randn(hidden, dt=torch.float32)).to(wd)
    b = randn(hidden, dt=wd) if kind == "ln" else None
    res = randn(rows, hidden) if residual else None
    return x, w, b, res, randn


def check(kind, rows, hidden, dtype, residual, *, x=None, res=None, out_dtype=None,
          weight_dtype=None):
    x0, w, b, res0, randn = _inputs(rows, hidden, dtype, residual, kind, weight_dtype)
    x = x0 if x is None else x
    res = res0 if res is None and residual else res
    if x is not x0:
        x.copy_(x0)
    if res is not None and res is not res0:
        res.copy_(res0)
    eps = 1e-6 if kind == "rms" else 1e-5
    xg = x.requires_grad_()
    rg = res.requires_grad_() if res is not None else None
    wg = w.clone().requires_grad_()
    bg = b.clone().requires_grad_() if b is not None else None
    out = _run(kind, xg, wg, bg, rg, eps, out_dtype)
    y, h = out if residual else (out, None)
    assert y.dtype == (out_dtype or dtype) and y.shape == x.shape
    dy = randn(rows, hidden, dt=y.dtype)
    dres = randn(rows, hidden) if residual else None
    torch.autograd.backward([y, h] if residual else [y], [dy, dres] if residual else [dy])
    ry, rh, rdx, rdw, rdb = _reference(kind, x.detach(), w, b, res.detach() if residual else None,
                                       dy, dres, eps)
    tol = TOL[dtype] if out_dtype is None else max(TOL[dtype], TOL[out_dtype])
    errs = {"y": _rel_err(y, ry), "dx": _rel_err(xg.grad, rdx), "dw": _rel_err(wg.grad, rdw)}
    if residual:
        errs["h"] = _rel_err(h, rh)
        errs["dres"] = _rel_err(rg.grad, rdx)
    if kind == "ln":
        errs["db"] = _rel_err(bg.grad, rdb)
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"relative errors above {tol}: {bad}"


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("kind", nc.KINDS)
def test_matches_float32_reference(kind, hidden, rows, dtype, residual):
    rows = _rows_for(hidden, rows)
    if not _fits(rows, hidden, dtype, residual):
        pytest.skip(f"{rows}x{hidden} {dtype} does not fit in free GPU memory")
    check(kind, rows, hidden, dtype, residual)
    torch.cuda.empty_cache()


@pytest.mark.parametrize("kind", nc.KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
@pytest.mark.parametrize("rows", [1, 7, 4096])
def test_odd_hidden_takes_the_scalar_path(kind, dtype, rows):
    check(kind, rows, 4097, dtype, residual=True)


@pytest.mark.parametrize("kind", nc.KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=NAMES.get)
def test_misaligned_and_strided_inputs(kind, dtype):
    rows, hidden = 333, 4096
    big = torch.empty(rows, hidden + 1, dtype=dtype, device="cuda")
    x = big[:, 1:]  # pointer off by one element, row stride hidden + 1
    assert x.data_ptr() % 16 and x.stride() == (hidden + 1, 1)
    resbig = torch.empty(rows * hidden + 3, dtype=dtype, device="cuda")
    res = resbig[3:].view(rows, hidden)
    check(kind, rows, hidden, dtype, residual=True, x=x, res=res)
    wide = torch.empty(rows, 2 * hidden, dtype=dtype, device="cuda")
    check(kind, rows, hidden, dtype, residual=False, x=wide[:, :hidden])  # aligned row stride


# (config, hidden sizes it holds): 8 or 16 lanes a row, and several rows per thread (p2, p4),
# with rows that end inside a warp's last vector (264 = 33 vectors).
SHORT_ROW_SPLITS = [("t64_r4_c1_v8", (256, 768)), ("t128_r16_c1_v8", (256, 768)),
                    ("t256_r32_c1_v8", (256, 768)), ("t64_r2_c1_v8_p4", (256, 264)),
                    ("t128_r8_c1_v8_p2", (256, 264)), ("t64_r2_c1_v1_p2", (256, 264))]


@pytest.mark.parametrize("rows", [1, 5, 33, 4099])
@pytest.mark.parametrize("config,hiddens", SHORT_ROW_SPLITS, ids=[c for c, _ in SHORT_ROW_SPLITS])
@pytest.mark.parametrize("kind", nc.KINDS)
def test_several_rows_per_warp_or_thread_forward(kind, config, hiddens, rows):
    # Row counts that end inside a warp and inside a block: the rows past the end keep the
    # warp's shuffles full and must store nothing (the residual output included).
    for hidden in hiddens:
        _check_forward_split(kind, config, rows, hidden)


def _check_forward_split(kind, config, rows, hidden, weight_dtype=None):
    """bf16 forward with a residual through ``config``: the residual output exact, y against the
    float32 reference, and the unfused call on h equal to the fused one."""
    x, w, b, res, _ = _inputs(rows, hidden, torch.bfloat16, True, kind, weight_dtype)
    args = (w,) if kind == "rms" else (w, b)
    fn = norms.rms_norm if kind == "rms" else norms.layer_norm
    ref = norms.rms_norm_reference if kind == "rms" else norms.layer_norm_reference
    y, h = fn(x, *args, residual=res, config=config)
    ry, rh = ref(x, *args, residual=res)
    assert torch.equal(h, rh)
    assert _rel_err(y, ry) <= TOL[torch.bfloat16]
    y_plain = fn(h, *args, config=config)
    assert torch.equal(y_plain, y)  # the residual path normalizes exactly what it returns


# (config, hidden sizes): the persistent forward with the parameters in shared memory, copied
# once per block and reused by every row it walks (rows beyond one wave), rows that end inside
# a thread's last iteration (4104 = 513 vectors), clusters, and an fp32 weight (32-byte vectors).
PARAM_SMEM_SPLITS = [("t256_r1_c1_v8_s2_m", (4096, 4104, 32768)),
                     ("t1024_r1_c1_v8_s2_m", (32768,)), ("t256_r1_c2_v8_s3_m", (8200,)),
                     ("t512_r1_c8_v8_s2_m", (65536,))]


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=["bf16w", "fp32w"])
@pytest.mark.parametrize("rows", [1, 7, 1000])
@pytest.mark.parametrize("config,hiddens", PARAM_SMEM_SPLITS,
                         ids=[c for c, _ in PARAM_SMEM_SPLITS])
@pytest.mark.parametrize("kind", nc.KINDS)
def test_parameters_in_shared_memory_forward(kind, config, hiddens, rows, weight_dtype):
    for hidden in hiddens:
        p = nc.NormProblem(kind, "fwd", hidden, "bfloat16", "bfloat16",
                           str(weight_dtype).removeprefix("torch."), residual=True)
        if nc.NormConfig.from_name(config).why_invalid(p):
            continue  # RMSNorm's weight fits registers there: nothing to put in shared memory
        _check_forward_split(kind, config, rows, hidden, weight_dtype)


@pytest.mark.parametrize("kind", nc.KINDS)
def test_float32_weight_and_output_with_bf16_input(kind):
    check(kind, 257, 4096, torch.bfloat16, True, out_dtype=torch.float32,
          weight_dtype=torch.float32)


def test_three_dimensional_input_and_zero_rows():
    x = torch.randn(3, 5, 1000, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(1000, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(norms.rms_norm(x, w), norms.rms_norm_reference(x, w),
                               atol=2e-2, rtol=2e-2)
    empty = torch.empty(0, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = norms.rms_norm(empty, w.requires_grad_())
    y.sum().backward()
    assert y.shape == (0, 1000) and w.grad.abs().sum() == 0


@pytest.mark.parametrize("hidden", [1000, 32768])
@pytest.mark.parametrize("residual", [False, True])
def test_opcheck(hidden, residual):
    x = torch.randn(9, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(hidden, device="cuda", dtype=torch.float32, requires_grad=True)
    b = torch.randn(hidden, device="cuda", dtype=torch.float32, requires_grad=True)
    res = torch.randn_like(x, requires_grad=True) if residual else None
    ops = torch.ops.custom_kernels
    torch.library.opcheck(ops.rms_norm_fwd.default, (x, w, res, 1e-6, torch.bfloat16, None))
    torch.library.opcheck(ops.layer_norm_fwd.default,
                          (x, w, b, res, 1e-5, torch.float32, None))
    _, h, rstd = ops.rms_norm_fwd(x, w, res, 1e-6, torch.bfloat16, None)
    h = h if residual else x
    dy = torch.randn_like(x)
    dres = torch.randn_like(x) if residual else None
    # The backward ops have no autograd of their own (no double backward): detached inputs.
    torch.library.opcheck(ops.rms_norm_bwd.default,
                          (dy, h.detach(), w.detach(), rstd.detach(), dres, None))
    _, _, mean, rstd = ops.layer_norm_fwd(x, w, b, res, 1e-5, torch.bfloat16, None)
    torch.library.opcheck(ops.layer_norm_bwd.default,
                          (dy, h.detach(), w.detach(), mean.detach(), rstd.detach(), dres,
                           None))


def test_torch_compile_fullgraph_forward_and_backward():
    def block(x, res, w1, w2, b2):
        y, h = norms.rms_norm(x, w1, residual=res)
        z = norms.layer_norm(y * 2, w2, b2)
        return (z.float() ** 2).sum() + h.float().sum()

    compiled = torch.compile(block, fullgraph=True)
    args = [torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True),
            torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True),
            torch.rand(4096, device="cuda", requires_grad=True),
            torch.rand(4096, device="cuda", requires_grad=True),
            torch.randn(4096, device="cuda", requires_grad=True)]
    out = compiled(*args)
    out.backward()
    grads = [a.grad.clone() for a in args]
    for a in args:
        a.grad = None
    block(*args).backward()
    for ours, eager in zip(grads, [a.grad for a in args]):
        torch.testing.assert_close(ours, eager, atol=1e-2, rtol=1e-2)


def test_cuda_graph_replay():
    x = torch.randn(512, 8192, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.rand(8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up (compile, load) outside the capture
            norms.rms_norm(x, w, residual=res)
            norms.layer_norm(x, w, b)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, h = norms.rms_norm(x, w, residual=res)
        z = norms.layer_norm(x, w, b)
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(torch.randn_like(x))
        res.copy_(torch.randn_like(res))
        graph.replay()
        ry, rh = norms.rms_norm_reference(x, w, 1e-6, residual=res)
        torch.testing.assert_close(h, rh)
        torch.testing.assert_close(y, ry, atol=3e-2, rtol=2e-2)
        torch.testing.assert_close(z, norms.layer_norm_reference(x, w, b), atol=3e-2,
                                   rtol=2e-2)


def test_modules_state_dict_round_trip_and_output():
    ref = torch.nn.RMSNorm(4096, eps=1e-6, device="cuda", dtype=torch.bfloat16)
    ref_ln = torch.nn.LayerNorm(4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref_ln.bias.normal_()
    ours = modules.RMSNorm(4096, eps=1e-6, device="cuda", dtype=torch.bfloat16)
    ours.load_state_dict(ref.state_dict())
    ours_ln = modules.LayerNorm.from_module(ref_ln)
    ref_ln.load_state_dict(ours_ln.state_dict())
    x = torch.randn(128, 4096, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(ours(x), ref(x), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(ours_ln(x), ref_ln(x), atol=3e-2, rtol=2e-2)
    res = torch.randn_like(x)
    y, h = ours(x, res)
    torch.testing.assert_close(y, ref(h), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(h, x + res)


@pytest.mark.parametrize("kind", nc.KINDS)
@pytest.mark.parametrize("residual", [False, True])
def test_eager_path_equals_the_custom_ops(kind, residual):
    x = torch.randn(300, 8192, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x) if residual else None
    ops = torch.ops.custom_kernels
    if kind == "rms":
        eager = norms.rms_norm(x, w, 1e-6, residual=res)
        op = ops.rms_norm_fwd(x, w, res, 1e-6, x.dtype, None)
    else:
        eager = norms.layer_norm(x, w, b, 1e-5, residual=res)
        op = ops.layer_norm_fwd(x, w, b, res, 1e-5, x.dtype, None)
    eager = eager if residual else (eager,)
    for ours, theirs in zip(eager, op):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("problem", [
    nc.NormProblem("rms", "fwd", 1000, "bfloat16", "bfloat16", "bfloat16"),
    nc.NormProblem("ln", "fwd", 65536, "float16", "float16", "float32", residual=True),
    nc.NormProblem("rms", "bwd", 8192, "bfloat16", "bfloat16", "bfloat16", residual=True),
    nc.NormProblem("ln", "bwd", 32768, "float32", "float32", "float32"),
    nc.NormProblem("rms", "fwd", 4097, "bfloat16", "bfloat16", "bfloat16", aligned=False),
], ids=lambda p: p.name)
def test_quick_tune_checks_every_candidate_and_caches_the_winner(problem, tmp_path,
                                                                 monkeypatch):
    from tuning import norm_search

    monkeypatch.setenv("CUTLASS_OPS_CACHE_DIR", str(tmp_path))
    entry = norm_search.tune_problem(problem, strategy="quick", rows=2048, reps=5)
    assert entry["failures"] == {}, entry["failures"]
    assert nc.NormConfig.from_name(entry["winner"]).why_invalid(problem) is None
    assert entry["winner_ms"] <= entry["heuristic_ms"] * 1.10 + 1e-3
    norm_search.norm_cache().put(problem, entry)
    assert norm_search.tuned_config(problem).name == entry["winner"]
    assert norms._tuned(problem, torch.cuda.current_device()) == \
        nc.NormConfig.from_name(entry["winner"])


@pytest.mark.parametrize("case, match", [
    ("non_contiguous", "non-contiguous last dimension"),
    ("weight_shape", "weight has shape"),
    ("mixed_weight", "mixed dtypes: weight"),
    ("weight_on_cpu", "different devices"),
    ("hidden_too_large", "outside the supported"),
    ("strided_weight", "weight must be contiguous"),
])
def test_bad_cuda_input_is_refused_after_a_good_call(case, match):
    """norms.refusal remembers its verdict per input signature: after good calls, inputs that
    differ from them only in what one rule reads must still be refused, naming the problem."""
    from custom_kernels.core.errors import UnsupportedInputError

    x, w = torch.randn(8, 64, device="cuda"), torch.randn(64, device="cuda")
    norms.rms_norm(x, w)
    norms.layer_norm(x, w, torch.zeros_like(w))
    if case == "non_contiguous":
        x = torch.randn(64, 8, device="cuda").t()
    elif case == "weight_shape":
        w = torch.randn(63, device="cuda")
    elif case == "mixed_weight":
        w = w.half()
    elif case == "weight_on_cpu":
        w = w.cpu()
    elif case == "hidden_too_large":
        x, w = torch.empty(1, 262145, device="cuda"), torch.empty(262145, device="cuda")
    elif case == "strided_weight":
        w = torch.randn(128, device="cuda")[::2]
    with pytest.raises(UnsupportedInputError, match=match):
        norms.rms_norm(x, w)
    with pytest.raises(UnsupportedInputError, match=match):
        norms.layer_norm(x, w, torch.zeros_like(w))


@pytest.mark.parametrize("kind", ["rms", "ln"])
def test_the_fast_accept_takes_only_what_the_rules_take(kind):
    """norms._usual_call skips the memo for the usual call: it must never accept an input that
    why_unsupported refuses."""
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    variants = {"usual": (x, w, w.clone()), "transposed x": (x.t().contiguous().t(), w, w),
                "half weight": (x, w.half(), w.half()), "cpu weight": (x, w.cpu(), w.cpu()),
                "short weight": (x, w[:63], w[:63]), "strided weight": (x, w.repeat(2)[::2], w),
                "float64": (x.double(), w.double(), w.double()), "bias of other dtype": (x, w, w.float())}
    accepted = []
    for name, (xv, wv, bv) in variants.items():
        bias = bv if kind == "ln" else None
        if norms._usual_call(kind, xv, wv, bias, None, None):
            accepted.append(name)
            assert norms.why_unsupported(kind, xv, wv, bias, None, None) is None, name
    assert "usual" in accepted
