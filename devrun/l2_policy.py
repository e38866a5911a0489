"""Does the L2 flush's dirty data cost skinny GEMMs their speed, and does an L2 streaming policy on
the weight avoid it?

BENCHMARKS.md flushes the L2 by writing a buffer twice its size, so each timed call starts with
an L2 full of dirty lines. A skinny GEMM streams its weight once; every line it brings in evicts
a dirty one, which HBM must take back: the 32 MB weight of 16x4096x4096 moves about 64 MB. This
times torch.matmul and the tuned CUTLASS winners (gemm_tuned.json) of the small-M shapes under:

- dirty:  the protocol (``flush.zero_()``);
- clean:  the same write, then a read of another buffer twice the L2 (the write-back happens
          before the timed call; L2 holds clean lines);
- stream: dirty, with the stream's access policy window over the weight marked Streaming
          (hit and miss), so its lines are evicted first and the dirty ones stay.

Interleaved repetition by repetition. Prints a table; writes $OUT/l2_policy.json.

H200 at 6575466 (us, torch / ours): 16x4096x4096 dirty 18.9 / 17.2, clean 15.8 / 14.8, stream
18.8 / 17.2; 16x14336x4096 40.8 / 40.3, 33.9 / 32.9, 40.5 / 40.3; 128x14336x4096 42.0 / 42.7,
34.4 / 34.5, 41.7 / 42.8; 1024x4096x4096 47.8 / 48.9, 46.7 / 48.2, 47.5 / 48.7. The write-back
costs both libraries alike (up to 8 us); the streaming window changes nothing, for either.
"""
import json
import math
import os
import statistics
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root)]

import torch  # noqa: E402
from cuda.bindings import runtime as rt  # noqa: E402

from benchmarks.common import print_table, versions  # noqa: E402
from cutlass_ops.config import GemmOperands, GemmProblem  # noqa: E402
from cutlass_ops.kernels import prepare_many  # noqa: E402
from tuning.backend import GpuSession  # noqa: E402
from tuning.choice import Choice  # noqa: E402

REPS = int(os.environ.get("REPS", 60))
WINNERS = {tuple(int(v.split("=")[1]) for v in r["case"].split()[1:]): r["detail"]["config"]
           for r in json.load(open(root / "benchmarks/results/gemm_tuned.json"))["rows"]}
SHAPES = [(16, 4096, 4096), (16, 14336, 4096), (16, 4096, 14336), (128, 4096, 4096),
          (128, 14336, 4096), (128, 4096, 14336), (1024, 4096, 4096)]


def set_window(stream, tensor, prop):
    value = rt.cudaStreamAttrValue()
    window = value.accessPolicyWindow
    if tensor is None:
        window.base_ptr, window.num_bytes = 0, 0
    else:
        window.base_ptr = tensor.data_ptr()
        window.num_bytes = tensor.numel() * tensor.element_size()
    window.hitRatio = 1.0
    window.hitProp = prop
    window.missProp = prop
    value.accessPolicyWindow = window
    err, = rt.cudaStreamSetAttribute(stream.cuda_stream, rt.cudaStreamAttributeAccessPolicyWindow,
                                     value)
    assert err == rt.cudaError_t.cudaSuccess, err


def time_all(fns, before):
    """{key: median ms}: every fn once per repetition in rotating order, ``before()`` ahead of
    each call outside the timed region."""
    keys = list(fns)
    for key in keys:
        fns[key]()
    torch.cuda.synchronize()
    events = {key: [] for key in keys}
    for rep in range(REPS):
        shift = rep % len(keys)
        for key in keys[shift:] + keys[:shift]:
            before()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[key]()
            end.record()
            events[key].append((start, end))
    torch.cuda.synchronize()
    return {key: statistics.median(s.elapsed_time(e) for s, e in pairs)
            for key, pairs in events.items()}


def main():
    ops = GemmOperands.make("bf16")
    choices = {shape: Choice.from_name(WINNERS[shape]) for shape in SHAPES}
    built = prepare_many([(c.operands_for(ops), c.config) for c in choices.values()],
                         jobs=os.cpu_count())
    for key, result in built.items():
        if isinstance(result, Exception):
            print("build failed", key[1].name, str(result)[:300])
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    flush = torch.empty(2 * l2 // 4, dtype=torch.int32, device="cuda")
    reader = torch.ones(2 * l2 // 4, dtype=torch.int32, device="cuda")
    max_window = rt.cudaDeviceGetAttribute(rt.cudaDeviceAttr.cudaDevAttrMaxAccessPolicyWindowSize,
                                           0)[1]
    print(f"L2 {l2 >> 20} MiB, max access policy window {max_window >> 20} MiB", flush=True)
    stream = torch.cuda.Stream()
    rows, out = [], []
    with torch.cuda.stream(stream):
        for shape in SHAPES:
            m, n, k = shape
            problem = GemmProblem(ops, m, n, k)
            session = GpuSession(problem, 0)
            choice = choices[shape]
            error = session.verify(choice)
            fns = {"torch": session._torch_call(), "ours": session._launcher(choice)}
            weight = session.b  # K x N column-major: the N x K weight, read once at small M
            result = {}
            result["dirty"] = time_all(fns, flush.zero_)
            result["clean"] = time_all(fns, lambda: (flush.zero_(), reader.max()))
            set_window(stream, weight, rt.cudaAccessProperty.cudaAccessPropertyStreaming)
            result["stream"] = time_all(fns, flush.zero_)
            stream_error = session.verify(choice)
            set_window(stream, None, rt.cudaAccessProperty.cudaAccessPropertyNormal)
            wbytes = n * k * 2
            for cond, t in result.items():
                rows.append([f"{m}x{n}x{k}", cond, round(t["torch"] * 1e3, 1),
                             round(t["ours"] * 1e3, 1), round(t["torch"] / t["ours"], 3),
                             round(wbytes / t["ours"] / 1e6)])
            out.append({"shape": shape, "config": choice.name, "verify": error,
                        "verify_stream": stream_error, "ms": result})
            print(rows[-3:], flush=True)
            session.close()
    print_table(["shape", "L2 state", "torch us", "ours us", "ours/torch speed",
                 "weight GB/s (ours)"], rows)
    Path(os.environ.get("OUT", "/tmp"), "l2_policy.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "versions": versions(), "results": out}, indent=1))


if __name__ == "__main__":
    main()
