"""Issue 6: one-launch gradient clipping and load-balanced ragged reductions against torch.

Clipping rows (operations per second, 1 / time; the reference is torch.nn.utils.clip_grad_norm_
with its default foreach path on CUDA): the 291 gradient shapes of Llama-2-7B in bf16 (13.5 GB)
and 5000 small fp32 tensors (about 41 MB). Both sides get nn.Parameters whose .grad they clip in
place, the same random values, timed interleaved with an L2 flush before each repetition.
Every timed call must scale: a fixed max_norm does not do that, since after the first clip the
gradients' norm sits at max_norm - 1e-6 or (bf16 rounding) just below, the coefficient rounds to
1.0 and our kernel skips the multiplication by 1 that torch still does. So each side's closure
(ShrinkingClip) clips to SHRINK (0.9) times the norm its gradients have at that call, tracked on
the host without a sync (after a clip to m the norm is m, up to the dtype's rounding, which does
not accumulate); the coefficient is about 0.9 on every call for both sides, so both do the norm
read and the scaling read and write every time. Before timing, both sides' gradients are scaled
by one power of two (exact) so that the norm stays above NORM_FLOOR (far above torch's 1e-6 and
from fp32 underflow of x^2) over every call the row makes; after timing, each side's actual norm
is compared with the tracked one (detail "norm_actual_over_tracked": about 1 when every call
scaled; far above 1 if calls skipped the scaling). The detail also gives GB/s counting 3 passes
(norm read, scale read + write) and ours as a fraction of the copy bandwidth.

Launches: ours from custom_kernels.clip_grad.launches (one call); for both sides also the GPU
activities (kernels, memsets, memcpys) that torch.profiler records for one call (CUPTI sees the
driver-API launches of ours too), in the row's detail.

Ragged rows (GB/s counting one read of the values and one write of the output): per-segment sums
of a packed bf16 [rows, 256] tensor whose 2048 segment lengths are log-normal (median 40 rows,
some empty, the longest 8192), against one torch.sum launch per segment (offsets given as Python
ints, outside the timed region) and against padding to the longest segment (zeros [S, longest,
D], scatter, sum; the scatter indices are computed outside the timed region); a uniform-length
case beside it. torch.segment_reduce goes in the detail.

    python benchmarks/reductions.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import (copy_bandwidth_gbs, print_table, require_gpu,  # noqa: E402
                               write_result)
from custom_kernels import clip_grad as cg  # noqa: E402
from custom_kernels import ragged  # noqa: E402
from tuning.timing import do_bench_interleaved  # noqa: E402

MAX_NORM = 0.01  # the correctness check's clip (below every norm here)
SHRINK = 0.9      # each timed call clips to this fraction of the gradients' current norm
NORM_FLOOR = 1.0  # the tracked norm stays above this over all the calls of a row
WARMUP = 3        # do_bench_interleaved's warm-up calls per side


def llama7b_shapes() -> list[tuple[int, ...]]:
    """The 291 parameter shapes of Llama-2-7B."""
    hidden, inter, vocab, layers = 4096, 11008, 32000, 32
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden, hidden)] * 4 + [(inter, hidden)] * 2 + [(hidden, inter)]
        shapes += [(hidden,)] * 2
    shapes += [(hidden,), (vocab, hidden)]
    assert len(shapes) == 291
    return shapes


def small_shapes(count: int = 5000, seed: int = 0) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(seed)
    return [(int(n),) for n in torch.randint(1, 4096, (count,), generator=gen)]


def make_params(shapes, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    params = []
    for shape in shapes:
        params.append(_param(torch.randn(shape, device="cuda", dtype=dtype, generator=gen)))
    return params


def _param(grad):
    """A Parameter holding ``grad``; its own data is one element expanded to the shape (only
    .grad is read), so the 7B case needs memory for the gradients alone."""
    p = torch.nn.Parameter(torch.empty((), device="cuda", dtype=grad.dtype).expand(grad.shape))
    p.grad = grad
    return p


def clone_params(params):
    return [_param(p.grad.clone()) for p in params]


def gpu_activities(fn) -> int | None:
    """Kernels, memsets and memcpys torch.profiler records on the GPU for one call of fn."""
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception as exc:  # the profiler is a detail: never lose the row for it
        print(f"  (profiler unavailable: {exc})", flush=True)
        return None


def check_clip(ours, theirs, dtype) -> bool:
    """One clip on identical inputs; norms and clipped gradients must agree."""
    n1 = cg.clip_grad_norm_(ours, MAX_NORM)
    n2 = torch.nn.utils.clip_grad_norm_(theirs, MAX_NORM)
    rtol = 1e-5 if dtype == torch.float32 else 1e-2
    ok = math.isclose(float(n1), float(n2), rel_tol=rtol)
    tol = {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-6}
    return ok and all(torch.allclose(a.grad.float(), b.grad.float(), **tol)
                      for a, b in zip(ours, theirs))


def grad_norm(params) -> float:
    """The 2-norm of the parameters' gradients, accumulated in fp32 (host sync; untimed)."""
    norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in params]
    return float(torch.linalg.vector_norm(torch.stack(norms)))


class ShrinkingClip:
    """``clip(params, max_norm)`` with max_norm SHRINK times the norm the gradients have when the
    call runs, so that the clip coefficient is about SHRINK (never 1) on every call. The norm is
    tracked on the host: a clip to max_norm m (coefficient m / (norm + 1e-6) < 1) leaves the norm
    at m, up to the rounding of the scaled values and of the coefficient, and the next call is
    relative to m again, so these errors do not accumulate."""

    def __init__(self, clip, params, norm: float):
        self.clip, self.params, self.norm, self.calls = clip, params, norm, 0

    def __call__(self):
        self.norm *= SHRINK
        self.calls += 1
        return self.clip(self.params, self.norm)


def arm(sides, calls: int) -> None:
    """Scales every side's gradients by one power of two (exact in every dtype, the same for all
    sides) so that SHRINK ** calls times the smallest norm stays above NORM_FLOOR."""
    need = NORM_FLOOR / SHRINK ** calls
    low = min(grad_norm(params) for params in sides)
    if low < need:
        factor = 2.0 ** math.ceil(math.log2(need / low))
        for params in sides:
            torch._foreach_mul_([p.grad for p in params], factor)


def clip_row(case: str, shapes, dtype, reps: int, copy_gbs: float) -> dict:
    ours = make_params(shapes, dtype, seed=1)
    theirs = clone_params(ours)
    correct = check_clip(ours, theirs, dtype)
    # Calls per side: warm-up, repetitions, the launch count (ours) and the profiler (each).
    calls = WARMUP + reps + 2
    arm((ours, theirs), calls)
    fns = {"ours": ShrinkingClip(cg.clip_grad_norm_, ours, grad_norm(ours)),
           "torch": ShrinkingClip(torch.nn.utils.clip_grad_norm_, theirs, grad_norm(theirs))}
    times = do_bench_interleaved(fns, warmup=WARMUP, reps=reps)
    before = cg.launches.copy()
    fns["ours"]()
    launches = sum((cg.launches - before).values())
    detail = {"ours_ms": times["ours"].median_ms, "reference_ms": times["torch"].median_ms,
              "launches_ours": launches,
              "gpu_activities_ours": gpu_activities(fns["ours"]),
              "gpu_activities_reference": gpu_activities(fns["torch"]),
              "tensors": len(shapes), "bytes": sum(p.grad.nbytes for p in ours),
              "clip_coefficient_per_call": SHRINK, "calls_per_side": fns["ours"].calls}
    # Every call scaled on both sides iff each side's norm followed the tracked one.
    detail["norm_actual_over_tracked"] = {key: grad_norm(fn.params) / fn.norm
                                          for key, fn in fns.items()}
    moved = detail["bytes"] * 3  # one read for the norm, a read and a write to scale
    detail["ours_gbs_3_passes"] = moved / times["ours"].median_ms / 1e6
    detail["reference_gbs_3_passes"] = moved / times["torch"].median_ms / 1e6
    detail["ours_fraction_of_copy_bandwidth"] = detail["ours_gbs_3_passes"] / copy_gbs
    notes = []
    if any(not 0.97 < r < 1.03 for r in detail["norm_actual_over_tracked"].values()):
        notes.append("a side's norm left the tracked one: some timed calls did not scale")
    if detail["ours_gbs_3_passes"] > copy_gbs:
        l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
        notes.append(f"3 passes at more than the copy bandwidth ({copy_gbs:.0f} GB/s): "
                     + ("the gradients fit in L2, so the scale pass may read them from there"
                        if detail["bytes"] <= l2 else
                        "larger than L2, so some of the work was not done: a bug"))
    if notes:
        detail["note"] = "; ".join(notes)
        print(f"  note ({case}): {detail['note']}", flush=True)
    return row(case, "ops/s", 1e3 / times["ours"].median_ms, 1e3 / times["torch"].median_ms,
               "torch.nn.utils.clip_grad_norm_ (foreach)", correct, detail)


def row(case, unit, ours, reference, reference_name, correct, detail) -> dict:
    return {"case": case, "unit": unit, "ours": ours, "reference": reference,
            "reference_name": reference_name, "ratio": ours / reference, "correct": correct,
            "detail": detail}


def skewed_lengths(segments: int, longest: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lengths = (torch.randn(segments, generator=gen) * 1.5 + math.log(40)).exp().long()
    lengths = lengths.clamp(max=longest)
    lengths[torch.randperm(segments, generator=gen)[:segments // 50]] = 0
    lengths[segments // 3] = longest
    return lengths.tolist()


def ragged_rows(case: str, lengths: list[int], d: int, reps: int, copy_gbs: float) -> list[dict]:
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    offsets = torch.tensor(bounds, device="cuda", dtype=torch.int32)
    values = torch.randn(bounds[-1], d, device="cuda", dtype=torch.bfloat16)
    segments = len(lengths)
    segment, position, longest = ragged.padding_index(offsets, values.shape[0])
    fns = {
        "ours": lambda: ragged.segment_sum(values, offsets),
        "loop": lambda: ragged.segment_sum_loop(values, bounds),
        "padded": lambda: ragged.segment_sum_padded(values, segment, position, longest, segments),
    }
    try:
        torch.segment_reduce(values, "sum", offsets=offsets, axis=0)
        fns["segment_reduce"] = lambda: torch.segment_reduce(values, "sum", offsets=offsets,
                                                             axis=0)
    except RuntimeError as exc:
        print(f"  (torch.segment_reduce unavailable here: {exc})", flush=True)
    ref = ragged.reference_segment_sum(values, offsets)
    correct = bool(torch.allclose(fns["ours"]().double(), ref, rtol=2e-2, atol=0.1))
    times = do_bench_interleaved(fns, reps=reps)
    nbytes = values.nbytes + segments * d * values.element_size()
    gbs = {k: nbytes / t.median_ms / 1e6 for k, t in times.items()}
    common = {"ours_ms": times["ours"].median_ms, "segments": segments, "rows": values.shape[0],
              "d": d, "longest": longest, "launches_ours": 1,
              "fraction_of_copy_bandwidth": gbs["ours"] / copy_gbs,
              "torch.segment_reduce_gbs": gbs.get("segment_reduce")}
    names = {"loop": "one torch.sum launch per segment", "padded": "pad to the longest + sum"}
    return [row(f"{case} vs {key}", "GB/s", gbs["ours"], gbs[key], names[key], correct,
                {**common, "reference_ms": times[key].median_ms})
            for key in ("loop", "padded")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions; writes "
                        "reductions_quick.json")
    args = parser.parse_args()
    require_gpu()
    reps = 20 if args.quick else 50
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    rows = [clip_row("clip_grad_norm_ llama7b bf16 (291 tensors)", llama7b_shapes(),
                     torch.bfloat16, reps, copy_gbs)]
    torch.cuda.empty_cache()  # the 2 x 13.5 GB of gradients are gone
    rows.append(clip_row("clip_grad_norm_ 5000 small fp32", small_shapes(), torch.float32, reps,
                         copy_gbs))
    rows += ragged_rows("segment_sum skewed bf16 D=256", skewed_lengths(2048, 8192), 256, reps,
                        copy_gbs)
    rows += ragged_rows("segment_sum uniform bf16 D=256", [120] * 2048, 256, reps, copy_gbs)
    print_table(["case", "unit", "ours", "reference", "ratio", "ok", "launches"],
                [[r["case"], r["unit"], f"{r['ours']:.1f}", f"{r['reference']:.1f}",
                  f"{r['ratio']:.2f}", r["correct"], r["detail"].get("launches_ours")]
                 for r in rows])
    path = write_result("reductions_quick" if args.quick else "reductions", rows,
                        copy_bandwidth_gbs=copy_gbs)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
