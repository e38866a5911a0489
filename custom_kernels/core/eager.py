"""When a kernel family may skip torch's custom-op dispatch: the one rule of the families' eager
fast paths (norms, rotary, swiglu).

The custom ops cost about 15 us of Python dispatch a call, more than a launch; eagerly, with plain
tensors, the families call their launchers directly (or through an autograd.Function). That is
exact only when nothing else must see the call: no fake, functional or other subclass tensor, and
no torch dispatch mode (fake tensor mode, profiling modes) active. Anything else goes through
the custom ops, which the dispatcher handles.
"""

from __future__ import annotations

import torch

PLAIN = (torch.Tensor, torch.nn.Parameter)
try:
    from torch.utils._python_dispatch import _get_current_dispatch_mode
except ImportError:  # a torch without it: every call takes the custom ops
    _get_current_dispatch_mode = None


def plain_eager(*tensors) -> bool:
    """True when the direct path is exact for these tensors (None entries are ignored)."""
    if _get_current_dispatch_mode is None or _get_current_dispatch_mode() is not None:
        return False
    return all(t is None or type(t) in PLAIN for t in tensors)
