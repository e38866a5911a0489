"""Fused RMSNorm and LayerNorm (with residual; forward and backward): one kernel family.

``norm_config`` (launch configs, pure data) -> ``norm_ops`` (plans, torch.library ops, autograd, the public
functions and the references) -> ``modules`` (nn drop-ins); ``fp8`` (RMSNorm that also writes its
output in FP8, over ``norm_ops``); ``tuned`` reads the norm tuner's stored winners. Public names load
on first use, so that importing ``norm_config`` loads no torch.
"""

_PUBLIC = {
    "rms_norm": "norm_ops", "layer_norm": "norm_ops", "rms_norm_reference": "norm_ops",
    "layer_norm_reference": "norm_ops", "why_unsupported": "norm_ops", "precompile": "norm_ops",
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
