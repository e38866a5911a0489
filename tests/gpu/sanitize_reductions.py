"""Small cases of every kernel of issue 6 (clip_grad fused, two-kernel fallback, norm-only,
ragged with long and empty segments), for compute-sanitizer. Compile first without the sanitizer
(NVRTC under it is slow), with the same cache directory:

    CUTLASS_OPS_CACHE_DIR=/tmp/cko python tests/gpu/sanitize_reductions.py
    CUTLASS_OPS_CACHE_DIR=/tmp/cko compute-sanitizer --tool memcheck \\
        --error-exitcode 1 python tests/gpu/sanitize_reductions.py
    CUTLASS_OPS_CACHE_DIR=/tmp/cko compute-sanitizer --tool racecheck \\
        --error-exitcode 1 python tests/gpu/sanitize_reductions.py

Prints one line per case and "all cases ran"; exits 1 if a result is wrong.
"""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from custom_kernels import clip_grad as cg  # noqa: E402
from custom_kernels import ragged  # noqa: E402


def grads(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    cases = [(0, torch.float32), (1, torch.bfloat16), (1000, torch.float16),
             (33333, torch.float32), (20001, torch.bfloat16), (7, torch.float32)]
    for i, (n, dtype) in enumerate(cases):
        base = torch.randn(n + 1, device="cuda", generator=gen).to(dtype)
        out.append(base[1:] if i % 2 else base[:n].clone())  # unaligned starts too
    return out


def clip_case(name, norm_type, **kwargs):
    g = grads(1)
    ref_norm, ref = cg.reference_clip_grad_norm(g, 1.0, norm_type)
    norm = cg.clip_grad_norm_(g, 1.0, norm_type, **kwargs)
    ok = abs(float(norm) - float(ref_norm)) <= 1e-5 * float(ref_norm) and all(
        torch.allclose(a.double(), r, rtol=2e-2, atol=1e-5) for a, r in zip(g, ref))
    print(f"{name}: {'ok' if ok else 'WRONG'}", flush=True)
    return ok


def ragged_case(name, lengths, d, dtype):
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    offsets = torch.tensor(bounds, device="cuda")
    values = torch.randn(bounds[-1], d, device="cuda").to(dtype)
    out = ragged.segment_sum(values, offsets)
    ref = ragged.reference_segment_sum(values, offsets)
    ok = torch.allclose(out.double(), ref, rtol=2e-2, atol=0.5)
    print(f"{name}: {'ok' if ok else 'WRONG'}", flush=True)
    return ok


def main() -> int:
    results = [
        clip_case("clip fused, norm 2", 2.0),
        clip_case("clip fused, norm inf", math.inf),
        clip_case("clip two kernels", 2.0, cooperative=False),
        clip_case("clip error_if_nonfinite (norm only, then scale)", 2.0, error_if_nonfinite=True),
        ragged_case("ragged bf16, long + empty segments", [0, 3, 5000, 0, 17, 1, 900], 256,
                    torch.bfloat16),
        ragged_case("ragged fp32, scalar path", [2, 0, 700, 9], 7, torch.float32),
    ]
    torch.cuda.synchronize()
    print("all cases ran", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
