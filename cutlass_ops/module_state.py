"""What cutlass_ops keeps on a model's modules, in one place: each feature that needs per-module
state (a fused block's GEMMs and packed-weight view, a layer's step graphs, a fused router's plan,
the sorted pairs a router hands its experts, a routed loss) declares a class for it and reads and
writes it through ``get`` / ``ensure`` / ``put`` / ``take`` / ``drop``, keyed by that class.

The states live in one dict in the module's ``__dict__`` (plain reads on the forward path, not
``nn.Module.__getattr__``); ``copy.deepcopy`` of a module copies them (each state class decides
how, as ``step_graphs.Holder`` does), ``state_dict`` never sees them.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

T = TypeVar("T")
_KEY = "_cutlass_ops_state"  # the one attribute: {state class: instance}


def get(module, kind: type[T]) -> Optional[T]:
    """``module``'s state of ``kind``, or None."""
    states = module.__dict__.get(_KEY)
    return None if states is None else states.get(kind)


def ensure(module, kind: type[T], make: Optional[Callable[[], T]] = None) -> T:
    """``module``'s state of ``kind``, made by ``make`` (else ``kind()``) when it has none."""
    states = module.__dict__.setdefault(_KEY, {})
    state = states.get(kind)
    if state is None:
        state = states[kind] = (make or kind)()
    return state


def put(module, state) -> None:
    """``state`` as ``module``'s state of its class."""
    module.__dict__.setdefault(_KEY, {})[type(state)] = state


def take(module, kind: type[T]) -> Optional[T]:
    """``module``'s state of ``kind``, removed (None when it had none)."""
    states = module.__dict__.get(_KEY)
    return None if states is None else states.pop(kind, None)


def drop(module, kind: type) -> None:
    take(module, kind)


__all__ = ["get", "ensure", "put", "take", "drop"]
