"""One call each of torch.matmul for the small-M shapes (for ncu)."""
import torch
for m, n, k in [(m, n, k) for m in (16, 128) for n, k in ((4096, 4096), (14336, 4096), (4096, 14336))] + [(1024, 14336, 4096), (16384, 14336, 4096), (4096, 4096, 4096)]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(x, w.t())
torch.cuda.synchronize()
