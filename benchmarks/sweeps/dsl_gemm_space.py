"""QuACK's sm90 GEMM kernels beyond its own autotuning list (the 44 configs of
``cutlass_ops.gemms.dsl``), on the 16 LLM shapes: does any knob the list leaves fixed beat
torch.matmul where the tuned winners do not (issue 23's 1.03 bar)? Needs ``cutlass-ops[dsl]``.

The knobs, by shape class:
- M <= 128: ``dsl.SMALL_CONFIGS`` (pingpong 64-row tiles 16 to 128 wide, swapped or not,
  clusters 1x1 / 2x1 / 1x2, K tiles 64 and 128) and the shape's best four of QuACK's list; then
  split-K 2 and 4 (QuACK's parallel and serial modes) on each shape's best two.
- M >= 1024: each shape's four best configs of the committed ``sweep_dsl_gemm.json``, static
  (as the tuner runs them) and with QuACK's dynamic persistent scheduler, clusters 1x1 and 2x2,
  and a K tile of 128.

Every kernel is compiled up front in QuACK's compile pool (``quack.cache.pool_scope``,
``QUACK_COMPILE_WORKERS`` processes), then each is checked against a float32 product and timed
as the tuner times (CUDA-graph replays, L2 flushed); a launch that cannot be captured is a
capture failure. Per shape the best four, and the best config of QuACK's own list, are then
timed interleaved with torch.matmul. Prints a table and writes
``benchmarks/results/sweep_dsl_gemm_space.json``: "ours" is the best extended config, and
``detail.list_best`` the best of QuACK's list in the same run.

With ``--knobs widths``, each shape gets instead the tile widths that fill its waves
(``wave_variants``) beside its four best of QuACK's list, and the file is
``sweep_dsl_gemm_widths.json``.

    python benchmarks/sweeps/dsl_gemm_space.py [--shapes 128x4096x4096 ...] [--knobs widths]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.common import RESULTS, print_table, require_gpu_and_dsl, write_result  # noqa: E402
from benchmarks.gemm import LLM_SHAPES, tflops  # noqa: E402
from benchmarks.sweeps.dsl_gemm import operands  # noqa: E402
from cutlass_ops.gemms import dsl  # noqa: E402
from cutlass_ops.gemms.config import DType  # noqa: E402
from custom_kernels.core.tolerances import GEMM, relative_error, relative_tolerance  # noqa: E402
from tuning.timing import GraphCaptureError, do_bench, do_bench_interleaved  # noqa: E402

FINALISTS = 4
SMALL_M = 128
SPLITS = (2, 4)
SPLIT_MODES = {"parallel": 1, "serial": 0}  # quack.gemm_config.SplitKMode


@dataclasses.dataclass(frozen=True)
class Variant:
    """A QuACK sm90 config with the knobs ``DslConfig`` fixes made free."""
    tile_m: int
    tile_n: int
    pingpong: bool
    cluster_m: int
    cluster_n: int
    swap_ab: bool
    tile_k: int = 64  # QuACK's default for 16-bit operands (four wgmma K steps)
    dynamic: bool = False
    split_k: int = 1
    split_mode: str = "serial"

    @property
    def name(self) -> str:
        schedule = "pingpong" if self.pingpong else "cooperative"
        return (f"{schedule}-t{self.tile_m}x{self.tile_n}" + (f"x{self.tile_k}" if self.tile_k
                                                              != 64 else "")
                + f"-c{self.cluster_m}x{self.cluster_n}" + ("-swap" if self.swap_ab else "")
                + ("-dynamic" if self.dynamic else "")
                + (f"-splitk{self.split_k}{self.split_mode}" if self.split_k > 1 else ""))

    @property
    def in_quack_list(self) -> bool:
        return (self.tile_k == 64 and not self.dynamic and self.split_k == 1
                and dsl.DslConfig(self.tile_m, self.tile_n, self.cluster_m, self.cluster_n,
                                  self.pingpong, self.swap_ab) in dsl.SM90_CONFIGS)

    @classmethod
    def of(cls, config: dsl.DslConfig) -> Variant:
        return cls(config.tile_m, config.tile_n, config.pingpong, config.cluster_m,
                   config.cluster_n, config.swap_ab, config.tile_k)

    def launch(self, a, b, out):
        from quack.gemm_config import GemmConfig

        gemm = dsl._interface().gemm_tuned.fn
        config = GemmConfig(tile_m=self.tile_m, tile_n=self.tile_n,
                            tile_k=self.tile_k if self.tile_k != 64 else None,
                            pingpong=self.pingpong, is_dynamic_persistent=self.dynamic,
                            cluster_m=self.cluster_m, cluster_n=self.cluster_n,
                            split_k=self.split_k, swap_ab=self.swap_ab, device_capacity=9)
        mode = SPLIT_MODES[self.split_mode]

        def run():
            gemm(a, b, out, None, None, 1.0, 1.0, config=config, split_k=self.split_k,
                 split_k_mode=mode, dynamic_scheduler=self.dynamic)
            return out

        return run


def small_variants() -> list[Variant]:
    return [Variant.of(c) for c in dsl.SMALL_CONFIGS]


def large_variants(bases: list[dsl.DslConfig]) -> list[Variant]:
    out = []
    for base in bases:
        v = Variant.of(base)
        out += [v, dataclasses.replace(v, dynamic=True),
                dataclasses.replace(v, cluster_m=1, cluster_n=1),
                dataclasses.replace(v, cluster_m=2, cluster_n=2),
                dataclasses.replace(v, tile_k=128)]
    return out


def wave_variants(m: int, n: int, sms: int = dsl.SMS_H100) -> list[Variant]:
    """Pingpong 64 x W and cooperative 128 x W tiles, W from 96 to 256 in steps of 16, swapped
    or not, whose tiles are at least 95% the problem's and fill their waves of ``sms`` SMs at
    least 95% (the widths cuBLAS picks on such shapes: docs/measurements.md), with clusters 2x1,
    1x1 and 1x2."""
    out = []
    for pingpong, tile_m in ((True, 64), (False, 128)):
        for width in range(96, 257, 16):
            for swap in (False, True):
                rows, cols = (n, m) if swap else (m, n)
                tiles_m, tiles_n = math.ceil(rows / tile_m), math.ceil(cols / width)
                useful = rows * cols / (tiles_m * tile_m * tiles_n * width)
                tiles = tiles_m * tiles_n
                if useful * tiles / (math.ceil(tiles / sms) * sms) >= 0.95:
                    out += [Variant(tile_m, width, pingpong, cm, cn, swap)
                            for cm, cn in ((2, 1), (1, 1), (1, 2))]
    return out


def committed_bases(per_shape: int = 4) -> dict:
    """{(m, n, k): the shape's best ``per_shape`` configs of QuACK's list} from the committed
    full sweep (sweep_dsl_gemm.json), which timed all 44 on each shape."""
    rows = json.loads((RESULTS / "sweep_dsl_gemm.json").read_text())["rows"]
    bases = {}
    for row in rows:
        m, n, k = (int(part.split("=")[1]) for part in row["case"].split()[-3:])
        first = row["detail"]["first_round_ms"]
        bases[(m, n, k)] = [dsl.DslConfig.from_name(name)
                            for name in sorted(first, key=first.get)[:per_shape]]
    return bases


def compile_in_pool(jobs: list[tuple[str, object]], failures: dict) -> dict:
    """Runs each job once inside QuACK's compile pool, so that cold kernels compile in its
    worker processes side by side; {name: seconds until the job's first launch returned}."""
    from quack.cache import CompilePending, pool_scope
    from quack.cache.async_compile import suppress_pool

    start, done, awaiting, attempts = time.perf_counter(), {}, {}, collections.Counter()
    queue = collections.deque(jobs)
    with pool_scope() as pool:
        while queue:
            name, run = queue.popleft()
            if name in awaiting and pool.poll(awaiting[name])[0] == "pending":
                queue.append((name, run))
                time.sleep(0.02)
                continue
            attempts[name] += 1
            try:
                run()
                torch.cuda.synchronize()
                done[name] = time.perf_counter() - start
            except CompilePending as pending:
                awaiting[name] = pending.sha
                if attempts[name] < 4:
                    queue.append((name, run))
                else:
                    failures[name] = "compile: still pending after 4 attempts"
            except Exception as exc:  # a config QuACK refuses: recorded, not fatal
                try:  # the pool's worker may have failed where the process would not
                    with suppress_pool():
                        run()
                    torch.cuda.synchronize()
                    done[name] = time.perf_counter() - start
                except Exception:
                    failures[name] = f"compile: {type(exc).__name__}: {exc}"[:300]
    return done


def sweep_shape(m, n, k, variants, tolerance) -> dict:
    x, w = operands(m, n, k)
    reference = x.float() @ w.float().t()
    outs = {v: torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for v in variants}
    failures: dict = {}
    launches = {v: v.launch(x, w.t(), outs[v]) for v in variants}
    compile_in_pool([(v.name, launches[v]) for v in variants], failures)
    first, errors = {}, {}
    for v in variants:
        if v.name in failures:
            continue
        try:
            outs[v].fill_(float("nan"))
            launches[v]()
            error = errors[v] = relative_error(outs[v], reference)
            if not error <= tolerance:
                failures[v.name] = f"wrong result: relative error {error:.3g}"
                continue
            first[v] = do_bench(launches[v], warmup=3, reps=10, graph=True).median_ms
        except GraphCaptureError as exc:
            failures[v.name] = f"capture: {exc}"[:300]
        except Exception as exc:
            failures[v.name] = f"launch: {type(exc).__name__}: {exc}"[:300]
    ranked = sorted(first, key=first.get)
    finalists = ranked[:FINALISTS]
    listed = [v for v in ranked if v.in_quack_list][:1]
    final = {}
    for v in dict.fromkeys(finalists + listed):
        timings = do_bench_interleaved({"dsl": launches[v],
                                        "torch": lambda: torch.matmul(x, w.t())},
                                       reps=40, graph=True)
        final[v] = timings["torch"].median_ms / timings["dsl"].median_ms
    best = max(final, key=final.get) if final else None
    list_best = listed[0] if listed else None
    case = f"dsl space best vs torch.matmul bf16 M={m} N={n} K={k}"
    if best is None:
        return {"case": case, "unit": "TFLOP/s", "ours": 0.0, "reference": 0.0,
                "reference_name": "torch.matmul", "ratio": 0.0, "correct": False,
                "detail": {"failures": failures}}
    ours_ms = first[best]
    torch_ms = ours_ms * final[best]
    return {
        "case": case, "unit": "TFLOP/s", "ours": round(tflops(m, n, k, ours_ms), 1),
        "reference": round(tflops(m, n, k, torch_ms), 1), "reference_name": "torch.matmul",
        "ratio": round(final[best], 4), "correct": errors[best] <= tolerance,
        "detail": {"config": best.name, "relative_error": errors[best],
                   "in_quack_list": best.in_quack_list,
                   "list_best": list_best.name if list_best else None,
                   "list_best_ratio": round(final[list_best], 4) if list_best else None,
                   "finalists": {v.name: round(r, 4) for v, r in final.items()},
                   "first_round_ms": {v.name: round(first[v], 5) for v in ranked},
                   "failures": failures},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", help="MxNxK (default: the 16 LLM shapes)")
    parser.add_argument("--knobs", choices=("classes", "widths"), default="classes",
                        help="classes: the knobs by shape class (above); widths: wave-filling "
                             "tile widths (wave_variants) beside the shape's four best of "
                             "QuACK's list (writes sweep_dsl_gemm_widths.json)")
    args = parser.parse_args()
    require_gpu_and_dsl()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes else LLM_SHAPES
    tolerance = relative_tolerance(DType.BF16, GEMM)
    bases = committed_bases()
    rows, start = [], time.perf_counter()
    name = "sweep_dsl_gemm_space" if args.knobs == "classes" else "sweep_dsl_gemm_widths"
    for m, n, k in shapes:
        if args.knobs == "widths":
            variants = wave_variants(m, n) + [Variant.of(c) for c in bases[(m, n, k)]]
        elif m <= SMALL_M:
            variants = small_variants() + [Variant.of(c) for c in bases.get((m, n, k), [])]
        else:
            variants = large_variants(bases[(m, n, k)])
        row = sweep_shape(m, n, k, list(dict.fromkeys(variants)), tolerance)
        if args.knobs == "classes" and m <= SMALL_M and row["correct"]:
            # Split-K on the two best of the first round.
            top = [v for v in variants if v.name in list(row["detail"]["first_round_ms"])[:2]]
            splits = [dataclasses.replace(v, split_k=s, split_mode=mode)
                      for v in top for s in SPLITS for mode in SPLIT_MODES]
            split_row = sweep_shape(m, n, k, list(dict.fromkeys(top + splits)), tolerance)
            row["detail"]["split_k"] = {key: split_row["detail"][key] for key in
                                        ("finalists", "first_round_ms", "failures")}
            if split_row["ratio"] > row["ratio"] and "-splitk" in split_row["detail"]["config"]:
                row.update({key: split_row[key] for key in ("ours", "reference", "ratio")})
                row["detail"]["config"] = split_row["detail"]["config"]
        rows.append(row)
        # Written after every shape: a kernel that hangs the GPU loses only its own shape.
        write_result(name, rows, shapes_done=len(rows), shapes=len(shapes))
        d = row["detail"]
        print(f"{m}x{n}x{k}: {row['ratio']}x torch ({d.get('config')}); QuACK's list "
              f"{d.get('list_best_ratio')} ({d.get('list_best')}); {len(d['failures'])} "
              f"failures; {time.perf_counter() - start:.0f} s", flush=True)
    ratios = [r["ratio"] for r in rows if r["ratio"] > 0]
    geomean = statistics.geometric_mean(ratios) if ratios else 0.0
    print_table(["case", "ours", "reference", "ratio", "config", "list best"],
                [[r["case"][31:], r["ours"], r["reference"], r["ratio"], r["detail"].get("config"),
                  r["detail"].get("list_best_ratio")] for r in rows])
    print(f"geomean {geomean:.4f} over {len(ratios)} shapes; {time.perf_counter() - start:.0f} s")
    write_result(name, rows, shapes_done=len(rows), shapes=len(shapes),
                 geomean=round(geomean, 4), sweep_seconds=round(time.perf_counter() - start, 1))


if __name__ == "__main__":
    main()
