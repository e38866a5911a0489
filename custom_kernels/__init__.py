"""Hand-written CUDA C++ kernels (fused norms, reductions, work queues), compiled with NVRTC.

The kernel families arrive with their issues; this package holds their .cu sources and launchers.
"""

# Public functions, imported on first use (importing this package loads neither torch nor CUDA).
_LAZY = {
    "clip_grad_norm_": "custom_kernels.clip_grad",
    "segment_sum": "custom_kernels.ragged",
    "segment_mean": "custom_kernels.ragged",
    "apply_rotary": "custom_kernels.rotary",
    "launch_cooperative": "custom_kernels.cooperative",
    "launch_persistent": "custom_kernels.work_queue",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'custom_kernels' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups are plain attribute reads, not this hook
    return value
