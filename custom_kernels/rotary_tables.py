"""The rotary embedding's cos / sin tables in one launch (``csrc/rotary_tables.cu``).

``rotary_tables(inv_freq, position_ids, scaling, dtype)`` returns ``(cos, sin)``, each
``[*position_ids.shape, 2 * len(inv_freq)]`` in ``dtype``: what Hugging Face's
``...RotaryEmbedding.forward`` computes for the static RoPE types,

    freqs = position_ids[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)

with the same roundings, so the same bits (the kernel's header says how). In torch that is eight
launches of a few microseconds of GPU time each, and more host time than GPU time:
at the start of a train step or a prefill, when the GPU has nothing queued yet, and at every
decode step. Here it is one launch.

Values: ``inv_freq`` a 1-D float32 tensor (or bf16 / fp16, a model cast with its buffers:
widened exactly, as Hugging Face's ``.float()``); ``position_ids`` int64 or int32 (any shape; copied
to contiguous int64 when not: it is small); ``dtype`` bf16, fp16 or fp32; ``scaling`` a Python
float, applied in float32. Positions are exact in float32 below 2**24, as torch's conversion.
Input refused on every device, with UnsupportedInputError: another dtype, a 2-D ``inv_freq``,
tensors on different devices.

Eagerly with plain tensors the launcher is called directly; otherwise (torch.compile, fake or
subclass tensors, dispatch modes) the custom op ``custom_kernels::rotary_tables`` with its fake.
No gradient: the tables are a function of a buffer and integer positions (Hugging Face computes
them under ``no_grad``). Everything runs on torch's current stream, with no host sync, and in
CUDA graphs (run once before capturing: the kernel is compiled and loaded on first use). Tensors
off a CUDA device run ``torch_tables``, the formula above (the CPU rule,
``custom_kernels.core.fallback``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from custom_kernels import jit
from custom_kernels.core import elements, fallback
from custom_kernels.core.eager import plain_eager
from custom_kernels.core.errors import UnsupportedInputError
from custom_kernels.launch import launch

SOURCE = "rotary_tables.cu"
KERNEL = "rotary_tables_kernel"
BLOCK = 256
DTYPE_CODES = elements.float_codes()
POSITION_DTYPES = (torch.int64, torch.int32)


@functools.lru_cache(maxsize=None)
def _kernel(dtype_code: int, freq_code: int, device: int):
    """The loaded kernel; cached here too, which saves get_kernel's key normalisation."""
    return jit.get_kernel(SOURCE, KERNEL, device=device,
                          defines={"DTYPE": dtype_code, "FREQ_DTYPE": freq_code})


def _launch(inv_freq, positions, cos, sin, scaling: float) -> None:
    """positions: contiguous int64; cos / sin: contiguous, ``positions.numel()`` rows."""
    rows, half = positions.numel(), inv_freq.shape[0]
    device = positions.device.index
    launch(_kernel(DTYPE_CODES[cos.dtype], DTYPE_CODES[inv_freq.dtype], device), positions.data_ptr(), inv_freq.data_ptr(),
           cos.data_ptr(), sin.data_ptr(), rows, half, np.float32(scaling),
           grid=-(-rows * half // BLOCK), block=BLOCK, device=device)


def compile_rotary_tables(dtype: str = "bfloat16", freq_dtype: str = "float32",
                          arch: str = jit.DEFAULT_ARCH) -> Path:
    """The cubin that ``rotary_tables`` runs for tables of ``dtype`` from an ``inv_freq`` of
    ``freq_dtype`` (nothing else is compiled in)."""
    defines = {"DTYPE": elements.element(dtype).code,
               "FREQ_DTYPE": elements.element(freq_dtype).code}
    return jit.compile_cubin(SOURCE, defines=defines, name_expressions=(KERNEL,), arch=arch)


def _check(inv_freq, position_ids, dtype, entry: str) -> None:
    if inv_freq.dim() != 1 or inv_freq.dtype not in DTYPE_CODES:
        raise UnsupportedInputError(f"{entry}: inv_freq must be a 1-D float tensor, got "
                                    f"{inv_freq.dtype} of shape {tuple(inv_freq.shape)}")
    if position_ids.dtype not in POSITION_DTYPES:
        raise UnsupportedInputError(f"{entry}: position_ids must be int64 or int32, got "
                                    f"{position_ids.dtype}")
    if dtype not in DTYPE_CODES:
        raise UnsupportedInputError(f"{entry}: tables are bf16, fp16 or float32, not {dtype}")
    fallback.common_device({"inv_freq": inv_freq, "position_ids": position_ids}, entry)


def _empty_tables(inv_freq, position_ids, dtype):
    shape = (*position_ids.shape, 2 * inv_freq.shape[0])
    return (torch.empty(shape, dtype=dtype, device=position_ids.device),
            torch.empty(shape, dtype=dtype, device=position_ids.device))


def _impl(inv_freq, position_ids, scaling: float, dtype):
    cos, sin = _empty_tables(inv_freq, position_ids, dtype)
    if cos.numel():
        _launch(inv_freq.contiguous(), position_ids.to(torch.int64).contiguous(), cos, sin,
                scaling)
    return cos, sin


@torch.library.custom_op("custom_kernels::rotary_tables", mutates_args=())
def rotary_tables_op(inv_freq: torch.Tensor, position_ids: torch.Tensor, scaling: float,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (cos, sin), contiguous ``[*position_ids.shape, 2 * len(inv_freq)]``."""
    _check(inv_freq, position_ids, dtype, "custom_kernels::rotary_tables")
    if not position_ids.is_cuda:
        return torch_tables(inv_freq, position_ids, scaling, dtype)
    return _impl(inv_freq, position_ids, scaling, dtype)


@rotary_tables_op.register_fake
def _(inv_freq, position_ids, scaling, dtype):
    _check(inv_freq, position_ids, dtype, "custom_kernels::rotary_tables")
    return _empty_tables(inv_freq, position_ids, dtype)


def rotary_tables(inv_freq: torch.Tensor, position_ids: torch.Tensor, scaling: float = 1.0,
                  dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of the rotary embedding at ``position_ids`` (see the module docstring)."""
    entry = "custom_kernels.rotary_tables"
    _check(inv_freq, position_ids, dtype, entry)
    if fallback.off_cuda({"inv_freq": inv_freq, "position_ids": position_ids}, entry,
                         "the torch formula"):
        return torch_tables(inv_freq, position_ids, scaling, dtype)
    if torch.compiler.is_compiling() or not plain_eager(inv_freq, position_ids):
        return torch.ops.custom_kernels.rotary_tables(inv_freq, position_ids, float(scaling),
                                                      dtype)
    return _impl(inv_freq, position_ids, float(scaling), dtype)


def torch_tables(inv_freq, position_ids, scaling: float, dtype):
    """Hugging Face's formula in torch (float32, then one cast)."""
    freqs = position_ids[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


__all__ = ["rotary_tables", "compile_rotary_tables", "torch_tables"]
