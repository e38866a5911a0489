"""The LM head and its loss, forward and backward: ``cutlass_ops.linear_cross_entropy`` against
eager ``F.linear`` + ``F.cross_entropy`` on the float32 logits (Hugging Face's loss), bf16.

Rows (BENCHMARKS.md schema; ours over eager): loss + backward at tokens x hidden x vocab, as
operations per second, and peak memory above the inputs as 1/GB (so ``ratio`` = eager's GB over
ours); torch.compile of the eager loss and Liger-Kernel's fused linear cross-entropy (when
installed) in ``detail``. The loss and both gradients are checked against eager's on the same
inputs. Writes benchmarks/results/cross_entropy.json (cross_entropy_quick.json with --quick).

    python benchmarks/cross_entropy.py [--quick] [--tokens 4096] [--hidden 4096] [--vocab 128256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import print_table, require_gpu, write_result  # noqa: E402
from custom_kernels.core.tolerances import relative_error  # noqa: E402
from tuning.timing import do_bench  # noqa: E402


def eager_loss(hidden, weight, labels):
    return F.cross_entropy(F.linear(hidden, weight).float(), labels)


def ours_loss(hidden, weight, labels):
    import cutlass_ops

    return cutlass_ops.linear_cross_entropy(hidden, weight, labels)


def liger_loss():
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        return None
    return lambda hidden, weight, labels: liger_fused_linear_cross_entropy(hidden, weight,
                                                                            labels)


def step(loss_fn, hidden, weight, labels):
    def run():
        hidden.grad = weight.grad = None
        loss = loss_fn(hidden, weight, labels)
        loss.backward()
        return loss
    return run


def measure(loss_fn, hidden, weight, labels, reps):
    run = step(loss_fn, hidden, weight, labels)
    loss = run().detach()
    grads = (hidden.grad.detach().clone(), weight.grad.detach().clone())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    peak_gb = (torch.cuda.max_memory_allocated() - base) / 1e9
    ms = do_bench(run, warmup=1, reps=reps).median_ms
    return {"ms": ms, "peak_gb": peak_gb, "loss": loss, "grads": grads}


def row(case, unit, ours, reference, reference_name, correct, **detail) -> dict:
    ours, reference = round(ours, 4), round(reference, 4)
    return {"case": case, "unit": unit, "ours": ours, "reference": reference,
            "reference_name": reference_name, "ratio": round(ours / reference, 4),
            "correct": correct, "detail": detail}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1024 tokens, vocabulary 32000")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions per figure")
    args = parser.parse_args()
    require_gpu()
    if args.quick:
        args.tokens, args.vocab = 1024, 32000
    g = torch.Generator("cuda").manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, device="cuda", generator=g,
                         dtype=torch.bfloat16).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, device="cuda", generator=g) /
              args.hidden ** 0.5).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=g)
    labels[::7] = -100
    eager = measure(eager_loss, hidden, weight, labels, args.reps)
    ours = measure(ours_loss, hidden, weight, labels, args.reps)
    detail = {"compile_ms": round(measure(torch.compile(eager_loss), hidden, weight, labels,
                                          args.reps)["ms"], 3)}
    liger = liger_loss()
    if liger is not None:
        result = measure(liger, hidden, weight, labels, args.reps)
        detail.update(liger_ms=round(result["ms"], 3), liger_peak_gb=round(result["peak_gb"], 3))
    loss_error = abs(ours["loss"].item() - eager["loss"].item()) / abs(eager["loss"].item())
    grad_errors = [relative_error(a, b) for a, b in zip(ours["grads"], eager["grads"])]
    correct = loss_error <= 1e-2 and max(grad_errors) <= 2e-2
    shape = f"{args.tokens}x{args.hidden}x{args.vocab}"
    reference_name = "F.linear + F.cross_entropy (eager)"
    rows = [
        row(f"loss+backward bf16 {shape}", "1/s", 1e3 / ours["ms"], 1e3 / eager["ms"],
            reference_name, correct, ours_ms=round(ours["ms"], 3),
            reference_ms=round(eager["ms"], 3), loss_error=round(loss_error, 6),
            grad_errors=[round(e, 5) for e in grad_errors], **detail),
        row(f"peak memory loss+backward bf16 {shape}", "1/GB", 1 / ours["peak_gb"],
            1 / eager["peak_gb"], reference_name, correct, ours_gb=round(ours["peak_gb"], 3),
            reference_gb=round(eager["peak_gb"], 3)),
    ]
    print_table(["case", "ours", "reference", "ratio", "correct"],
                [[r["case"], r["ours"], r["reference"], r["ratio"], r["correct"]] for r in rows])
    print(f"wrote {write_result('cross_entropy_quick' if args.quick else 'cross_entropy', rows)}")


if __name__ == "__main__":
    main()
