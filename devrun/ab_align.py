"""The staged forward of another csrc directory (argument: an older commit's) against this
checkout's, and a torch copy of the same bytes, timed interleaved in one process
(do_bench_interleaved); fractions of the copy measured in the same repetitions, bf16, the
heuristic's configs, with each kernel's registers, static shared memory and blocks per SM:
python devrun/ab_align.py OLD_CSRC_DIR (HIDDEN="8192 262144" picks sizes).

Its first use (H200) found the staging region's alignment: the row-queue experiment
(devrun/row_queue.patch on 757d2e4: rows handed out through the work queue, the ticket broadcast
with the reduction) added 16 bytes of static shared memory, and every kernel whose dynamic
region moved off (or onto) a 32-byte boundary changed speed by 5 to 11% with an unchanged
instruction stream; the queue itself was worth 0 to +1.5% at 16384-65536 and cost 5% at 262144
(cause not found; the ticket already travelled a row late), so it was set aside."""
import os
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from custom_kernels import jit, norm_config as nc, norms  # noqa: E402
from custom_kernels.launch import (allow_large_clusters, launch,  # noqa: E402
                                   max_active_blocks_per_sm, set_max_dynamic_shared)
from tuning.timing import do_bench_interleaved  # noqa: E402

HIDDEN = tuple(int(h) for h in
               os.environ.get("HIDDEN", "8192 16384 32768 65536 131072 262144").split())


def old_kernel(csrc: Path, p: nc.NormProblem, cfg: nc.NormConfig):
    """The kernel of `csrc` for `cfg`: compiled with jit.CSRC pointed there (its cubin cache key
    hashes the sources), then forgotten by jit's memo so this checkout's compiles afresh."""
    new_csrc = jit.CSRC
    jit.CSRC = csrc
    jit.include_dirs.cache_clear()
    try:
        return jit.get_kernel(cfg.source, cfg.kernel_name("fwd"), defines=cfg.defines(p))
    finally:
        jit.CSRC = new_csrc
        jit.include_dirs.cache_clear()
        jit._kernels.clear()


def main():
    csrc = Path(sys.argv[1]).resolve()
    for hidden in HIDDEN:
        for kind in ("rms", "ln"):
            rows = 8192 if hidden >= 262144 else 32768
            p = nc.NormProblem(kind, "fwd", hidden, "bfloat16", "bfloat16", "bfloat16")
            cfg = nc.heuristic(p)
            torch.manual_seed(1)
            x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
            w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
            b = (0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16) \
                if kind == "ln" else None
            ref = F.layer_norm(x.float(), (hidden,), w.float(), b.float(), 1e-5) \
                if kind == "ln" else F.rms_norm(x.float(), (hidden,), w.float(), 1e-5)
            copy_out = torch.empty_like(x)
            y_old = torch.empty_like(x)
            rstd = torch.empty(rows, device="cuda")
            mean = torch.empty(rows, device="cuda") if kind == "ln" else None
            kernel = old_kernel(csrc, p, cfg)

            def new():
                return norms._fwd_impl(kind, x, w, b, None, 1e-5, torch.bfloat16, cfg.name)[0]
            new()  # builds the plan (and this checkout's kernel)
            plan = norms._fwd_plan(kind, hidden, "bfloat16", "bfloat16", "bfloat16", True,
                                   False, cfg.name, 0)
            set_max_dynamic_shared(kernel, plan.shared_mem, 0)
            if cfg.cluster > 8:
                allow_large_clusters(kernel, 0)

            def old():
                launch(kernel, x, 0, w, b if b is not None else 0, y_old, 0,
                       mean if mean is not None else 0, rstd, np.int64(rows), np.int32(hidden),
                       np.int64(hidden), np.int64(0), np.float32(1e-5), grid=plan.blocks(rows),
                       block=cfg.threads, cluster=cfg.cluster, shared_mem=plan.shared_mem)
                return y_old
            fns = {"old": old, "new": new, "copy": lambda: copy_out.copy_(x)}
            errs = {k: ((fns[k]().float() - ref).norm() / ref.norm()).item()
                    for k in ("old", "new")}
            t = do_bench_interleaved(fns, reps=30, pad_host=True)
            copy_ms = t["copy"].median_ms
            line = f"{kind:3s} {hidden:6d} {cfg.name:22s} copy " \
                   f"{2 * x.numel() * 2 / copy_ms / 1e6:.0f} GB/s"
            for k in ("old", "new"):
                line += f" | {k} {copy_ms / t[k].median_ms:.3f} err {errs[k]:.0e}"
            for tag, k in (("old", kernel), ("new", plan.kernel)):
                line += (f"\n      {tag}: {k.attributes.num_regs} regs, local "
                         f"{k.attributes.local_size_bytes} B, static smem "
                         f"{k.attributes.shared_size_bytes} B, blocks/SM "
                         f"{max_active_blocks_per_sm(k, cfg.threads, plan.shared_mem)}")
            print(line, flush=True)
            x = ref = copy_out = y_old = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
