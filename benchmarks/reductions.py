"""Issue 6: one-launch gradient clipping and load-balanced ragged reductions against torch.

Clipping rows (operations per second, 1 / time; the reference is torch.nn.utils.clip_grad_norm_
with its default foreach path on CUDA): the 291 gradient shapes of Llama-2-7B in bf16 (13.5 GB)
and 5000 small fp32 tensors (about 41 MB). Both sides get nn.Parameters whose .grad they clip in
place, the same random values, timed interleaved with an L2 flush before each repetition.
max_norm is 0.01, below every norm here, so both sides scale on every repetition (after the
first clip the norm is about max_norm and the coefficient 1 - 1e-6 / max_norm stays below 1).

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

from benchmarks.common import copy_bandwidth_gbs, print_table, write_result  # noqa: E402
from custom_kernels import clip_grad as cg  # noqa: E402
from custom_kernels import ragged  # noqa: E402
from tuning.timing import do_bench_interleaved  # noqa: E402

MAX_NORM = 0.01


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


def clip_row(case: str, shapes, dtype, reps: int) -> dict:
    ours = make_params(shapes, dtype, seed=1)
    theirs = clone_params(ours)
    correct = check_clip(ours, theirs, dtype)
    fns = {"ours": lambda: cg.clip_grad_norm_(ours, MAX_NORM),
           "torch": lambda: torch.nn.utils.clip_grad_norm_(theirs, MAX_NORM)}
    times = do_bench_interleaved(fns, reps=reps)
    before = cg.launches.copy()
    fns["ours"]()
    launches = sum((cg.launches - before).values())
    detail = {"ours_ms": times["ours"].median_ms, "reference_ms": times["torch"].median_ms,
              "launches_ours": launches,
              "gpu_activities_ours": gpu_activities(fns["ours"]),
              "gpu_activities_reference": gpu_activities(fns["torch"]),
              "tensors": len(shapes), "bytes": sum(p.grad.nbytes for p in ours)}
    moved = detail["bytes"] * 3  # one read for the norm, a read and a write to scale
    detail["ours_gbs_3_passes"] = moved / times["ours"].median_ms / 1e6
    detail["reference_gbs_3_passes"] = moved / times["torch"].median_ms / 1e6
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
    reps = 20 if args.quick else 50
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    rows = [clip_row("clip_grad_norm_ llama7b bf16 (291 tensors)", llama7b_shapes(),
                     torch.bfloat16, reps)]
    torch.cuda.empty_cache()  # the 2 x 13.5 GB of gradients are gone
    rows.append(clip_row("clip_grad_norm_ 5000 small fp32", small_shapes(), torch.float32, reps))
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
