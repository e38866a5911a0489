"""Hand-written CUDA C++ kernels (fused norms, reductions, work queues), compiled with NVRTC.

The kernel families arrive with their issues; this package holds their .cu sources and launchers.
"""
