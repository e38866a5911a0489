"""When a weight's FP8 copy is still good: what the copy depends on, as a key that changes
whenever the weight may have (``weights_key``), for the layers that keep FP8 copies of weights
between calls that do not train them (``cutlass_ops.fp8.linear``'s ``WeightCache``,
``cutlass_ops.fp8.fp8_experts``' forward operands).

The key holds each weight's data pointer and version counter (every in-place write through
autograd's view of a tensor bumps it: optimizer steps, ``load_state_dict``,
``with no_grad(): w.copy_()``) and a count of optimizer steps taken in this process (which also
covers weights written under ``torch.autograd._unsafe_preserve_version_counter``, as FSDP2's
all-gather writes). Writes through ``.data`` escape both: the layers say how to drop their
copies. Inference tensors and tensor subclasses have no key: their copies are made at every
call.
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor

from custom_kernels.core.eager import PLAIN

_optimizer_steps = [0, None]  # steps taken by any torch optimizer in this process, the hook


def _count_step(optimizer, args, kwargs) -> None:
    _optimizer_steps[0] += 1


def optimizer_steps() -> int:
    """Optimizer steps taken since the first call (the hook is registered then, not at
    import)."""
    if _optimizer_steps[1] is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _optimizer_steps[1] = register_optimizer_step_post_hook(_count_step)
    return _optimizer_steps[0]


def weights_key(weights: Sequence[Tensor], what: str) -> Optional[tuple]:
    """What FP8 copies of ``weights`` made for ``what`` (a recipe's name) depend on, or None
    when it cannot be known (inference tensors, tensor subclasses)."""
    parts = []
    for w in weights:
        if type(w) not in PLAIN or w.is_inference():
            return None
        parts.append((w.data_ptr(), w._version, tuple(w.shape)))
    return (what, optimizer_steps(), weights[0].device, weights[0].dtype, *parts)


__all__ = ["optimizer_steps", "weights_key"]
