"""Host cost of a warm eager call of the public entry points against the torch calls they
replace, at shapes where the host bounds the rate: calls per second over back-to-back calls.

Rows: ``cutlass_ops.nn.Linear`` and the ``cutlass_ops::linear`` custom op at 16x4096x4096
against torch.nn.Linear / F.linear; Hugging Face's LlamaRMSNorm and a whole LlamaDecoderLayer at a
decode step (batch 16, one token each) against what ``convert`` makes of them (our RMSNorm, the
fused block); ``cutlass_ops.matmul`` at 16x256x256 on a CUTLASS kernel (built on first use in
a private, empty cache: online mode "compile", about a minute) against torch.matmul, and the
same call on a CuTe DSL winner (with ``cutlass-ops[dsl]``); the fused norms at 16x4096 bf16,
the functions (``custom_kernels.norms.rms_norm`` / ``layer_norm``, with and without a residual)
and the modules (``cutlass_ops.nn.RMSNorm`` / ``LayerNorm``, inference and with grad enabled)
against torch's functional calls and modules. Ours and torch alternate in
batches of back-to-back calls; each figure is the median batch. Every row checks ours against
torch on the same inputs. Writes benchmarks/results/host_cost.json.

    python benchmarks/host_cost.py [--batches 9] [--calls 1000]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import cutlass_ops  # noqa: E402
import cutlass_ops.nn  # noqa: E402
from benchmarks.common import (print_table, private_cache_with_online_compile,  # noqa: E402
                               require_gpu, write_result)
from custom_kernels import host_ops, norms  # noqa: E402
from custom_kernels.norms import norm_ops  # noqa: E402
from cutlass_ops import ops  # noqa: E402
from cutlass_ops.gemms import dispatch  # noqa: E402
from custom_kernels.core.tolerances import relative_error  # noqa: E402


def us_per_call(fn, calls: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


@contextlib.contextmanager
def python_path():
    """Our Python path alone: the compiled host path switched off for the block (the flags its
    entry points read first), to time the path before it."""
    lazy = (norm_ops.HOST_NORM, dispatch.HOST_GEMM, ops.HOST_LINEAR)
    saved = [op.off for op in lazy]
    for op in lazy:
        op.off = True
    try:
        yield
    finally:
        for op, value in zip(lazy, saved):
            op.off = value


def row(case: str, ours, theirs, reference_name: str, batches: int, calls: int,
        grad: bool = False, **detail) -> dict:
    with torch.set_grad_enabled(grad):
        error = relative_error(first(ours()), first(theirs()))
        us_per_call(ours, 100), us_per_call(theirs, 100)  # warm: plans, routes, allocator
        mine, ref = [], []
        for _ in range(batches):
            mine.append(us_per_call(ours, calls))
            ref.append(us_per_call(theirs, calls))
        with python_path():  # the same call before the compiled host path, for the record
            us_per_call(ours, 100)
            python_us = statistics.median(us_per_call(ours, calls) for _ in range(batches))
    detail["python_path_us"] = round(python_us, 2)
    detail["host_path"] = "compiled" if host_ops.ops() is not None else \
        f"python ({host_ops.why_not() or 'not built'})"
    ours_us, ref_us = statistics.median(mine), statistics.median(ref)
    ours_cps, ref_cps = round(1e6 / ours_us), round(1e6 / ref_us)
    return {"case": case, "unit": "calls/s", "ours": ours_cps, "reference": ref_cps,
            "reference_name": reference_name, "ratio": round(ours_cps / ref_cps, 4),
            "correct": error < 2e-2,
            "detail": {"ours_us": round(ours_us, 2), "reference_us": round(ref_us, 2),
                       "relative_error": round(error, 5), **detail}}


def first(out):
    return out[0] if isinstance(out, tuple) else out


def matmul_rows(batches: int, calls: int) -> list[dict]:
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    wt = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16).t()
    with private_cache_with_online_compile(), torch.no_grad():
        decision = cutlass_ops.explain(x, wt)
        return [row("matmul bf16 16x256x256", lambda: cutlass_ops.matmul(x, wt),
                    lambda: torch.matmul(x, wt), "torch.matmul", batches, calls,
                    dispatch=decision.source,
                    kernel=decision.choice.name if decision.choice else "torch.matmul")]


def dsl_matmul_rows(batches: int, calls: int) -> list[dict]:
    """``cutlass_ops.matmul`` dispatching a CuTe DSL winner (``cutlass_ops.gemms.dsl``, with the
    extra installed; none without it): the tuned entry is written to a private cache, as a tune
    would leave it."""
    from cutlass_ops.gemms import dispatch, dsl, inputs
    from custom_kernels.core.device import current_scope
    from cutlass_ops.gemms.gemm_entries import gemm_cache

    if dsl.unavailable():
        return []
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    wt = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16).t()
    problem = inputs.check_product(x, wt).problem
    winner = dsl.DslConfig.from_name("dsl-sm90-pingpong-t128x128-c2x1-swap")
    with private_cache_with_online_compile(), torch.no_grad():
        gemm_cache(current_scope()).put(problem, {
            "winner": winner.to_dict(), "winner_name": winner.name, "backend": "dsl",
            "winner_ms": 0.01, "torch_ms": 0.01, "prefer": "cutlass",
            "problem": problem.to_dict()})
        dispatch._entries_by_scope.clear()
        dispatch._routes.clear()
        decision = cutlass_ops.explain(x, wt)
        return [row("matmul bf16 16x256x256 DSL kernel", lambda: cutlass_ops.matmul(x, wt),
                    lambda: torch.matmul(x, wt), "torch.matmul", batches, calls,
                    dispatch=decision.source, kernel=decision.choice.name
                    if decision.choice else "torch.matmul")]


def norm_rows(batches: int, calls: int) -> list[dict]:
    hidden, kw = 4096, {"device": "cuda", "dtype": torch.bfloat16}
    x, r = torch.randn(16, hidden, **kw), torch.randn(16, hidden, **kw)
    w, b = 1 + 0.1 * torch.randn(hidden, **kw), torch.randn(hidden, **kw)
    shape = (hidden,)
    calls_of = [
        ("rms_norm function bf16 16x4096", lambda: norms.rms_norm(x, w, 1e-6),
         lambda: F.rms_norm(x, shape, w, 1e-6), "F.rms_norm"),
        ("rms_norm function with residual bf16 16x4096",
         lambda: norms.rms_norm(x, w, 1e-6, residual=r),
         lambda: F.rms_norm(x + r, shape, w, 1e-6), "x + r, F.rms_norm"),
        ("layer_norm function bf16 16x4096", lambda: norms.layer_norm(x, w, b, 1e-5),
         lambda: F.layer_norm(x, shape, w, b, 1e-5), "F.layer_norm"),
    ]
    rows = [row(case, ours, theirs, name, batches, calls) for case, ours, theirs, name in calls_of]
    for name, ours_cls, torch_cls in (("RMSNorm", cutlass_ops.nn.RMSNorm, torch.nn.RMSNorm),
                                      ("LayerNorm", cutlass_ops.nn.LayerNorm,
                                       torch.nn.LayerNorm)):
        ours, theirs = ours_cls(hidden, eps=1e-6, **kw), torch_cls(hidden, eps=1e-6, **kw)
        with torch.no_grad():
            for module in (ours, theirs):
                module.weight.copy_(w)
        for grad in (False, True):
            rows.append(row(f"{name} module bf16 16x4096{' grad enabled' if grad else ''}",
                            lambda: ours(x), lambda: theirs(x), f"torch.nn.{name}", batches,
                            calls, grad=grad))
    return rows


def linear_rows(batches: int, calls: int) -> list[dict]:
    """Our Linear (module and custom op) against torch's at a decode shape, 16x4096 -> 4096."""
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    x = torch.randn(16, 4096, **kw)
    theirs = torch.nn.Linear(4096, 4096, bias=False, **kw)
    ours = cutlass_ops.nn.Linear.from_linear(theirs)
    rows = [row("linear custom op bf16 16x4096x4096",
                lambda: torch.ops.cutlass_ops.linear(x, theirs.weight),
                lambda: F.linear(x, theirs.weight), "F.linear", batches, calls)]
    for grad in (False, True):
        rows.append(row(f"Linear module bf16 16x4096x4096{' grad enabled' if grad else ''}",
                        lambda: ours(x), lambda: theirs(x), "torch.nn.Linear", batches, calls,
                        grad=grad))
    return rows


def hugging_face_rows(batches: int, calls: int) -> list[dict]:
    """What convert() replaces in a Hugging Face Llama: its RMSNorm module (eight torch ops) and
    a whole decoder layer at a decode step (one token per sequence, batch 16, no cache)."""
    import copy

    import transformers

    from cutlass_ops import decoder_blocks, norm_probe

    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336,
                                      num_attention_heads=32, num_key_value_heads=8,
                                      num_hidden_layers=1, vocab_size=1024)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    theirs_layer = model.model.layers[0]
    ours_layer = copy.deepcopy(theirs_layer)
    cutlass_ops.convert(ours_layer, fuse_blocks=False)
    assert decoder_blocks.fuse(ours_layer) is None
    norm = theirs_layer.input_layernorm
    ours_norm = norm_probe.drop_in(norm)
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    x = torch.randn(16, 1, 4096, **kw)
    positions = torch.zeros(16, 1, dtype=torch.long, device="cuda")
    cos, sin = model.model.rotary_emb(x, positions)
    args = dict(attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
    rows = []
    for grad in (False, True):
        suffix = " grad enabled" if grad else ""
        rows.append(row(f"HF LlamaRMSNorm module bf16 16x4096{suffix}", lambda: ours_norm(x),
                        lambda: norm(x), "LlamaRMSNorm", batches, calls, grad=grad))
        rows.append(row(f"HF LlamaDecoderLayer decode step bf16 batch 16{suffix}",
                        lambda: ours_layer(x, **args), lambda: theirs_layer(x, **args),
                        "LlamaDecoderLayer", batches, max(calls // 10, 10), grad=grad))
    return rows


SECTIONS = {"norms": norm_rows, "linear": linear_rows, "hf": hugging_face_rows,
            "matmul": matmul_rows, "dsl": dsl_matmul_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=9, help="alternating batches per row")
    parser.add_argument("--calls", type=int, default=1000, help="back-to-back calls per batch")
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS),
                        help="these rows only, written to host_cost_<names>.json")
    args = parser.parse_args()
    require_gpu()
    host_ops.ops(wait=True)  # built (about half a minute) or found in the cache before timing
    chosen = args.only or list(SECTIONS)
    rows = [r for name in chosen for r in SECTIONS[name](args.batches, args.calls)]
    print_table(["case", "ours us", "torch us", "ratio (calls/s)", "correct"],
                [[r["case"], r["detail"]["ours_us"], r["detail"]["reference_us"], r["ratio"],
                  r["correct"]] for r in rows])
    name = "host_cost" if not args.only else "host_cost_" + "_".join(args.only)
    print(f"wrote {write_result(name, rows)}")


if __name__ == "__main__":
    main()
