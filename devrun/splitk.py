"""Split-K as a batched GEMM for the small-M shapes (issue 3): K cut into s slices that the kernel
sees as a batch of s GEMMs (strides over K), fp32 partials, then a reduction. Tests whether more
CTAs on the weight (swap-A/B's 64-row tiles use 64 of 132 SMs at N=4096) beat one kernel."""
import json
import sys

import torch

from cutlass_ops import gemm_api
from cutlass_ops.config import GemmConfig, GemmOperands
from cutlass_ops.kernels import prepare_many
from tuning.choice import Choice
from tuning.timing import do_bench_interleaved

SHAPES = [(m, n, k) for m in (16, 128) for n, k in ((4096, 4096), (14336, 4096), (4096, 14336))]
SPLITS = (1, 2, 4, 8)
CHOICES = [Choice(GemmConfig(kernel_schedule=s, tile=t, cluster=c), swap) for s, t, c, swap in (
    ("pingpong", (64, 16, 128), (1, 1, 1), True),
    ("pingpong", (64, 16, 128), (4, 1, 1), True),
    ("pingpong", (64, 32, 128), (1, 1, 1), True),
    ("pingpong", (64, 16, 64), (1, 1, 1), True),
    ("pingpong", (64, 64, 64), (1, 1, 1), True),
    ("pingpong", (64, 64, 64), (1, 1, 1), False),
    ("pingpong", (64, 128, 64), (1, 1, 1), True),
    ("cooperative", (128, 128, 64), (1, 1, 1), True),
    ("cooperative", (128, 64, 64), (1, 1, 1), True),
)]
BF16 = GemmOperands.make("bf16")
F32_OUT = GemmOperands.make("bf16", out_dtype="f32")


def items():
    return [(c.operands_for(ops), c.config) for c in CHOICES for ops in (BF16, F32_OUT)]


def split_launch(choice, x, w, s):
    """(launch, result) for y = x @ w.T with K in s slices; s = 1 is the plain bf16 kernel."""
    m, k = x.shape
    n = w.shape[0]
    ks = k // s
    if s == 1:
        if choice.swap_ab:
            y = torch.empty((m, n), dtype=x.dtype, device=x.device)
            launch = gemm_api.plan(w, x.t(), out=y.t(), config=choice.config)
        else:
            y = torch.empty((m, n), dtype=x.dtype, device=x.device)
            launch = gemm_api.plan(x, w.t(), out=y, config=choice.config)
        return launch, lambda: y
    if choice.swap_ab:  # D^T (N x M) per slice, column-major, so each partial is (M, N) row-major
        a = w.as_strided((s, n, ks), (ks, k, 1))
        b = x.as_strided((s, ks, m), (ks, 1, k))
        part = torch.empty_strided((s, n, m), (n * m, 1, n), dtype=torch.float32, device=x.device)
        gemm = gemm_api.plan(a, b, out=part, config=choice.config)
        view = part.transpose(1, 2)
    else:
        a = x.as_strided((s, m, ks), (ks, k, 1))
        b = w.as_strided((s, ks, n), (ks, 1, k))
        part = torch.empty((s, m, n), dtype=torch.float32, device=x.device)
        gemm = gemm_api.plan(a, b, out=part, config=choice.config)
        view = part
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)

    def launch():
        gemm()
        torch.sum(view, 0, dtype=torch.bfloat16, out=y)
    return (gemm, launch), lambda: y


def main():
    built = prepare_many(items(), jobs=16)
    failed = {f"{k[0].name}/{k[1].name}": str(v)[:200] for k, v in built.items() if isinstance(v, Exception)}
    print("build failures:", failed, flush=True)
    report = {"failed": failed, "shapes": {}}
    for m, n, k in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        ref = (x.float() @ w.float().t())
        y_t = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        fns, errs = {"torch": lambda: torch.matmul(x, w.t(), out=y_t)}, {}
        for c in CHOICES:
            for s in SPLITS:
                if k % (s * c.config.tile[2]):
                    continue
                name = f"{c.name}|s{s}"
                try:
                    launch, result = split_launch(c, x, w, s)
                except Exception as e:  # noqa: BLE001
                    errs[name] = str(e)[:200]
                    continue
                if s == 1:
                    launch()
                    fns[name] = launch
                else:
                    launch[1]()
                    fns[name] = launch[1]
                    fns[name + "|gemm-only"] = launch[0]
                torch.cuda.synchronize()
                err = (result().float() - ref).abs().max().item()
                if err > 0.05:
                    errs[name] = f"max error {err}"
                    fns.pop(name, None)
                    fns.pop(name + "|gemm-only", None)
        t = do_bench_interleaved(fns, reps=60)
        res = sorted(((key, round(v.median_ms * 1e3, 2)) for key, v in t.items()), key=lambda kv: kv[1])
        tu = dict(res)["torch"]
        print(f"== {m}x{n}x{k}: torch {tu} us; errors {errs}", flush=True)
        for key, us in res[:22]:
            print(f"   {us:8.2f}  x{tu / us:.3f}  {key}")
        report["shapes"][f"{m}x{n}x{k}"] = {"us": res, "errors": errs}
    json.dump(report, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
