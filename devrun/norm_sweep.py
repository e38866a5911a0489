"""GPU diagnostic: every norm config (bf16 RMSNorm, fwd and bwd) at each benchmark hidden size,
timed with the GPU queue pre-filled (torch.cuda._sleep) so launch overhead is not counted, plus
forced-register-cache variants, plus the host cost per call of each layer of our path.

    python devrun/norm_sweep.py [--hidden 32768 ...] [--dirs fwd bwd] [--json out.json]
"""

import argparse
import concurrent.futures
import json
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from custom_kernels import jit, norms  # noqa: E402
from custom_kernels import norm_config as nc  # noqa: E402
from tuning.timing import _flush_buffer  # noqa: E402

EPS = 1e-6
HIDDEN = [256, 1000, 4096, 8192, 32768, 65536, 262144]


def rows_for(h):
    return 8192 if h >= 262144 else 32768


EXTRA = {}
_orig_defines = nc.NormConfig.defines


def _defines(self, problem):
    d = _orig_defines(self, problem)
    return {**d, **EXTRA} if self.stages else d


nc.NormConfig.defines = _defines


def variants(problem, stages=(1, 2, 3, 4)):
    """(config, extra defines) pairs: the staged space, the stores-evict-first variants of the
    1- and 2-stage ones, and the old direct heuristic."""
    out = []
    for cfg in nc.space(problem):
        if cfg.vec != problem.vec or cfg.stages not in stages:
            continue
        out.append((cfg, {}))
        if cfg.stages in (1, 2):
            out.append((cfg, {"NORM_STORE_CS": 1}))
    out.append((nc._direct_heuristic(problem), {}))
    return out


def compile_all(problems_configs):
    global EXTRA
    ctx = multiprocessing.get_context("spawn")
    jobs = set()
    for p, c, extra in problems_configs:
        EXTRA = extra
        jobs |= {(src, name, tuple(sorted(d.items()))) for src, name, d in norms.kernel_specs(p, c)}
    EXTRA = {}
    with concurrent.futures.ProcessPoolExecutor(16, mp_context=ctx) as pool:
        futs = {pool.submit(jit.compile_cubin, src, defines=dict(d), name_expressions=(n,),
                            arch="sm_90a"): (n, d) for src, n, d in jobs}
        for f, key in futs.items():
            try:
                f.result()
            except Exception as exc:
                print("compile failed", key, exc, file=sys.stderr)
    return len(jobs)


def bench(fn, reps=25, pad_cycles=200_000):
    flush = _flush_buffer(0)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    ev = []
    for _ in range(reps):
        flush.zero_()
        torch.cuda._sleep(pad_cycles)  # the host runs ahead of the GPU: no launch gap timed
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        ev.append((s, e))
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(e) for s, e in ev)
    return ts[len(ts) // 2]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def sweep(hidden, dirs, copy_gbs, results):
    global EXTRA
    rows = rows_for(hidden)
    torch.manual_seed(0)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    dy = torch.randn_like(x)
    xf = x.float()
    rstd_ref = torch.rsqrt(xf.pow(2).mean(-1) + EPS)
    y_ref = (xf * rstd_ref[:, None] * w.float())
    for d in dirs:
        problem = nc.NormProblem("rms", d, hidden, "bfloat16", "bfloat16", "bfloat16")
        heur = nc.heuristic(problem).name
        nbytes = (2 if d == "fwd" else 3) * rows * hidden * 2
        line = []
        # references (a fresh function per case: dynamo would reuse and recompile one lambda)
        def rms(a, b):
            return F.rms_norm(a, (hidden,), b, EPS)
        comp = torch.compile(rms, dynamic=False)
        if d == "fwd":
            ref_fns = {"torch.compile": lambda: comp(x, w), "eager": lambda: F.rms_norm(
                x, (hidden,), w, EPS), "ours_api": lambda: norms.rms_norm(x, w, EPS)}
        else:
            ref_fns = {}
            for name, f in (("torch.compile", comp), ("eager", lambda a, b: F.rms_norm(
                    a, (hidden,), b, EPS)), ("ours_api", lambda a, b: norms.rms_norm(a, b, EPS))):
                xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
                yy = f(xg, wg)
                ref_fns[name] = (lambda yy=yy, xg=xg, wg=wg: torch.autograd.grad(
                    yy, (xg, wg), dy, retain_graph=True))
        for name, f in ref_fns.items():
            t = bench(f)
            line.append((name, t, nbytes / t / 1e6))
        if d == "bwd":
            xg = xf.detach().requires_grad_()
            wg = w.float().detach().requires_grad_()
            yy = xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + EPS) * wg
            dx_ref, dw_ref = torch.autograd.grad(yy, (xg, wg), dy.float())
        rstd_c = rstd_ref.contiguous()
        EXTRA = {}
        norms._fwd_plan.cache_clear()
        norms._bwd_plan.cache_clear()
        for cfg, extra in variants(problem):
            EXTRA = extra
            norms._fwd_plan.cache_clear()
            norms._bwd_plan.cache_clear()
            vname = cfg.name
            label = vname + ("_cs" if extra else "")
            try:
                if d == "fwd":
                    run = (lambda c=vname: norms._fwd_impl("rms", x, w, None, None, EPS,
                                                          x.dtype, c))
                    y = run()[0]
                    torch.cuda.synchronize()
                    err = rel(y, y_ref)
                    plan = norms._fwd_plan("rms", hidden, "bfloat16", "bfloat16", "bfloat16",
                                           True, False, vname, 0)
                else:
                    run = (lambda c=vname: norms._bwd_impl("rms", dy, x, w, None, rstd_c, None,
                                                          c))
                    dx, dw, _ = run()
                    torch.cuda.synchronize()
                    err = max(rel(dx, dx_ref), rel(dw, dw_ref))
                    plan = norms._bwd_plan("rms", hidden, "bfloat16", "bfloat16", "bfloat16",
                                           True, False, vname, 0)
                t = bench(run)
            except Exception as exc:
                print(f"  {d} {hidden} {label} failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            k = plan.kernel
            regs = k.attributes.num_regs
            regs = regs() if callable(regs) else regs
            line.append((label + ("*" if label == heur else ""), t, nbytes / t / 1e6,
                         f"err={err:.1e} regs={regs} smem={plan.shared_mem // 1024}K "
                         f"blocks={plan.blocks(rows)}"))
        line.sort(key=lambda r: r[1])
        print(f"== {d} hidden={hidden} rows={rows} heuristic={heur} copy={copy_gbs:.0f}")
        for r in line[:16]:
            print(f"   {r[0]:28s} {r[1]*1e3:9.1f} us {r[2]:7.0f} GB/s {r[2]/copy_gbs:5.2f}  "
                  + (r[3] if len(r) > 3 else ""))
        hr = [r for r in line if r[0].endswith("*")]
        if hr:
            print(f"   heuristic: {hr[0][0]} {hr[0][2]:.0f} GB/s {hr[0][2]/copy_gbs:.2f}  {hr[0][3]}")
        results.append({"dir": d, "hidden": hidden, "rows": [list(map(str, r)) for r in line]})
        sys.stdout.flush()


def host_costs():
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(256, device="cuda", dtype=torch.bfloat16)
    comp = torch.compile(lambda a, b: F.rms_norm(a, (256,), b, EPS), dynamic=False)
    fns = {
        "_fwd_impl": lambda: norms._fwd_impl("rms", x, w, None, None, EPS, x.dtype, None),
        "torch.ops op": lambda: torch.ops.custom_kernels.rms_norm_fwd(x, w, None, EPS, x.dtype,
                                                                        None),
        "norms.rms_norm": lambda: norms.rms_norm(x, w, EPS),
        "F.rms_norm eager": lambda: F.rms_norm(x, (256,), w, EPS),
        "torch.compile": lambda: comp(x, w),
        "empty_like": lambda: torch.empty_like(x),
    }
    xg = x.detach().requires_grad_()
    fns["norms.rms_norm grad-enabled"] = lambda: norms.rms_norm(xg, w, EPS)
    for name, f in fns.items():
        for _ in range(50):
            f()
        torch.cuda.synchronize()
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"host {name:30s} {(t1 - t0) / n * 1e6:7.1f} us/call")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, nargs="*", default=HIDDEN)
    ap.add_argument("--dirs", nargs="*", default=["fwd", "bwd"])
    ap.add_argument("--json")
    ap.add_argument("--no-host", action="store_true")
    args = ap.parse_args()
    jobs = []
    for h in args.hidden:
        for d in args.dirs:
            p = nc.NormProblem("rms", d, h, "bfloat16", "bfloat16", "bfloat16")
            jobs += [(p, c, e) for c, e in variants(p)]
    t0 = time.time()
    n = compile_all(jobs)
    print(f"compiled {n} kernels in {time.time() - t0:.0f} s", flush=True)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src), reps=10)
    copy_gbs = 2 * src.numel() / copy_ms / 1e6
    del src, dst
    if not args.no_host:
        host_costs()
    results = []
    for h in args.hidden:
        sweep(h, args.dirs, copy_gbs, results)
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_gbs": copy_gbs, "results": results}))


if __name__ == "__main__":
    main()
