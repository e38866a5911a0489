"""A Hugging Face module's forward swapped in place: the module's class becomes ``Fused<cls>``,
our mixin on top of the model's own class. isinstance checks against the model's classes still
hold (transformers records outputs and picks code paths by class), the parameters, buffers and
``state_dict`` stay, and the model's own forward is one ``_hf_class`` away for the probes and the
fallbacks; setting ``__class__`` back undoes it. One class per (mixin, model class)."""

from __future__ import annotations

_classes: dict = {}


def fused_class(mixin: type, cls: type, what: str) -> type:
    """``Fused<cls>``: ``mixin`` over ``cls`` (cached); ``what`` finishes its docstring
    ("<cls> <what> (<the mixin's module>).")."""
    key = (mixin, cls)
    if key not in _classes:
        _classes[key] = type(f"Fused{cls.__name__}", (mixin, cls),
                             {"_hf_class": cls, "__module__": mixin.__module__,
                              "__doc__": f"{cls.__name__} {what} ({mixin.__module__})."})
    return _classes[key]
