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
_KEY = "_cutlass_ops_state"  # the one attribute: {state class's dotted name: instance}


def _key(kind: type) -> str:
    # A string key: torch.compile traces dict reads by constant strings (fused forwards read
    # their state inside compiled graphs), and writes only through item assignment.
    return f"{kind.__module__}.{kind.__qualname__}"


def get(module, kind: type[T]) -> Optional[T]:
    """``module``'s state of ``kind``, or None."""
    states = module.__dict__.get(_KEY)
    return None if states is None else states.get(_key(kind))


def ensure(module, kind: type[T], make: Optional[Callable[[], T]] = None) -> T:
    """``module``'s state of ``kind``, made by ``make`` (else ``kind()``) when it has none."""
    state = get(module, kind)
    if state is None:
        state = (make or kind)()
        put(module, state)
    return state


def put(module, state) -> None:
    """``state`` as ``module``'s state of its class."""
    states = module.__dict__.get(_KEY)
    if states is None:
        states = module.__dict__[_KEY] = {}
    states[_key(type(state))] = state


def take(module, kind: type[T]) -> Optional[T]:
    """``module``'s state of ``kind``, removed (None when it had none)."""
    states = module.__dict__.get(_KEY)
    return None if states is None else states.pop(_key(kind), None)


def drop(module, kind: type) -> None:
    take(module, kind)


__all__ = ["get", "ensure", "put", "take", "drop"]
