"""Where the e2e model's time goes (Llama-3-8B-shaped, random bf16 weights), eager against
converted: ``--decode``, the host time of ``generate()`` under cProfile (Hugging Face's, and ours
through ``cutlass_ops.generate``: each step one CUDA graph) and the per-call host cost of each
piece of a converted decoder layer at a decode step; ``--kernels``, the GPU time of a
prefill forward and of a train step by kernel (torch.profiler), with the busy share of each
call's kernel span, ungraphed and as ``cutlass_ops.graphed_train_step`` replays it.

Decoding a model of this size is host-bound (a step's weights take about 1.5 ms to stream at
batch 1, a step costs several times that on the host), so the figure that matters is Python and
launch time per step. Prints, per variant, milliseconds per generated token and the functions
with the most own time; then microseconds per call of each fused-layer piece. Writes nothing
under benchmarks/results (a diagnostic, not a result); ``--out DIR`` keeps the pstats dumps.

    python benchmarks/profile_model.py [--decode] [--kernels] [--layers 8] [--batch 1 16]
        [--new-tokens 32] [--out DIR] [--fp8 tensorwise|rowwise|blockwise]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import require_gpu  # noqa: E402
from benchmarks.e2e import PROMPT, llama  # noqa: E402
from benchmarks.host_cost import us_per_call  # noqa: E402


def generate_fn(model, batch: int, new_tokens: int, graphed: bool = False):
    """One ``generate()`` of ``new_tokens`` greedy tokens after e2e's prompt: Hugging Face's, or
    with ``graphed`` ``cutlass_ops.generate`` (each step one CUDA graph, e2e's "ours")."""
    prompt = torch.randint(0, 128256, (batch, PROMPT), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(batch))

    def run():
        if graphed:
            from benchmarks.e2e import graphed_generate

            return graphed_generate(model, prompt, new_tokens)
        return model.generate(prompt, attention_mask=torch.ones_like(prompt),
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)
    return run


def wall_ms(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def profile(name, fn, out: Path | None, top: int) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    torch.cuda.synchronize()
    profiler.disable()
    if out is not None:
        profiler.dump_stats(out / f"{name.replace(' ', '_')}.pstats")
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(top)
        lines = text.getvalue().splitlines()
        start = next(i for i, line in enumerate(lines) if "ncalls" in line)
        print(f"--- {name}: by {key}")
        print("\n".join(lines[start - 2:start + top + 1]))


def layer_pieces(model, batch: int) -> list[tuple[str, float]]:
    """Host microseconds per call of each piece of the first (fused) layer at a decode step."""
    from custom_kernels.rotary import apply_rotary
    from custom_kernels.swiglu import swiglu
    from cutlass_ops import fused_linear
    from cutlass_ops.decoder_blocks import _merged_view

    layer = model.model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    x = torch.randn(batch, 1, 4096, **kw)
    positions = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
    cos, sin = model.model.rotary_emb(x, positions)
    qkv_layers = (attention.q_proj, attention.k_proj, attention.v_proj)
    qkv_weights = [p.weight for p in qkv_layers]
    qkv = fused_linear.merged_linear(x, qkv_weights, None, _merged_view(attention))
    q, k, v = (t.view(batch, 1, -1, 128) for t in qkv.split([4096, 1024, 1024], -1))
    gate_up = torch.randn(batch, 1, 2 * 14336, **kw)
    a = torch.randn(batch, 1, 4096, **kw)
    h = torch.randn(batch, 1, 4096, **kw)
    o = attention.o_proj
    pieces = {
        "torch.empty": lambda: torch.empty(batch, 4096, **kw),
        "x.mul_(1)": lambda: x.mul_(1.0),
        "F.linear 4096->4096": lambda: torch.nn.functional.linear(x, o.weight),
        "input_layernorm (ours)": lambda: layer.input_layernorm(x),
        "merged_bias qkv": lambda: fused_linear.merged_bias(qkv_layers),
        "merged view lookup": lambda: _merged_view(attention)(qkv_weights),
        "merged_linear qkv": lambda: fused_linear.merged_linear(
            x, [p.weight for p in qkv_layers], fused_linear.merged_bias(qkv_layers),
            _merged_view(attention)),
        "split + 3 views": lambda: [t.view(batch, 1, -1, 128) for t in
                                    qkv.split([4096, 1024, 1024], -1)],
        "apply_rotary": lambda: apply_rotary(q, k, cos, sin),
        "linear_residual o_proj": lambda: fused_linear.linear_residual(a, o.weight, None, h),
        "swiglu": lambda: swiglu(gate_up),
        "mlp.activated": lambda: mlp.activated(x),
        "attention.attend (no cache)": lambda: attention.attend(
            x, (cos, sin), None, None, position_ids=positions),
        "whole fused layer (no cache)": lambda: layer(
            x, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin)),
    }
    with torch.no_grad():
        for fn in pieces.values():  # warm: kernels, routes, graphs
            us_per_call(fn, 20)
        return [(name, us_per_call(fn, 200)) for name, fn in pieces.items()]


def kernel_table(name, fn, top: int, trace: Path | None = None) -> None:
    """GPU time by kernel of one call of ``fn`` (after a warm call), the top ``top`` rows;
    ``trace``: also a Chrome trace of host and device (``gpu_gaps`` reads it)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    fn()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace else [])
    with torch_profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    if trace is not None:
        prof.export_chrome_trace(str(trace / f"{name.replace(' ', '_')}.json"))
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events) / 1e3
    device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    span = (max(e.time_range.end for e in device) - min(e.time_range.start for e in device)) / 1e3
    # Busy over span: the share of the call's first-to-last kernel stretch with a kernel
    # running (what launch gaps inside the call leave; host time before it is outside).
    print(f"--- {name}: {total:.2f} ms of kernels ({len(device)}), span {span:.2f} ms, "
          f"busy {total / span:.3f}")
    rows = sorted(events, key=lambda e: -e.device_time_total)[:top]
    for e in rows:
        print(f"{e.device_time_total / 1e3:9.3f} ms {e.count:6d}x  {e.key[:110]}")


def kernels(eager, ours, top: int, trace: Path | None = None) -> None:
    from benchmarks.e2e import SEQUENCES, train_step

    ids = torch.randint(0, 128256, (SEQUENCES, 2048), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    for name, model in (("eager", eager), ("ours", ours)):
        with torch.no_grad():
            model.eval()
            kernel_table(f"{name} prefill", lambda: model(input_ids=ids), top, trace)
        model.train()
        kernel_table(f"{name} train step", train_step(model, ids), top, trace)
        model.zero_grad(set_to_none=True)
        model.eval()
    # Ours replayed as one CUDA graph (cutlass_ops.graphed_train_step): what graphing changes.
    import cutlass_ops

    ours.train()
    step = cutlass_ops.graphed_train_step(ours)
    step(input_ids=ids, labels=ids)  # eager; kernel_table's warm call captures
    kernel_table("ours graphed train step", lambda: step(input_ids=ids, labels=ids), top, trace)
    ours.zero_grad(set_to_none=True)
    # The ungraphed step once more, after the graphed one: the graph's kernels ran longer than
    # the same kernels ungraphed (docs/measurements.md); this tells the graph from the order
    # (a GPU warmer by then).
    kernel_table("ours train step again", train_step(ours, ids), top, trace)
    ours.zero_grad(set_to_none=True)
    ours.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--top", type=int, default=35)
    parser.add_argument("--out", type=Path, help="folder for the pstats dumps")
    parser.add_argument("--decode", action="store_true", help="the host profile of decoding")
    parser.add_argument("--kernels", action="store_true",
                        help="GPU time by kernel of a prefill and a train step")
    parser.add_argument("--fp8", choices=("tensorwise", "rowwise", "blockwise"),
                        help="convert with this FP8 recipe (convert(model, fp8=RECIPE))")
    args = parser.parse_args()
    if not (args.decode or args.kernels):
        args.decode = args.kernels = True
    require_gpu()
    import cutlass_ops

    eager = llama(args.layers).eval()
    ours = copy.deepcopy(eager)
    print(str(cutlass_ops.convert(ours, fp8=args.fp8)).splitlines()[0])
    if args.kernels:
        kernels(eager, ours, args.top, args.out)
    if not args.decode:
        return
    with torch.no_grad():
        for batch in args.batch:
            for name, model, graphed in (("eager", eager, False), ("ours", ours, False),
                                         ("ours graphed", ours, True)):
                fn = generate_fn(model, batch, args.new_tokens, graphed)
                fn()
                ms = wall_ms(fn)
                print(f"{name} batch {batch}: {ms / args.new_tokens:.2f} ms per step")
                profile(f"{name} batch {batch}", fn, args.out, args.top)
    for batch in args.batch:
        for piece, us in layer_pieces(ours, batch):
            print(f"batch {batch:3d}  {piece:32s} {us:8.1f} us")


if __name__ == "__main__":
    main()
