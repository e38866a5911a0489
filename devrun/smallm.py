"""Small-M diagnostic for issue 3: every kernel of smallm_list on the 6 small-M LLM shapes, with
stream-K split variants, interleaved with torch.matmul; then the best few again with pad_host."""
import json
import os
import sys

import torch

sys.path.insert(0, "devrun")
import importlib  # noqa: E402

smallm_list = importlib.import_module(sys.argv[2] if len(sys.argv) > 2 else "smallm_list")

from cutlass_ops.config import GemmOperands, GemmProblem  # noqa: E402
from cutlass_ops.kernels import prepare_many  # noqa: E402
from tuning import candidates  # noqa: E402
from tuning.backend import GpuSession  # noqa: E402
from tuning.timing import do_bench_interleaved  # noqa: E402

built = prepare_many(smallm_list.items(), jobs=16)
failed = {k[1].name: str(v)[:300] for k, v in built.items() if isinstance(v, Exception)}
print("build failures:", failed, flush=True)
ops = GemmOperands.make("bf16")
report = {"failed": failed, "shapes": {}}
for m, n, k in smallm_list.SHAPES:
    problem = GemmProblem(ops, m, n, k)
    s = GpuSession(problem, 0)
    fns, errors = {}, {}
    for c in smallm_list.choices():
        if (c.operands_for(ops), c.config) in built and isinstance(built[(c.operands_for(ops), c.config)], Exception):
            continue
        if not candidates.fits_shape(problem, c):
            continue
        splits = (1, 2, 3, 4, 6, 8) if c.config.tile_scheduler.value == "streamk" else (1,)
        for sp in splits:
            v = c.replace(splits=sp)
            err = s.verify(v)
            if err:
                errors[v.name] = err
                continue
            fns[v] = s._launcher(v)
    fns["torch"] = s._torch_call()
    t = do_bench_interleaved(fns, reps=int(os.environ.get('REPS', 60)), device=s.device)
    res = sorted(((key if key == "torch" else key.name, round(v.median_ms * 1e3, 2))
                  for key, v in t.items()), key=lambda x: x[1])
    torch_us = dict(res)["torch"]
    top = [key for key, _ in sorted(t.items(), key=lambda kv: kv[1].median_ms) if key != "torch"][:6]
    padded = do_bench_interleaved({**{c: fns[c] for c in top}, "torch": fns["torch"]}, reps=100,
                                  device=s.device, pad_host=True)
    pad = {(key if key == "torch" else key.name): round(v.median_ms * 1e3, 2) for key, v in padded.items()}
    print(f"== {m}x{n}x{k}: torch {torch_us} us; padded torch {pad['torch']}", flush=True)
    for name, us in res[:15]:
        print(f"   {us:8.2f}  x{torch_us / us:.3f}  pad {pad.get(name, '')}  {name}")
    report["shapes"][f"{m}x{n}x{k}"] = {"all_us": res, "padded_us": pad, "errors": errors}
    s.close()
json.dump(report, open(sys.argv[1], "w"), indent=1)
