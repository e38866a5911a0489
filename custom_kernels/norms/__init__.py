"""Fused RMSNorm and LayerNorm (with residual; forward and backward): one kernel family.

``config`` (launch configs, pure data) -> ``ops`` (plans, torch.library ops, autograd, the public
functions and the references) -> ``modules`` (nn drop-ins); ``fp8`` (RMSNorm that also writes its
output in FP8, over ``ops``); ``tuned`` reads the norm tuner's stored winners. Public names load
on first use, so that importing ``config`` loads no torch.
"""

_PUBLIC = {
    "rms_norm": "ops", "layer_norm": "ops", "rms_norm_reference": "ops",
    "layer_norm_reference": "ops", "why_unsupported": "ops", "precompile": "ops",
    "RMSNorm": "modules", "OffsetRMSNorm": "modules", "LayerNorm": "modules",
    "rms_norm_fp8": "fp8", "rms_norm_fp8_reference": "fp8",
}


def __getattr__(name):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'custom_kernels.norms' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"custom_kernels.norms.{module}"), name)
    globals()[name] = value  # later lookups are plain attribute reads, not this hook
    return value


__all__ = list(_PUBLIC)
