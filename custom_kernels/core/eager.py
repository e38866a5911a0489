"""When a kernel family may skip torch's custom-op dispatch: the one rule of the families' eager
fast paths (norms, rotary, swiglu).

The custom ops cost more Python dispatch a call than a launch (docs/measurements.md, "Host cost"); eagerly, with plain
tensors, the families call their launchers directly (or through an autograd.Function). That is
exact only when nothing else must see the call: no fake, functional or other subclass tensor, and
no torch dispatch mode (fake tensor mode, profiling modes) active. Anything else goes through
the custom ops, which the dispatcher handles.
"""

from __future__ import annotations

import torch

PLAIN = (torch.Tensor, torch.nn.Parameter)
# How many torch dispatch modes are active, read in C: torch.utils._python_dispatch's
# _get_current_dispatch_mode wraps this count in a Python frame that every hot call would pay.
# A torch without it: every call counts as under a mode and takes the custom ops.
_modes_active = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 1)


def plain_eager(*tensors) -> bool:
    """True when the direct path is exact for these tensors (None entries are ignored)."""
    if _modes_active():
        return False
    for t in tensors:
        if t is not None and type(t) not in PLAIN:
            return False
    return True


def _flatten(args) -> tuple[tuple, list]:
    """(sizes, flat): list arguments laid out in ``flat`` (size = their length), the others as
    themselves (size -1): autograd.Function sees tensors only at the top level."""
    sizes = tuple(len(a) if isinstance(a, (list, tuple)) else -1 for a in args)
    flat = [x for a in args for x in (a if isinstance(a, (list, tuple)) else (a,))]
    return sizes, flat


def _unflatten(sizes, flat) -> list:
    out, i = [], 0
    for n in sizes:
        if n < 0:
            out.append(flat[i])
            i += 1
        else:
            out.append(list(flat[i:i + n]))
            i += n
    return out


class _OpContext:
    """The autograd context as an op's formulas see it: ``needs_input_grad`` by the op's
    arguments (a tuple for a list argument), everything else the Function's own context."""

    def __init__(self, ctx, needs_input_grad):
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "needs_input_grad", needs_input_grad)

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def __setattr__(self, name, value):
        setattr(self._ctx, name, value)


def _needs_grad(args) -> bool:
    return torch.is_grad_enabled() and any(
        t.requires_grad for a in args
        for t in (a if isinstance(a, (list, tuple)) else (a,)) if isinstance(t, torch.Tensor))


_libraries: dict = {}


def fast_autograd(qualname: str, *, eager, backward, setup_context,
                  eager_grads: bool = True) -> None:
    """Registers the autograd of the custom op ``qualname`` ("namespace::name", made with
    ``torch.library.custom_op``): ``register_autograd(backward, setup_context)``, and for CPU
    and CUDA tensors (the AutogradCPU / AutogradCUDA keys, which take precedence over the
    Autograd alias that ``register_autograd`` fills) a kernel with a direct path: called with
    plain tensors (``plain_eager``) it runs ``eager(*args)``, the family's own eager function
    (which handles gradients itself); otherwise (fake, functional or subclass tensors, dispatch
    modes: torch.compile's and export's tracing) an autograd.Function from the same
    ``backward`` and ``setup_context`` whose forward runs the op below autograd, as torch's own
    wrapper does. ``eager_grads=False``: ``eager`` computes the op without autograd, and
    calls that need gradients take the autograd.Function too.

    torch's wrapper costs a pytree walk, a redispatch and a second Python kernel a call, about three times the
    cost of this kernel for a small op (docs/measurements.md, "Host cost of a call"). Compiled
    graphs call the ops through the dispatcher too, so they gain as much a call."""
    namespace, name = qualname.split("::")
    torch.library.register_autograd(qualname, backward, setup_context=setup_context)
    overload = getattr(getattr(torch.ops, namespace), name).default

    class Traced(torch.autograd.Function):
        @staticmethod
        def forward(ctx, sizes, *flat):
            args = _unflatten(sizes, flat)
            with torch._C._AutoDispatchBelowAutograd():
                output = overload(*args)
            setup_context(ctx, tuple(args), output)
            ctx.op_argument_sizes = sizes
            return output

        @staticmethod
        def backward(ctx, *grads):
            sizes = ctx.op_argument_sizes
            needs = tuple(tuple(n) if isinstance(n, list) else n
                          for n in _unflatten(sizes, ctx.needs_input_grad[1:]))
            result = backward(_OpContext(ctx, needs), *grads)
            flat = [None]  # the sizes
            for n, grad in zip(sizes, result):
                if n < 0:
                    flat.append(grad)
                else:
                    flat.extend(grad if grad is not None else [None] * n)
            return tuple(flat)

    # The dispatcher passes the arguments given; the formulas expect all of them.
    schema = overload._schema.arguments
    defaults = tuple(a.default_value if a.has_default_value() else None for a in schema)
    count = len(defaults)
    # Where the schema takes tensors, and tensor lists: the per-call check looks there only.
    singles = tuple(i for i, a in enumerate(schema) if "Tensor" in str(a.type)
                    and "[]" not in str(a.type))
    lists = tuple(i for i, a in enumerate(schema) if str(a.type).startswith("List[Tensor"))

    def plain(args) -> bool:
        """``plain_eager`` of the arguments, unrolled over the schema's tensor positions."""
        if _modes_active():
            return False
        for i in singles:
            t = args[i]
            if t is not None and type(t) not in PLAIN:
                return False
        return all(type(t) in PLAIN for i in lists for t in args[i])

    def kernel(*args):
        if len(args) < count:
            args = args + defaults[len(args):]
        if plain(args) and (eager_grads or not _needs_grad(args)):
            return eager(*args)
        sizes, flat = _flatten(args)
        return Traced.apply(sizes, *flat)

    library = _libraries.get(namespace)
    if library is None:
        library = _libraries[namespace] = torch.library.Library(namespace, "IMPL")
    for key in ("AutogradCPU", "AutogradCUDA"):
        library.impl(name, kernel, key)
