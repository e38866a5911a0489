"""Greedy decoding with a static KV cache, each decode step one CUDA graph, the token loop on
the device.

At batch 1 to 16 a decode step's kernels take a few microseconds each, and a step of Python
(the modules, the cache update, the mask, the sampling, ``generate()``'s bookkeeping) takes longer
than the GPU's work. ``step_graphs`` captures the stretches between the attention calls; this
module captures the whole step: the embedding, every layer with its attention and its KV-cache
update, the head, the choice of the next token and the bookkeeping, into one CUDA graph that reads
its input token from a buffer and writes the next one back there. ``generate()`` then replays that
graph once per token without waiting for the GPU: one launch a token, and a single host sync at
the end.

What makes the step capturable is Hugging Face's ``StaticCache``: its keys and values are
preallocated to ``max_cache_len`` positions and its write position is a device tensor it advances
in place, so every step has the same shapes and reads where to write from the GPU. The attention
covers all ``max_cache_len`` positions under a mask (the causal mask hides those not written yet),
as Hugging Face's own static-cache ``generate()`` does.

What a user sees (``generate(model, input_ids, max_new_tokens=...)``):
- **Greedy decoding** with ``generate(do_sample=False)``'s meaning: the argmax token, ``pad``
  after a sequence's end-of-sequence token, the output trimmed where every sequence has ended,
  ``min_new_tokens`` holding the end-of-sequence tokens back. Nothing else of ``generate()``'s
  options (sampling, beams, logits processors): use ``model.generate`` for those.
- **Left-padded prompts** through ``attention_mask`` (zeros before each prompt), positions counted
  as ``generate()`` counts them.
- **The first call of a batch size and cache length** runs its first decode step eagerly (it
  loads the kernels) and captures the step; later calls replay from their first step. The cache
  length is the prompt plus ``max_new_tokens`` rounded up to ``CACHE_ROUNDING``, so prompts of
  other lengths reuse the graph. At most ``max_sessions`` (batch, length) pairs are kept, the
  oldest dropped with its cache; ``memory_bytes()`` says what the caches and graphs hold.
- **Refusals** (``CaptureRefused`` naming the reason): a step that synchronizes with the host or
  otherwise cannot be captured, and sliding-window caches (``cache_refusal``: Hugging Face keeps
  their length in a Python int, which a replay would not advance). ``on_refusal="eager"`` decodes such a model step by step instead
  (the same tokens, the host's speed), logged once.
- **Off CUDA** (or under ``CUTLASS_OPS_STEP_GRAPHS=0``) the same loop runs eagerly.
- ``start(input_ids)`` / ``feed(tokens)``: the prefill's and one graphed step's logits, for a loop
  of your own (sampling, teacher forcing).
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import sys
from typing import Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from cutlass_ops import graphed_steps, module_state, step_graphs

CACHE_ROUNDING = 256  # cache lengths are multiples of this: one graph serves many prompt lengths
DEFAULT_MAX_SESSIONS = 2
CHECK_EVERY = 16  # replays between looks at whether every sequence has ended (never waiting)


def _transformers():
    """transformers, when the process has imported it (the model is a Hugging Face model), else
    None: transformers is never imported here."""
    module = sys.modules.get("transformers")
    return module if module is not None and hasattr(module, "StaticCache") else None


@dataclasses.dataclass
class _Stopping:
    """A call's end-of-sequence rule, as device tensors a graph reads (filled per call)."""

    eos: Tensor  # [vocab] bool: the end-of-sequence tokens
    pad: Tensor  # [] long
    min_new: Tensor  # [] long: before this many new tokens, end-of-sequence is held back


def cache_refusal(cache) -> Optional[str]:
    """Why a step through ``cache`` cannot be replayed, or None. Hugging Face's sliding-window
    static layers keep their length in a Python int beside the device one (their mask sizes and
    their roll-over read it): a replay would not advance it, so every replayed step would attend
    as the captured one did."""
    for layer in getattr(cache, "layers", ()):
        if hasattr(layer, "cumulative_length_int"):
            return (f"the static cache's {type(layer).__name__} counts its length on the host "
                    "(a sliding window): a replayed step would not advance it")
    return None


class _ModelCall:
    """The model on (ids, positions, mask, cache), the last position's logits [batch, vocab],
    in this transformers version's keywords."""

    def __init__(self, model: nn.Module):
        forward = inspect.signature(type(model).forward).parameters
        self.model = model
        self.cache_keyword = "cache" if "cache" in forward else "past_key_values"
        self.extra = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}

    def __call__(self, ids: Tensor, positions: Tensor, mask: Tensor, cache) -> Tensor:
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                         use_cache=True, **{self.cache_keyword: cache}, **self.extra)
        return out.logits[:, -1]


class _Session:
    """One (batch, cache length): the static cache, the buffers a step reads and writes, and the
    step's graph once captured (in a memory pool of its own, freed after the graph: see
    ``graphed_steps.Graphs``). Holds no reference to its decoder: nothing here is in a cycle."""

    def __init__(self, call: _ModelCall, batch: int, cache_len: int, device):
        self.call, self.batch, self.cache_len = call, batch, cache_len
        config = call.model.config
        self.cache = _transformers().StaticCache(config=config, max_cache_len=cache_len)
        long = dict(dtype=torch.long, device=device)
        self.token = torch.zeros(batch, 1, **long)
        self.position = torch.zeros(batch, 1, **long)
        self.mask = torch.ones(batch, cache_len, **long)
        self.step = torch.zeros((), **long)  # the index of the token being chosen
        self.out = torch.zeros(batch, cache_len, **long)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.ended_at = torch.zeros((), **long)  # the step after which every sequence had ended
        vocab = config.get_text_config(decoder=True).vocab_size
        self.stopping = _Stopping(torch.zeros(vocab, dtype=torch.bool, device=device),
                                  torch.zeros((), **long), torch.zeros((), **long))
        self.graphs = graphed_steps.Graphs(1)  # the step's graph and its pool
        self.refusal: Optional[str] = None  # why this session's step runs eagerly
        self.used = 0  # cache positions written (host count: the prompt plus the steps fed)

    @property
    def graph(self) -> Optional[graphed_steps.Captured]:
        return self.graphs.get("step")

    def begin(self, input_ids: Tensor, attention_mask: Optional[Tensor],
              stopping: tuple) -> Tensor:
        """Resets the cache and the buffers, runs the prompt through the model and chooses the
        first token (step 0); returns the prompt's last logits. ``stopping``: (end-of-sequence
        ids, pad id, min new tokens)."""
        prompt = input_ids.shape[1]
        self.cache.reset()
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
        positions = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)
        self.mask.fill_(1)
        self.mask[:, :prompt].copy_(mask)
        self.position.copy_(positions[:, -1:] + 1)
        self.step.zero_()
        self.finished.zero_()
        self.ended_at.fill_(self.cache_len)
        eos, pad, min_new = stopping
        self.stopping.eos.zero_()
        if eos:
            self.stopping.eos[list(eos)] = True
        self.stopping.pad.fill_(pad)
        self.stopping.min_new.fill_(min_new)
        logits = self.call(input_ids, positions, mask, self.cache)
        self.used = prompt
        self._choose(logits)
        return logits

    def _choose(self, logits: Tensor) -> None:
        """The next token from ``logits`` [batch, vocab], as ``generate(do_sample=False)``
        chooses it, written to the output and fed back as the next step's input."""
        stop = self.stopping
        held_back = stop.eos & (self.step < stop.min_new)
        chosen = logits.masked_fill(held_back, float("-inf")).argmax(-1)
        chosen = torch.where(self.finished, stop.pad, chosen)
        self.finished |= stop.eos[chosen]
        self.ended_at.copy_(torch.where(self.finished.all() & (self.ended_at == self.cache_len),
                                        self.step, self.ended_at))
        self.out.index_copy_(1, self.step.view(1), chosen.view(-1, 1))
        self.token.copy_(chosen.view(-1, 1))
        self.step.add_(1)

    def run_step(self) -> Tensor:
        """One decode step on the token buffer, eagerly: the model, the choice; returns the
        logits."""
        logits = self.call(self.token, self.position, self.mask, self.cache)
        self._choose(logits)
        self.position.add_(1)
        return logits

    def capture(self) -> Optional[graphed_steps.CaptureRefused]:
        """Captures ``run_step`` (not run); returns the refusal when it cannot be captured."""
        why = cache_refusal(self.cache)
        if why is not None:
            self.refusal = why
            return graphed_steps.CaptureRefused(why)
        spec = pytree.tree_flatten(((), {}))[1]
        try:
            self.graphs.store("step", graphed_steps.capture(self.run_step, [], spec,
                                                            self.graphs))
        except graphed_steps.CaptureRefused as refusal:
            self.refusal = str(refusal)
            return refusal
        return None

    def memory_bytes(self) -> int:
        layers = getattr(self.cache, "layers", ())
        return self.graphs.pool_bytes() + sum(
            t.numel() * t.element_size() for layer in layers
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
            if isinstance(t, Tensor))


class GraphedDecoder:
    """See the module docstring and ``generate``."""

    def __init__(self, model: nn.Module, *, max_sessions: int = DEFAULT_MAX_SESSIONS,
                 on_refusal: str = "raise"):
        if on_refusal not in ("raise", "eager"):
            raise ValueError(f"on_refusal is 'raise' or 'eager', not {on_refusal!r}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be at least 1, not {max_sessions}")
        refusal = _model_refusal(model)
        if refusal is not None:
            raise graphed_steps.CaptureRefused(refusal)
        self.model, self.on_refusal, self.max_sessions = model, on_refusal, max_sessions
        self.call = _ModelCall(model)
        self.sessions: collections.OrderedDict = collections.OrderedDict()
        self._session: Optional[_Session] = None  # the one start() / feed() continue

    def advance(self, session: _Session) -> Tensor:
        """One decode step of ``session`` (replayed once captured; the first eager step is the
        capture's warm-up); returns the step's logits (the graph's own buffer once captured:
        overwritten by the next step)."""
        if session.used >= session.cache_len:
            raise ValueError(f"the static cache holds {session.cache_len} positions, all used; "
                             "start again with a longer max_len")
        session.used += 1
        graph = session.graph
        if graph is not None:
            graph.graph.replay()
            return graph.outputs
        logits = session.run_step()
        if session.refusal is None and self.graphs_wanted(session.token):
            refusal = session.capture()
            if refusal is not None:
                self.refused(refusal)
        return logits

    @staticmethod
    def graphs_wanted(like: Tensor) -> bool:
        return like.is_cuda and step_graphs.enabled() and \
            not torch.cuda.is_current_stream_capturing()

    def refused(self, refusal: graphed_steps.CaptureRefused) -> None:
        if self.on_refusal == "raise":
            raise refusal
        from custom_kernels.core.fallback import log_once

        log_once("a graphed decode runs step by step", str(refusal))

    def session(self, batch: int, cache_len: int, device) -> _Session:
        self._check_parameters()
        key = (batch, cache_len, device)
        found = self.sessions.get(key)
        if found is None:
            found = self.sessions[key] = _Session(self.call, batch, cache_len, device)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        self.sessions.move_to_end(key)
        return found

    def _check_parameters(self) -> None:
        """Graphs read the parameters' memory: new parameter tensors drop every session."""
        pointers = tuple(p.data_ptr() for p in self.model.parameters())
        if pointers != getattr(self, "_pointers", pointers):
            self.reset()
        self._pointers = pointers

    @torch.no_grad()
    def generate(self, input_ids: Tensor, *, max_new_tokens: int,
                 attention_mask: Optional[Tensor] = None, min_new_tokens: int = 0,
                 eos_token_id=None, pad_token_id: Optional[int] = None) -> Tensor:
        """``input_ids`` [batch, prompt] followed by up to ``max_new_tokens`` greedy tokens,
        [batch, prompt + generated]; see ``generate``."""
        _check_ids(input_ids, attention_mask, max_new_tokens, min_new_tokens)
        eos = self._eos(eos_token_id)
        pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
        if not isinstance(pad, int) or not 0 <= pad < self._vocab():
            # A pad token is fed back as the next input: outside the vocabulary, the embedding
            # would read out of bounds on the device.
            raise ValueError(f"pad_token_id {pad!r}: a token id in [0, {self._vocab()})")
        session = self._open(input_ids, max_new_tokens)
        session.begin(input_ids, attention_mask, (eos, pad, min_new_tokens))
        watch = _EndWatch(session) if eos else None
        for done in range(1, max_new_tokens):
            self.advance(session)
            if watch is not None and done % CHECK_EVERY == 0 and watch.ended():
                break
        made = max_new_tokens
        if eos:
            made = min(made, int(session.ended_at) + 1)  # the one sync
        return torch.cat([input_ids, session.out[:, :made]], dim=1)

    @torch.no_grad()
    def start(self, input_ids: Tensor, *, max_len: int,
              attention_mask: Optional[Tensor] = None) -> Tensor:
        """Runs the prompt into a static cache of at least ``max_len`` positions and returns its
        last logits, float32 [batch, vocab]; ``feed`` then continues it."""
        if not isinstance(max_len, int) or max_len <= input_ids.shape[-1]:
            raise ValueError(f"max_len {max_len!r} must exceed the prompt's "
                             f"{input_ids.shape[-1]} tokens (the cache holds both)")
        _check_ids(input_ids, attention_mask, max_len - input_ids.shape[1], 0)
        self._session = self._open(input_ids, max_len - input_ids.shape[1])
        return self._session.begin(input_ids, attention_mask, ((), 0, 0)).float()

    @torch.no_grad()
    def feed(self, tokens: Tensor) -> Tensor:
        """One decode step on ``tokens`` [batch] or [batch, 1] (graphed after the first), after
        ``start`` or earlier ``feed`` calls; returns its logits, float32 [batch, vocab]."""
        session = self._session
        if session is None:
            raise RuntimeError("feed() continues a start(): call start(input_ids) first")
        if tokens.numel() != session.batch:
            raise ValueError(f"feed() takes one token per sequence ({session.batch}), "
                             f"not {tuple(tokens.shape)}")
        session.token.copy_(tokens.reshape(-1, 1))
        return self.advance(session).float()

    def _open(self, input_ids: Tensor, new_tokens: int) -> _Session:
        if _transformers() is None:
            raise TypeError("graphed decoding runs Hugging Face causal LMs (transformers is not "
                            "imported)")
        length = input_ids.shape[1] + new_tokens
        cache_len = -(-length // CACHE_ROUNDING) * CACHE_ROUNDING
        return self.session(input_ids.shape[0], cache_len, input_ids.device)

    def _eos(self, eos_token_id) -> tuple:
        if eos_token_id is None:
            config = getattr(self.model, "generation_config", None)
            eos_token_id = getattr(config, "eos_token_id", None)
        if eos_token_id is None:
            return ()
        eos = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
        vocab = self._vocab()
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in eos):
            raise ValueError(f"eos_token_id {eos_token_id!r}: token ids in [0, {vocab})")
        return eos

    def _vocab(self) -> int:
        return self.model.config.get_text_config(decoder=True).vocab_size

    def memory_bytes(self) -> int:
        """What the sessions' static caches and graphs hold on the device."""
        return sum(s.memory_bytes() for s in self.sessions.values())

    def reset(self) -> None:
        """Drops every session (its cache and graph)."""
        self.sessions.clear()
        self._session = None


class _EndWatch:
    """Whether every sequence has ended, learned without waiting: each look copies the flag to
    pinned host memory behind the steps queued so far and reads the copy of an earlier look
    once the GPU has passed it."""

    def __init__(self, session: _Session):
        self.session = session
        self.pending: collections.deque = collections.deque()

    def ended(self) -> bool:
        finished = self.session.finished.all()
        if not finished.is_cuda:
            return bool(finished)
        flag = torch.empty((), dtype=torch.bool, pin_memory=True)
        flag.copy_(finished, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending.append((flag, event))
        while self.pending and self.pending[0][1].query():
            flag, _ = self.pending.popleft()
            if bool(flag):
                return True
        return False


def _check_ids(input_ids, attention_mask, max_new_tokens, min_new_tokens) -> None:
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long \
            or 0 in input_ids.shape:
        raise ValueError("input_ids: a [batch, prompt] tensor of token ids (torch.long), "
                         f"not {getattr(input_ids, 'shape', type(input_ids).__name__)}")
    if attention_mask is not None and (attention_mask.shape != input_ids.shape or
                                       attention_mask.device != input_ids.device):
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids "
                         f"{tuple(input_ids.shape)} on {input_ids.device}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, not {max_new_tokens!r}")
    if not isinstance(min_new_tokens, int) or not 0 <= min_new_tokens <= max_new_tokens:
        raise ValueError(f"min_new_tokens must be an int in [0, max_new_tokens], "
                         f"not {min_new_tokens!r}")


def _model_refusal(model: nn.Module) -> Optional[str]:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        return "not a Hugging Face causal LM (no config): graphed decoding needs its StaticCache"
    return graphed_steps.distributed_refusal(model)


class _DecoderHolder:
    """A model's decoder for ``generate`` (module state): a copied model starts without one
    (its caches and graphs read this model's memory)."""

    def __init__(self):
        self.decoder: Optional[GraphedDecoder] = None

    def __deepcopy__(self, memo):
        return _DecoderHolder()


def graphed_decoder(model: nn.Module, *, max_sessions: int = DEFAULT_MAX_SESSIONS,
                    on_refusal: str = "raise") -> GraphedDecoder:
    """A decoder of ``model`` (a Hugging Face causal LM, converted or not): ``generate``,
    ``start`` and ``feed``, each decode step one CUDA graph. See the module docstring."""
    return GraphedDecoder(model, max_sessions=max_sessions, on_refusal=on_refusal)


def generate(model: nn.Module, input_ids: Tensor, *, max_new_tokens: int,
             attention_mask: Optional[Tensor] = None, min_new_tokens: int = 0,
             eos_token_id: Optional[int | Sequence[int]] = None,
             pad_token_id: Optional[int] = None, on_refusal: str = "raise") -> Tensor:
    """``model.generate(input_ids, do_sample=False, max_new_tokens=..., ...)``'s tokens with a
    static KV cache and each decode step one CUDA graph (the model's decoder, kept between
    calls). ``eos_token_id`` None: the model's ``generation_config``'s (``[]``: none);
    ``pad_token_id`` None: the first end-of-sequence token."""
    holder = module_state.ensure(model, _DecoderHolder)
    decoder = holder.decoder
    if decoder is None or decoder.on_refusal != on_refusal:
        decoder = holder.decoder = GraphedDecoder(model, on_refusal=on_refusal)
    return decoder.generate(input_ids, max_new_tokens=max_new_tokens,
                            attention_mask=attention_mask, min_new_tokens=min_new_tokens,
                            eos_token_id=eos_token_id, pad_token_id=pad_token_id)


__all__ = ["GraphedDecoder", "graphed_decoder", "generate", "CACHE_ROUNDING"]
