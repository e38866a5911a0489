"""Where a sweep puts LayerNorm's weight and bias: views into one buffer, the weight at byte
offset `w_off` and the bias `gap` bytes after the weight's end (the same values each time), for
the sweeps that measured the long-row forward's sensitivity to that placement."""
import torch

# (w_off, gap) in bytes; ln_wplace.py measured twelve, these eight span its range
PLACEMENTS = ((0, 0), (64, 0), (0, 4096), (0, 65536), (2048, 8192), (1 << 18, 0),
              (4096, 3 << 16), (1 << 16, 7 << 16))


def placement_buffer(hidden: int) -> torch.Tensor:
    return torch.empty(4 * hidden + (1 << 20), dtype=torch.bfloat16, device="cuda")


def place(buf: torch.Tensor, w: torch.Tensor, b, w_off: int, gap: int):
    """Copies w (and b, unless None) into `buf` at the placement; returns the two views."""
    hidden = w.numel()
    wo = w_off // 2
    wv = buf[wo:wo + hidden]
    wv.copy_(w)
    if b is None:
        return wv, None
    bo = wo + hidden + gap // 2
    bv = buf[bo:bo + hidden]
    bv.copy_(b)
    return wv, bv
