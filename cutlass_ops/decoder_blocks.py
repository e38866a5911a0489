"""Hugging Face decoder layers run as fused blocks: Llama, Mistral, Qwen2, Qwen3, and any layer
built like them, recognised by what it holds (not by its class) and swapped only after a numeric
probe.

A fused layer computes, per token row (``h`` the residual stream)::

    x = input_layernorm(h)                          # the fused RMSNorm kernel (cutlass_ops.nn)
    q, k, v = x @ [Wq; Wk; Wv]^T                    # one GEMM (cutlass_ops.fused_linear)
    q, k = q_norm(q), k_norm(k)                     # Qwen3 only
    q, k = rotary(q, k, cos, sin)                   # one kernel (custom_kernels.rotary)
    a = attention(q, k, v)                          # the model's own attention function
    x, h = post_attention_layernorm(a @ Wo^T, h)    # the residual add inside the norm's pass
    h = swiglu(x @ [Wgate; Wup]^T) @ Wdown^T + h    # one GEMM, one kernel, one GEMM + epilogue

where Hugging Face's forward launches three projections, about ten elementwise kernels for the
rotary embedding, two more for SiLU and the product, and two residual adds. The first residual
add runs in the post-attention norm's kernel, which writes the new residual stream beside the
normalized rows (when the layer's norm is ours, as ``convert`` makes it; else in o_proj's
epilogue), the second in down_proj's epilogue. Eagerly the rotary kernel leaves q in the
projection's memory order, so the attention's output comes back in it and reaches o_proj
without a copy.
The attention itself
(SDPA, flash or eager, the KV cache, sliding windows) is the model's: the fused attention calls
the same ``ALL_ATTENTION_FUNCTIONS`` interface with the same arguments.
The merged and residual GEMMs are the attention's and the MLP's ``BlockGemms``
(``cutlass_ops.block_gemms``: the contract, and the 16-bit default ``fused_linear``'s), held in
each module's ``BlockState`` (``cutlass_ops.module_state``): ``cutlass_ops.fp8``'s FP8 GEMMs
(which add the residual after the GEMM) and the tensor-parallel ones plug in there. In an FP8 block whose recipe quantizes activations per row or
per 1x128 block, the kernels before the GEMMs also write the GEMMs' FP8 input (the same bits
as quantizing their output): both norms (ours, called without hooks; ``RMSNorm.forward_fp8``)
for QKV and gate+up, the SwiGLU kernel (``swiglu_fp8``) for down_proj. o_proj still quantizes
the attention's output itself. In a tensorwise block (one scale a tensor: its amax before any
value) the SwiGLU kernels reduce the amaxes of down_proj's input and of gate+up's output
gradient as they write them (``swiglu_with_amax``); the other inputs are read for their amax.

Nothing the user sees changes: the layer keeps its submodules, parameters and ``state_dict`` (Q,
K and V stay three Parameters; ``fused_linear.pack`` only lays them out end to end in one storage
so that the merged GEMM reads them without a copy), its class is a subclass of the original one
(``isinstance`` checks, gradient checkpointing and ``save_pretrained`` keep working), and
``unfuse`` restores the original class. Moving the model (``.to()``) packs the weights again.
A model holding fused layers cannot be pickled whole (``torch.save(model)``); its
``state_dict`` can, as Hugging Face saves it.

The probe: on random hidden states and rotary angles, the layer's own forward (its converted
norms and Linears included) and the fused one must agree within bf16 tolerance, else the layer
keeps its forward and the report says why (another residual scheme, another activation, a
rotary convention that is not ``rotate_half``...).

Mixture-of-experts layers (Mixtral, Qwen2/3-MoE: an mlp holding ``experts`` and a ``gate``)
fuse their attention half the same way (merged QKV, the rotary kernel, the first residual add in
the post-attention norm's pass); the MoE block runs the model's own forward (routing, experts:
``cutlass_ops.moe``'s grouped GEMMs once ``convert`` swapped them, shared experts), the second
residual added after it. Routing is a step function of its input, so the probe replaces the
MoE block with a fixed linear map on both sides: it checks the fused half and the residual
plumbing, and the MoE block is the same code in both. Its shared experts (dense SwiGLU MLPs
beside the routed ones: Qwen2-MoE's ``shared_expert``, DeepSeek-V3's ``shared_experts``) run as
``FusedMLP`` (gate and up as one GEMM, the SwiGLU kernel) where a probe of their own agrees.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional, Union

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from cutlass_ops import conversion_refusals, fused_linear, mixins, module_state, step_graphs
from cutlass_ops.decode_attention import packed_decode_attention
from cutlass_ops.block_gemms import BF16, BlockGemms, BlockState

# What ``fuse`` asks of a tensor-parallel plan's layer: (attention, mlp or None) -> the GEMMs that
# run it on the local shards, or why not (``cutlass_ops.parallel.sharded_gemms.adopt``).
Adopter = Callable[[nn.Module, Optional[nn.Module]], Union[BlockGemms, str, None]]
from custom_kernels.core.tolerances import relative_error
from custom_kernels.norms import norm_ops
from custom_kernels.norms.modules import LayerNorm, RMSNorm

LAYER_CHILDREN = frozenset({"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"})
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
ATTENTION_NORMS = frozenset({"q_norm", "k_norm"})
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
MLP_CHILDREN = frozenset({*MLP_LINEARS, "act_fn"})
# A mixture-of-experts block (Mixtral, Qwen2/3-MoE, DeepSeek-V3 style) holds at least these; its
# forward (router, experts: cutlass_ops.moe's grouped GEMMs once converted, shared experts) is
# the model's own inside a fused layer.
MOE_CHILDREN = frozenset({"experts", "gate"})
ATTENTION_ATTRIBUTES = ("head_dim", "layer_idx", "scaling", "config", "attention_dropout")
PROBE_TOKENS = 16
PROBE_TOLERANCE = 2e-2  # relative, on the layer's output: GEMMs of other shapes round otherwise
RESIDUAL_NORMS = (RMSNorm, LayerNorm)  # ours: forward(x, residual) -> (norm(x + residual), sum)


# ---------------------------------------------------------------------------------------------
# The fused forwards (mixins placed before the model's own classes)
# ---------------------------------------------------------------------------------------------

class FusedAttention:
    """The attention's forward with Q, K and V as one GEMM and the rotary embedding as one
    kernel. ``project`` computes q, k and v, ``attend_projected`` the cache update and the
    attention; both stop before ``o_proj``, so the fused layer can handle the residual."""

    def project(self, hidden_states, position_embeddings, x_fp8=None):
        """(q, k, v) as [B, H, S, D] (q and k rotated) from the normalized hidden states;
        ``x_fp8``: their FP8 operand (q, scale) for an FP8 QKV GEMM, when the norm wrote it."""
        from custom_kernels.rotary import apply_rotary

        projections = (self.q_proj, self.k_proj, self.v_proj)
        qkv = _gemms(self).merged_linear(hidden_states, [p.weight for p in projections],
                                         fused_linear.merged_bias(projections),
                                         _merged_view(self), **_fp8_input(x_fp8))
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (t.view(hidden_shape) for t in
                   qkv.split([_local_rows(p.weight) for p in projections], dim=-1))
        if getattr(self, "q_norm", None) is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = position_embeddings
        q, k = apply_rotary(q, k, cos, sin)
        return q, k, v.transpose(1, 2)

    def attend_projected(self, q, k, v, input_shape, attention_mask, cache, **kwargs):
        """The KV cache's update and the model's own attention function on (q, k, v); returns
        ([*input_shape, heads * head_dim], the attention weights or None)."""
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        if q.shape[2] == 1 and not self.training and self.config._attn_implementation == "sdpa":
            out = packed_decode_attention(q, k, v, attention_mask, self.scaling,
                                          getattr(self, "num_key_value_groups", 1), **kwargs)
            if out is not None:  # a decode step: the cache read once, not repeated per head
                return out.reshape(*input_shape, -1), None
        namespace = sys.modules[self._hf_class.__module__]
        interface = namespace.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, namespace.eager_attention_forward)
        out, weights = interface(
            self, q, k, v, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, sliding_window=_sliding_window(self), **kwargs)
        return out.reshape(*input_shape, -1), weights

    def attend(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs):
        q, k, v = self.project(hidden_states, position_embeddings)
        return self.attend_projected(q, k, v, hidden_states.shape[:-1], attention_mask, cache,
                                     **kwargs)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, cache=None, **kwargs):
        out, weights = self.attend(hidden_states, position_embeddings, attention_mask,
                                   cache if cache is not None else past_key_values, **kwargs)
        return self.o_proj(out), weights

    def _apply(self, fn, *args, **kwargs):
        result = super()._apply(fn, *args, **kwargs)
        fused_linear.pack([self.q_proj, self.k_proj, self.v_proj])
        return result

    def __setstate__(self, state):
        # copy.deepcopy and unpickling: each Parameter arrives in a storage of its own
        # (Parameter.__deepcopy__ clones one by one); packed again, a copy runs the one-GEMM
        # path as the original does (same bits, same speed), not the per-weight one.
        super().__setstate__(state)
        fused_linear.pack([self.q_proj, self.k_proj, self.v_proj])


class FusedMLP:
    """``down(silu(gate(x)) * up(x))`` with gate and up as one GEMM and SwiGLU as one kernel."""

    def gate_up(self, x, x_fp8=None, **amaxes):
        """``x @ [Wgate; Wup]^T`` as one GEMM; ``x_fp8``: x's FP8 operand when the norm wrote
        it; ``amaxes``: ``grad_amax`` for a tensorwise FP8 GEMM (``residual_forward``)."""
        pair = (self.gate_proj, self.up_proj)
        return _gemms(self).merged_linear(x, [p.weight for p in pair],
                                          fused_linear.merged_bias(pair), _merged_view(self),
                                          **_fp8_input(x_fp8), **amaxes)

    def activated(self, x, x_fp8=None):
        from custom_kernels.swiglu import swiglu

        return swiglu(self.gate_up(x, x_fp8))

    def residual_forward(self, x, residual, x_fp8=None):
        """``forward(x) + residual``, the residual added in down_proj's GEMM (after it, FP8).
        In an FP8 MLP whose recipe takes it, the SwiGLU kernel also writes down_proj's FP8
        input; in a tensorwise one, it reduces the amaxes of its output and (backward) of
        gate+up's output gradient, which the FP8 GEMMs' quantization then need not read for."""
        from custom_kernels.fp8.grad_amax import GradAmax
        from custom_kernels.swiglu import swiglu, swiglu_fp8, swiglu_with_amax

        gemms, down = _gemms(self), self.down_proj
        if gemms.takes_amaxes and not torch.compiler.is_compiling():
            slot = GradAmax()
            y, amax = swiglu_with_amax(self.gate_up(x, x_fp8, grad_amax=slot), grad_amax=slot)
            return gemms.linear_residual(y, down.weight, down.bias, residual, x_amax=amax)
        gate_up = self.gate_up(x, x_fp8)
        fp8 = gemms.input_fp8
        if fp8 is None:
            return gemms.linear_residual(swiglu(gate_up), down.weight, down.bias, residual)
        y, q, scale = swiglu_fp8(gate_up, fp8[0], fp8_dtype=fp8[1])
        return gemms.linear_residual(y, down.weight, down.bias, residual, x_fp8=(q, scale))

    def forward(self, x):
        return self.down_proj(self.activated(x))

    def _apply(self, fn, *args, **kwargs):
        result = super()._apply(fn, *args, **kwargs)
        fused_linear.pack([self.gate_proj, self.up_proj])
        return result

    def __setstate__(self, state):  # as FusedAttention's
        super().__setstate__(state)
        fused_linear.pack([self.gate_proj, self.up_proj])


class FusedDecoderLayer:
    """The pre-norm decoder layer with both residual adds fused. Takes the cache as ``cache``
    (transformers >= 5.2x) or ``past_key_values`` (earlier 5.x). At decode steps the stretches
    before and after the attention replay CUDA graphs (``cutlass_ops.step_graphs``)."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None,
                past_key_values=None, use_cache=False, position_embeddings=None, cache=None,
                **kwargs):
        cache = cache if cache is not None else past_key_values
        graphs = _step_graphs(self, hidden_states, position_embeddings, cache)
        if graphs is not None:
            q, k, v = graphs.before(hidden_states, position_embeddings)
        else:
            q, k, v = self.before_attention(hidden_states, position_embeddings)
        a, _ = self.self_attn.attend_projected(q, k, v, hidden_states.shape[:-1],
                                               attention_mask, cache, position_ids=position_ids,
                                               use_cache=use_cache, **kwargs)
        if graphs is not None:
            return graphs.after(a)
        return self.after_attention(a, hidden_states)

    def before_attention(self, hidden_states, position_embeddings):
        """(q, k, v) of the layer input: the input norm, the QKV GEMM, the rotary kernel."""
        attention, norm = self.self_attn, self.input_layernorm
        fp8 = _norm_fp8(norm, attention, hidden_states)
        if fp8 is None:
            return attention.project(norm(hidden_states), position_embeddings)
        x, q, scale = norm.forward_fp8(hidden_states, fp8[0], fp8_dtype=fp8[1])
        return attention.project(x, position_embeddings, x_fp8=(q, scale))

    def after_attention(self, a, hidden_states):
        """The layer output from the attention output ``a`` and the layer input."""
        mlp, o, norm = self.mlp, self.self_attn.o_proj, self.post_attention_layernorm
        x_fp8 = None
        if isinstance(norm, RESIDUAL_NORMS):  # h = o_proj(a) + hidden_states, then x = norm(h)
            # o_proj as the GEMMs run it (tensor parallel: the ranks' partial sums reduced)
            attended = _gemms(self.self_attn).output_projection(o, a)
            fp8 = _norm_fp8(norm, mlp, attended, hidden_states)
            if fp8 is None:
                x, h = norm(attended, hidden_states)
            else:
                x, q, scale, h = norm.forward_fp8(attended, fp8[0], hidden_states,
                                                  fp8_dtype=fp8[1])
                x_fp8 = (q, scale)
        else:
            h = _gemms(self.self_attn).linear_residual(a, o.weight, o.bias, hidden_states)
            x = norm(h)
        return mlp.residual_forward(x, h, x_fp8)


class FusedMoEMLP:
    """A mixture-of-experts block inside a fused layer: the model's own forward, the residual
    added after it (the layer's attention half is the fused one)."""

    def residual_forward(self, x, residual, x_fp8=None):
        out = self(x)  # x_fp8: the experts stay 16-bit
        if isinstance(out, tuple):  # (hidden states, router logits) in some versions
            out = out[0]
        return out + residual


class _LayerGraphs:
    """A fused layer's two captured stretches for one input signature: ``before`` reads the
    layer input and the step's cos / sin, ``after`` the attention output and the layer input
    (``before``'s buffer, which still holds it)."""

    def __init__(self, layer, hidden_states, cos, sin):
        self.hidden = hidden_states.clone()
        self.rotary = (cos, sin)  # the step's shared buffers (step_graphs.shared)
        self.attention = hidden_states.new_empty(
            (*hidden_states.shape[:-1], layer.self_attn.o_proj.in_features))
        self.before_segment = step_graphs.Segment(
            lambda: layer.before_attention(self.hidden, self.rotary), [self.hidden])
        self.after_segment = step_graphs.Segment(
            lambda: layer.after_attention(self.attention, self.hidden), [self.attention])

    def before(self, hidden_states, position_embeddings):
        step_graphs.shared.get("rotary", position_embeddings)  # fills self.rotary's buffers
        return self.before_segment(hidden_states)

    def after(self, a):
        # The output leaves the layer (the next layer's input, hidden states a caller may keep):
        # a copy, since the next replay overwrites the graph's buffer.
        return self.after_segment(a).clone()


def _step_graphs(layer, hidden_states, position_embeddings, cache) -> _LayerGraphs | None:
    """The layer's graphs for this call (captured on the second call of a signature), or None:
    run eagerly. Only for caches of Hugging Face's own classes, which copy the k and v they are
    given (the graph's buffers) into their own storage."""
    if position_embeddings is None or (cache is not None and not _copying_cache(cache)) or \
            _gemms(layer.self_attn).collectives:  # collectives stay out of the graphs
        return None
    cos, sin = position_embeddings
    if not step_graphs.eligible(hidden_states, cos, sin) or _hooked(layer):
        return None
    holder = module_state.ensure(layer, step_graphs.Holder)
    key = step_graphs.signature(hidden_states, cos, sin)
    graphs = holder.lookup(key, _weight_pointers(layer))
    if graphs is None and holder.should_capture(key):
        rotary = step_graphs.shared.get("rotary", position_embeddings)
        graphs = holder.capture(key, lambda: _LayerGraphs(layer, hidden_states, *rotary))
    return None if graphs is step_graphs.EAGER else graphs


def _copying_cache(cache) -> bool:
    return type(cache).__module__.startswith("transformers.")


def _graphed_modules(layer):
    attention = layer.self_attn
    moe = tuple(layer.mlp.modules()) if isinstance(layer.mlp, FusedMoEMLP) else ()
    return (layer.input_layernorm, layer.post_attention_layernorm, attention.o_proj,
            getattr(attention, "q_norm", None), getattr(attention, "k_norm", None), *moe)


def _hooked(layer) -> bool:
    """Hooks on a module a graph calls would run at capture only: such a layer runs eagerly."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    return any(m is not None and (m._forward_hooks or m._forward_pre_hooks)
               for m in _graphed_modules(layer))


def _weight_pointers(layer) -> tuple:
    """The addresses of every parameter the graphs read (a graph keeps addresses, not tensors:
    parameters moved or replaced invalidate it). A walk of the modules' own dicts: a quarter of
    ``parameters()``'s cost, paid on every call. With GEMMs of its own (FP8: the graphs read
    copies made from the weights' values), each parameter's version too: a weight changed in
    place drops the graphs, and the next eager call refreshes the copies."""
    versions = any(_gemms(m).copies_weights for m in (layer.self_attn, layer.mlp))

    def walk(module, out):
        for p in module._parameters.values():
            if p is not None:
                out.append(p.data_ptr())
                if versions:
                    out.append(-1 if p.is_inference() else p._version)
        for child in module._modules.values():
            if child is not None:
                walk(child, out)
        return out
    return tuple(walk(layer, []))


def _gemms(module) -> BlockGemms:
    """The module's merged / residual GEMMs (its ``BlockState``'s; the 16-bit ones if none)."""
    state = module_state.get(module, BlockState)
    return BF16 if state is None else state.gemms


def gemms_of(module: nn.Module) -> BlockGemms:
    """A fused attention's or MLP's GEMMs (``cutlass_ops.block_gemms``)."""
    return _gemms(module)


def set_gemms(module: nn.Module, gemms: BlockGemms | None) -> None:
    """A fused attention's or MLP's GEMMs made ``gemms`` (FP8, tensor parallel), or its own
    16-bit ones again with None; its packed-weight view starts afresh."""
    module_state.put(module, BlockState(BF16 if gemms is None else gemms))


def _fp8_input(x_fp8) -> dict:
    """The GEMM's keyword for an FP8 input the caller has (none otherwise: fused_linear's
    GEMMs take no such argument)."""
    return {} if x_fp8 is None else {"x_fp8": x_fp8}


def _norm_fp8(norm, module, x, residual=None):
    """(granularity, FP8 dtype) of the input ``module``'s FP8 GEMMs read when ``norm`` can
    write it beside its output for this call, else None (the norm's plain call): ``module``'s
    GEMMs take one (``FusedGemms.input_fp8``), the norm has ``forward_fp8`` (our RMSNorm) and
    no hooks (``forward_fp8`` is not ``__call__``), and its kernel takes the inputs (off a GPU
    the reference runs, as for ``norm(x)``)."""
    fp8 = _gemms(module).input_fp8
    if fp8 is None or not hasattr(norm, "forward_fp8") or norm.weight is None or \
            len(norm.normalized_shape) != 1:
        return None
    if norm._forward_hooks or norm._forward_pre_hooks or \
            torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return None
    why = norm_ops.refusal("rms", x, norm.weight, None, residual, norm.out_dtype)
    return fp8 if why is None or isinstance(why, norm_ops.OffCuda) else None


def _local_rows(weight) -> int:
    """A projection's output features on this rank (a DTensor weight's local shard)."""
    return weight.to_local().shape[0] if hasattr(weight, "to_local") else weight.shape[0]


def _merged_view(module) -> fused_linear.MergedView:
    """The module's kept view of its packed weights (its ``BlockState``'s)."""
    return module_state.ensure(module, BlockState).view


def _sliding_window(attention):
    """Qwen2 and Qwen3 keep it per layer (None on full-attention layers); Mistral reads its
    config's; Llama has none."""
    if hasattr(attention, "sliding_window"):
        return attention.sliding_window
    return getattr(attention.config, "sliding_window", None)


def _fused_class(mixin: type, cls: type) -> type:
    return mixins.fused_class(mixin, cls, "as a fused block")


# ---------------------------------------------------------------------------------------------
# Recognition, probe, swap
# ---------------------------------------------------------------------------------------------

def is_fused(layer: nn.Module) -> bool:
    return isinstance(layer, FusedDecoderLayer)


def has_moe_mlp(layer: nn.Module) -> bool:
    """The layer's mlp is a mixture-of-experts block (``MOE_CHILDREN``), not a dense MLP."""
    return MOE_CHILDREN <= frozenset(name for name, _ in layer.mlp.named_children())


def looks_like_decoder_layer(module: nn.Module) -> bool:
    """Holds exactly a self_attn, an mlp and the two norms of a pre-norm decoder layer."""
    return not is_fused(module) and \
        frozenset(name for name, _ in module.named_children()) == LAYER_CHILDREN


def structure_refusal(layer: nn.Module, require_gpu: bool = True) -> str | None:
    """Why ``layer`` is not built like a Llama-style decoder layer we can fuse, or None.
    ``require_gpu=False`` skips the device, dtype and GPU checks (the fused forward then runs
    the kernels' torch fallbacks: for tests of the block's arithmetic on the CPU)."""
    if not looks_like_decoder_layer(layer):
        return (f"its submodules are {sorted(n for n, _ in layer.named_children())}, not "
                f"{sorted(LAYER_CHILDREN)}")
    attention, mlp = layer.self_attn, layer.mlp
    names = frozenset(n for n, _ in attention.named_children())
    if not set(ATTENTION_LINEARS) <= names or names - set(ATTENTION_LINEARS) - ATTENTION_NORMS \
            or len(names & ATTENTION_NORMS) == 1:
        return (f"self_attn holds {sorted(names)}: not q/k/v/o projections (with an optional "
                "q_norm and k_norm pair)")
    missing = [a for a in ATTENTION_ATTRIBUTES if not hasattr(attention, a)]
    if missing:
        return f"self_attn has no {', '.join(missing)}"
    namespace = sys.modules.get(type(attention).__module__)
    if not (hasattr(namespace, "ALL_ATTENTION_FUNCTIONS") and
            hasattr(namespace, "eager_attention_forward") and
            hasattr(getattr(namespace, "ALL_ATTENTION_FUNCTIONS"), "get_interface")):
        return "its attention's module has no ALL_ATTENTION_FUNCTIONS.get_interface and " \
            "eager_attention_forward (transformers 5.x)"
    children = frozenset(n for n, _ in mlp.named_children())
    moe = MOE_CHILDREN <= children
    if not moe and children != MLP_CHILDREN:
        return (f"mlp holds {sorted(children)}: neither a dense MLP ({sorted(MLP_CHILDREN)}) "
                f"nor a mixture of experts (at least {sorted(MOE_CHILDREN)})")
    return _linear_refusal(attention, None if moe else mlp, require_gpu)


def _linear_refusal(attention, mlp, require_gpu: bool) -> str | None:
    """``mlp``: the dense MLP, or None for a mixture-of-experts block (its forward is the
    model's: only the attention's projections are fused)."""
    linears = {n: getattr(attention, n) for n in ATTENTION_LINEARS}
    if mlp is not None:
        linears.update({n: getattr(mlp, n) for n in MLP_LINEARS})
    for name, layer in linears.items():
        if not isinstance(layer, nn.Linear):
            return f"{name} is a {type(layer).__name__}, not a Linear"
    weight = linears["q_proj"].weight
    if any(layer.weight.dtype != weight.dtype for layer in linears.values()):
        return "its projections do not share one dtype"
    why = _device_refusal(weight) if require_gpu else None
    return why or _shape_refusal(linears, attention.head_dim)


def _device_refusal(weight) -> str | None:
    return conversion_refusals.weight_refusal(weight, kernels="the fused blocks", sm90=True)


def _shape_refusal(linears, head_dim) -> str | None:
    hidden = linears["q_proj"].in_features
    if any(linears[n].in_features != hidden for n in ("k_proj", "v_proj", "gate_proj",
                                                       "up_proj") if n in linears):
        return "q/k/v and gate/up do not read the same hidden size"
    if "gate_proj" in linears and \
            linears["gate_proj"].out_features != linears["up_proj"].out_features:
        return "gate_proj and up_proj differ in width"
    if not isinstance(head_dim, int) or head_dim % 2 or head_dim > 256:
        return f"head_dim {head_dim}: the rotary kernel takes even head sizes up to 256"
    return None


def fuse(layer: nn.Module, *, require_gpu: bool = True, adopt: Adopter | None = None) -> str | None:
    """Makes ``layer`` a fused block in place, after the probe; returns None when done, else
    why not (the layer is then unchanged). ``require_gpu``: see ``structure_refusal``.
    ``adopt``: for weights a tensor-parallel plan sharded (DTensors), the GEMMs that run the
    block on the local shards, or why not (``cutlass_ops.parallel.sharded_gemms.adopt``,
    which ``convert`` passes); without it such a layer is refused."""
    why = structure_refusal(layer, require_gpu)
    if why is not None:
        return why
    attention, mlp = layer.self_attn, layer.mlp
    moe = has_moe_mlp(layer)
    originals = (layer.__class__, attention.__class__, mlp.__class__)
    fused_linear.pack([attention.q_proj, attention.k_proj, attention.v_proj])
    if not moe:
        fused_linear.pack([mlp.gate_proj, mlp.up_proj])
    for module in (attention,) if moe else (attention, mlp):  # made here, not inside a trace
        _merged_view(module)
    # Weights a tensor-parallel plan sharded (DTensors): the block runs on the local shards.
    gemms = _adopted(attention, None if moe else mlp, adopt)
    if isinstance(gemms, str):
        return gemms
    layer.__class__ = _fused_class(FusedDecoderLayer, originals[0])
    attention.__class__ = _fused_class(FusedAttention, originals[1])
    mlp.__class__ = _fused_class(FusedMoEMLP if moe else FusedMLP, originals[2])
    if gemms is not None:
        shard(layer, gemms)
    try:
        why = probe(layer, originals)
    except Exception as exc:  # a forward that takes other arguments, say: keep the layer's own
        why = f"the probe failed: {type(exc).__name__}: {exc}"
    if why is not None:
        layer.__class__, attention.__class__, mlp.__class__ = originals
        if gemms is not None:
            shard(layer, None)
    elif moe:
        for shared in shared_expert_mlps(mlp).values():
            _fuse_dense_mlp(shared)
    return why


def _adopted(attention, mlp, adopt: Adopter | None):
    """``adopt``'s GEMMs for a layer whose weights are DTensors (or its refusal), else None."""
    modules = (attention, mlp) if mlp is not None else (attention,)
    sharded = any(hasattr(p, "placements") for m in modules for p in m.parameters())
    if not sharded:
        return None
    if adopt is None:
        return "tensor-parallel (DTensor) weights: fused through cutlass_ops.convert only"
    return adopt(attention, mlp)


def shard(layer: nn.Module, gemms: BlockGemms | None) -> None:
    """The fused ``layer``'s GEMMs made ``gemms`` (``parallel.sharded_gemms``' GEMMs: its
    weights are a tensor-parallel plan's shards), or back to its own with None."""
    for module in (layer.self_attn, layer.mlp):
        if gemms is None or not has_moe_mlp(layer) or module is layer.self_attn:
            set_gemms(module, gemms)


def shared_expert_mlps(mlp: nn.Module) -> dict:
    """A mixture of experts' dense MLPs beside its routed experts (Qwen2-MoE's
    ``shared_expert``, DeepSeek-V3's ``shared_experts``): its children built like a dense MLP
    (``MLP_CHILDREN``), by name."""
    return {name: child for name, child in mlp.named_children()
            if frozenset(n for n, _ in child.named_children()) == MLP_CHILDREN}


def _fuse_dense_mlp(mlp: nn.Module) -> str | None:
    """A dense MLP of its own (a shared expert) made a ``FusedMLP`` (gate and up as one GEMM,
    the SwiGLU kernel) after its own probe; returns None when done, else why not (unchanged)."""
    linears = {n: getattr(mlp, n) for n in MLP_LINEARS}
    if not all(isinstance(layer, nn.Linear) for layer in linears.values()):
        return "its projections are not Linears"
    if linears["gate_proj"].out_features != linears["up_proj"].out_features or \
            len({layer.weight.dtype for layer in linears.values()}) != 1:
        return "gate_proj and up_proj differ in width or dtype"
    original = mlp.__class__
    fused_linear.pack([mlp.gate_proj, mlp.up_proj])
    _merged_view(mlp)
    mlp.__class__ = _fused_class(FusedMLP, original)
    try:
        why = _probe_mlp(mlp, original)
    except Exception as exc:  # noqa: BLE001 - keep the module's own forward
        why = f"the probe failed: {type(exc).__name__}: {exc}"
    if why is not None:
        mlp.__class__ = original
    return why


def _probe_mlp(mlp: nn.Module, original: type) -> str | None:
    """None when a fused dense MLP computes what its own forward does on random rows (and its
    activation is SiLU), else what differs."""
    weight = mlp.gate_proj.weight
    device, dtype = weight.device, weight.dtype
    why = _activation_refusal(mlp.act_fn, device, dtype)
    if why is not None:
        return why
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        x = torch.randn(PROBE_TOKENS, mlp.gate_proj.in_features, generator=generator,
                        device=device).to(dtype)
        ours = mlp(x)
        current = mlp.__class__
        mlp.__class__ = original
        try:
            theirs = mlp(x)
        finally:
            mlp.__class__ = current
    error = relative_error(ours, theirs)
    if not error <= PROBE_TOLERANCE:
        return f"the fused MLP differs from its own forward by {error:.3g} (relative)"
    return None


def unfuse(layer: nn.Module) -> None:
    """Restores the classes ``fuse`` replaced (the packed weights stay packed: same values)."""
    for module in (layer, layer.self_attn, layer.mlp, *layer.mlp.children()):
        if hasattr(type(module), "_hf_class"):
            module.__class__ = type(module)._hf_class
        module_state.drop(module, BlockState)
    module_state.drop(layer, step_graphs.Holder)


def probe(layer: nn.Module, originals) -> str | None:
    """None when the fused forward computes what the layer's own forward does, on random
    hidden states and rotary angles (no mask: causal attention), else what differs."""
    weight = layer.self_attn.q_proj.weight
    device, dtype = weight.device, weight.dtype
    moe = isinstance(layer.mlp, FusedMoEMLP)
    why = None if moe else _activation_refusal(layer.mlp.act_fn, device, dtype)
    if why is not None:
        return why
    generator = torch.Generator(device=device).manual_seed(0)
    hidden = layer.self_attn.q_proj.in_features
    head_dim = layer.self_attn.head_dim
    # A mixture of experts runs the model's own forward on both sides, but its routing is a
    # step function of its input: the attention half's rounding could send a token to other
    # experts and fail a correct block. A fixed linear map stands in for it during the probe.
    stand_in = None
    if moe:
        mix = torch.randn(hidden, hidden, generator=generator, device=device) / hidden ** 0.5
        stand_in = mix.to(dtype)
    with torch.no_grad(), _mlp_replaced(layer.mlp, stand_in):
        x = torch.randn(2, PROBE_TOKENS, hidden, generator=generator, device=device).to(dtype)
        positions = torch.arange(PROBE_TOKENS, device=device)
        inverse = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=device) / head_dim))
        angles = (positions[:, None].float() * inverse[None, :]).repeat(1, 2)
        cos, sin = (f(angles)[None].expand(2, -1, -1).to(dtype).contiguous()
                    for f in (torch.cos, torch.sin))
        arguments = dict(attention_mask=None, position_ids=positions[None].expand(2, -1),
                         position_embeddings=(cos, sin))
        ours = layer(x, **arguments)
        theirs = _with_classes(layer, originals, lambda: layer(x, **arguments))
    if not isinstance(theirs, torch.Tensor):
        return (f"its forward returns a {type(theirs).__name__}, not the hidden states "
                "(a transformers version before 5?)")
    # The layer's update, not its output: the residual stream passes through both unchanged
    # and would dilute any difference.
    error = relative_error(ours - x, theirs - x)
    if not error <= PROBE_TOLERANCE:
        return (f"the fused block's update differs from the layer's own by {error:.3g} "
                f"(relative; the tolerance is {PROBE_TOLERANCE:g}): left to the layer's forward")
    return None


def _activation_refusal(act_fn, device, dtype) -> str | None:
    """Why an MLP's activation is not SiLU, or None: compared on its own over a range where
    SiLU, GELU and ReLU part clearly (on a layer's output a small-weight model would hide the
    difference)."""
    z = torch.linspace(-8.0, 8.0, 257, device=device, dtype=dtype)
    with torch.no_grad():
        error = relative_error(act_fn(z), torch.nn.functional.silu(z))
    if not error <= PROBE_TOLERANCE:
        return (f"its MLP activation ({type(act_fn).__name__}) is not SiLU (relative "
                f"difference {error:.3g}): the fused block is SwiGLU's")
    return None


class _mlp_replaced:
    """Within the block, ``mlp`` computes ``x @ matrix`` (its own forward when None)."""

    def __init__(self, mlp, matrix):
        self.mlp, self.matrix = mlp, matrix

    def __enter__(self):
        if self.matrix is not None:
            self.mlp.forward = lambda x: x @ self.matrix

    def __exit__(self, *exc):
        if self.matrix is not None:
            del self.mlp.forward


def _with_classes(layer, classes, run):
    """Runs ``run`` with the layer, its attention and its MLP back in ``classes``."""
    modules = (layer, layer.self_attn, layer.mlp)
    current = tuple(m.__class__ for m in modules)
    try:
        for module, cls in zip(modules, classes):
            module.__class__ = cls
        return run()
    finally:
        for module, cls in zip(modules, current):
            module.__class__ = cls


__all__ = ["fuse", "unfuse", "is_fused", "looks_like_decoder_layer", "has_moe_mlp",
           "shared_expert_mlps",
           "structure_refusal", "probe", "FusedAttention", "FusedMLP", "FusedMoEMLP",
           "FusedDecoderLayer"]
