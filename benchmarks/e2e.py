"""A Hugging Face decoder model end to end: eager, torch.compile, converted by
``cutlass_ops.convert`` ("ours"), and converted then compiled ("ours+compile").

The model is Llama-3-8B-shaped (hidden 4096, MLP 14336, 32 / 8 heads, vocabulary 128256) with
``--layers`` layers (8) and random bf16 weights, built from a config (no download). Rows
(BENCHMARKS.md schema; ``ratio`` = our tokens/s over the reference's):
- ``train``: forward and backward of the causal-LM loss on ``--tokens`` tokens (2 sequences);
- ``prefill``: the inference forward on the same tokens, under no_grad;
- ``decode batch 1 ours vs hf static compile`` / ``decode batch 16 ...``: ``generate()`` of
  ``--new-tokens`` greedy tokens after a 128-token prompt, ours (the converted model through
  ``cutlass_ops.generate``: a static KV cache, each decode step one CUDA graph, the token loop
  on the device) against Hugging Face's ``generate(cache_implementation=
  "static")`` of the unconverted model, which compiles the decoding forward itself (inductor,
  "reduce-overhead": CUDA graphs; ``detail.reference_settings`` records the version, the compile
  settings and that it compiled): the strongest decode a Hugging Face user gets. ``decode batch
  1 ours vs eager`` / ``... 16 ...``: the same against eager's dynamic cache; ``decode batch 1
  ours vs ours hf generate``: against the converted model in Hugging Face's own ``generate()``
  (dynamic cache, graphs between the attention calls only). Each repetition
  is a whole generate() of many steps, so half of ``--reps`` of them, the variants interleaved
  (the host's speed drifts); ``--no-compile`` leaves the static-cache peer out;
- ``train ours graphed vs compile`` / ``vs compile reduce-overhead`` / ``vs ours`` (and prefill
  alike): the converted model's step through ``cutlass_ops.graphed_train_step`` (prefill:
  ``graphed_forward``), captured before its check, against torch.compile, torch.compile with
  CUDA graphs (``mode="reduce-overhead"``, the peer that also removes the host) and itself
  ungraphed; ``peak memory train ours graphed vs ours`` counts the graphs' whole memory pool
  (``--no-graphs`` leaves these out);
- ``gpu busy train ours`` (and ``ours graphed``): the share of the converted train step's wall
  time the GPU runs kernels, five steps back to back under torch.profiler (``ratio`` = busy /
  wall, ``ours`` / ``reference`` the busy and wall milliseconds a step; ``benchmarks/gpu_busy.py``);
- ``train ours vs ours without fused loss``: the converted model against itself converted with
  ``fused_loss=False`` (the head and loss as Hugging Face computes them);
- ``peak memory train ours vs eager`` (and vs compile, vs ours without fused loss): unit 1/GB, so
  that ``ratio`` = the reference's GB over ours; each variant's peak without the other variants'
  weights (they share the GPU). ``detail`` breaks each peak down (``peak_memory``): parameters,
  gradients, the rest, and the forward's own peak. No variant can peak below its parameters plus
  all its gradients (every gradient is alive when the embedding's is written, backward's last
  op): at ``--quick``'s 2 layers and 1024 tokens that floor, 2 x 2.974 = 5.948 GB, is above
  every eager-mode variant's activation peak, so they all read 5.95-5.96 GB and the rows say so
  (``detail.at_the_floor``); ``forward_peak_gb`` still tells them apart.
- FP8 (issues 38 and 50; ``benchmarks/e2e_fp8.py`` says how): per recipe of ``--recipes``, no
  recipe standing for another, ``train ours fp8 R vs torchao R``, ``peak memory train ours fp8 R
  vs torchao R`` and ``prefill ours fp8 R vs torchao R`` for R tensorwise and rowwise, "ours fp8
  R" ``convert(model, fp8=R)`` and the reference torchao float8 R + torch.compile with Liger's
  fused linear cross-entropy as its loss, measured in a process of its own (``--only-variant``);
  blockwise's rows are against ours bf16 (torchao 0.18 has no blockwise ``Float8LinearConfig``
  recipe). Weaker references (eager, ours bf16, torchao with HF's full-logits loss where its
  ``-hf-loss`` peer ran) are in ``detail.weaker_references_tokens_per_s``, the peers' figures,
  settings and versions in ``detail.peers``. FP8 gradients are compared with the recipe's
  float32 emulation (``benchmarks/fp8_emulation.py``) directly, the bound and the worst error
  in ``detail``.
Times are CUDA-event medians after warm-up, the variants interleaved repetition by repetition
(the host's speed drifts over a run). Checks (``benchmarks/model_checks.py``, bounds from
``custom_kernels.core.tolerances``), each against eager on the same inputs: a ``train`` row is
correct when its variant's loss is within 1% of eager's and every parameter's gradient within
the ``model gradients`` bound (``detail`` names the worst parameter); a ``prefill`` row when its
logits are within 2e-2 of eager's (or no further than its reference's); a ``decode`` row when
teacher-forced decoding (eager's generated tokens fed to both models one at a time through
their KV caches) keeps every step's logits within the ``model logits`` bound (``detail`` has
the steps' top-1 agreement, and ``generated_tokens_equal``: the share of generated tokens, the
prompt excluded, on which the two ``generate()`` outputs agree); a ``peak memory`` row when the
train step it measured passed its check. The GEMMs run what dispatch has: ``--tune quick``
first tunes every GEMM the converted model runs (its Linears forward and backward, the decode
batches, the chunked loss head). "ours" is ``convert``'s model: fused norms, our Linear, and the
loss through the chunked head when labels are passed. Results are
written after each section, so an interrupted run keeps what it measured.
Writes benchmarks/results/e2e.json (e2e_quick.json with --quick: 2 layers, 1024 tokens); a full
run copies the rows of an e2e_quick.json written by the same code into its ``detail``
(``two_layers``), so run ``--quick`` first.

    python benchmarks/e2e.py [--quick] [--tune quick] [--layers 8] [--tokens 4096]
        [--sections train prefill decode] [--fp8-only | --no-fp8] [--recipes ...] [--peers ...]
        [--peers-only] [--peer-dir build/e2e_peers] [--peer-timeout 540]

A whole run with the compiled variants takes more than seven minutes (torch.compile's warm-ups
of two 8-layer models, for training and for inference); ``--sections`` splits it across runs,
each adding its rows to the file: the other sections' rows of the same model stay, a row from
other code or another GPU labelled with its run (``detail["run"]``). The peers run first, one process at a time,
and their results stay in ``--peer-dir`` for later runs of the same code and sizes: ``--peers-only``
runs them alone, so that a later ``--fp8-only`` run (eager, ours, ours fp8 per recipe; train and
prefill; the file's other rows kept) fits one command.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import model_checks  # noqa: E402
from benchmarks.common import (print_table, require_gpu, rows_of_same_run,  # noqa: E402
                               write_result)
from custom_kernels.core.tolerances import relative_error  # noqa: E402
from benchmarks.gpu_busy import busy_row, busy_share  # noqa: E402
from tuning.timing import do_bench_interleaved  # noqa: E402

PROMPT = 128
SEQUENCES = 2
SECTIONS = ("train", "prefill", "decode")


def llama(layers: int, device: str = "cuda"):
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def train_step(model, ids):
    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss
    return step


# Variants that run a converted model through cutlass_ops.graphed_steps: the train step and the
# prefill forward replayed as CUDA graphs (issue 52), measured beside the same model ungraphed.
GRAPHED = "ours graphed"
# torch.compile with CUDA graphs (cudagraph trees): the peer that also takes the host out.
COMPILE_GRAPHS = "compile reduce-overhead"


def graphed_train_step(model, ids):
    """``train_step``'s work as a ``cutlass_ops.graphed_train_step``, called twice (eager, then
    captured and replayed) so that the checked step is a replay; the wrapper in ``.graphed``."""
    import cutlass_ops

    graphed = cutlass_ops.graphed_train_step(model)

    def step():
        return graphed(input_ids=ids, labels=ids)
    for _ in range(2):
        step()
    model.zero_grad(set_to_none=True)
    step.graphed = graphed
    return step


def graph_memory(model, step) -> dict:
    """``peak_memory``'s figures for a graphed step: the parameters and the graphs' memory
    pool (its activations, gradients and temporaries, held between replays), the pool counted
    whole as the step's peak."""
    pool = step.graphed.memory_bytes()
    parameters = parameter_bytes(model)
    return {"peak_gb": (parameters + pool) / 1e9, "parameters_gb": parameters / 1e9,
            "graph_pool_gb": pool / 1e9, "gradients_gb": gradient_bytes(model) / 1e9,
            "above_parameters_and_gradients_gb": None, "forward_peak_gb": None}


def parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


VOCAB = 128256  # Llama 3's


def token_ids(tokens: int, vocab: int = VOCAB):
    """The benchmark's tokens: ``SEQUENCES`` sequences, seeded (every process draws the same)."""
    return torch.randint(0, vocab, (SEQUENCES, tokens // SEQUENCES), device="cuda",
                         generator=torch.Generator("cuda").manual_seed(0))


def first_step(model, step):
    """One train step's loss and gradients (``model_checks.gradients``), the model's own
    gradient tensors handed over: the model is left with none."""
    loss = step().detach().float().item()
    grads = model_checks.gradients(model)
    model.zero_grad(set_to_none=True)  # the gradients now belong to grads alone
    return loss, grads


def gradient_bytes(model) -> int:
    return sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
               if p.grad is not None)


# The share of its peak by which an entry's ``peak_gb`` may exceed its parameters and gradients
# and still be read as the floor (``memory_row``'s ``at_the_floor``): the last gradient's
# temporaries (0.008 GB of 5.956 in a fake-tensor trace of eager at 2 layers and 1024 tokens),
# not activations.
FLOOR_SLACK = 0.01


def peak_memory(model, step) -> dict:
    """The allocator's peak over one step, less what the other models on the GPU hold (their
    weights, gradients and kept references): the figure the model alone would show, in GB
    (1e9), with its breakdown: ``parameters_gb``, ``gradients_gb`` (those the step left),
    ``above_parameters_and_gradients_gb`` (the peak less both: about 0 when the peak is the end
    of backward, every gradient alive, rather than activations), and ``forward_peak_gb`` (the
    peak up to the end of the model's forward, its loss included: parameters and activations,
    no gradient; None where no forward hook fired). The peak is reset right before the step,
    so each call measures its own step whatever ran before it."""
    torch.cuda.synchronize()
    parameters = parameter_bytes(model)
    others = torch.cuda.memory_allocated() - parameters
    marks = {}

    def after_forward(module, args, output):
        # The allocator's figures are the host's: no synchronization needed here.
        marks.setdefault("forward", torch.cuda.max_memory_allocated())

    hook = model.register_forward_hook(after_forward)
    try:
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - others
    finally:
        hook.remove()
    gradients = gradient_bytes(model)
    model.zero_grad(set_to_none=True)
    forward = marks.get("forward")
    return {"peak_gb": peak / 1e9, "parameters_gb": parameters / 1e9,
            "gradients_gb": gradients / 1e9,
            "above_parameters_and_gradients_gb": (peak - parameters - gradients) / 1e9,
            "forward_peak_gb": None if forward is None else (forward - others) / 1e9}


def measure_train(variants, ids, reps, tolerances=None, fragile=(), busy=False):
    """Check, time and peak memory of each variant's train step. The first step of each
    variant is its check (``model_checks.check_train_step``) against eager's, which runs
    first: eager's gradients are kept (the tensors themselves, no copy) until every variant is
    checked. ``tolerances``: a variant's gradient bound where it is not eager's dtype's, as a
    figure, per-parameter bounds, or a function of eager's (loss, gradients) returning either
    (called once, after eager's step, before any other variant's: the FP8 variants' emulations).
    ``fragile``: variants whose failure to run a step is a result ({"error": why}, left out of
    the timing), not a crash. ``busy``: also ours' (and ours graphed's) busy share
    (``gpu_busy.busy_share``). The times are interleaved repetition
    by repetition (tuning.timing's do_bench_interleaved), as decoding's: at small sizes a step
    is partly host-bound and the host's speed drifts, and sequential timing credits whoever ran
    on a quiet stretch or a cool GPU. The variants share the GPU, so a variant's peak (one step
    of its own, before the timing; ``peak_memory``, its breakdown in ``memory``) leaves out the
    other variants' weights and gradients and eager's kept gradients."""
    if next(iter(variants)) != "eager":
        raise ValueError("eager must be the first variant: the others are checked against it")
    eager = variants["eager"]
    eager.train()
    steps = {"eager": train_step(eager, ids)}
    reference = first_step(eager, steps["eager"])
    memory = peak_memory(eager, steps["eager"])
    out = {"eager": {"loss": reference[0], "peak_gb": memory["peak_gb"], "memory": memory,
                     "check": None}}
    bounds = {name: (tolerances or {}).get(name, model_checks.gradient_tolerance(eager))
              for name in variants if name != "eager"}
    bounds = {name: b(*reference) if callable(b) else b for name, b in bounds.items()}
    for name, model in list(variants.items())[1:]:
        model.train()
        try:
            steps[name] = (graphed_train_step if name == GRAPHED else train_step)(model, ids)
            loss, grads = first_step(model, steps[name])
        except Exception as error:  # noqa: BLE001
            if name not in fragile:
                raise
            model.zero_grad(set_to_none=True)
            steps.pop(name, None)
            out[name] = {"error": f"its first train step raised {type(error).__name__}: "
                                  f"{error}"[:500]}
            continue
        check = model_checks.check_train_step(loss, grads, *reference, bounds[name])
        del grads
        memory = (graph_memory if name == GRAPHED else peak_memory)(model, steps[name])
        out[name] = {"loss": loss, "peak_gb": memory["peak_gb"], "memory": memory,
                     "check": check}
    del reference
    times = do_bench_interleaved(steps, warmup=1, reps=reps, flush_l2=False)
    for name in steps:
        out[name]["ms"] = times[name].median_ms
    for name in [n for n in ("ours", GRAPHED) if busy and n in steps]:  # the GPU's busy share
        out[name]["busy"] = busy_share(steps[name])
    for name in steps:
        variants[name].zero_grad(set_to_none=True)
    return out


def train_rows(train: dict, tokens: int) -> list:
    """The train rows of the measured pairs, then the peak memory rows of ours against each
    reference: each correct only when ours' (the row's first variant's) step passed its
    check."""
    rows = []
    for a, b in pairs(train):
        if "ms" not in train[a] or "ms" not in train[b]:
            rows.append(unmeasured_row(f"train {a} vs {b}", tokens, train[a], train[b], b))
            continue
        check = train[a]["check"]
        rows.append(rate_row(f"train {a} vs {b}", tokens, train[a], train[b], b, check.ok,
                             loss_ours=train[a]["loss"], loss_reference=train[b]["loss"],
                             **check.detail()))
    for reference in ("eager", "compile", "ours without fused loss"):
        if reference in train:
            rows.append(memory_row(train["ours"], train[reference], reference,
                                   train["ours"]["check"].ok))
    if "ms" in train.get(GRAPHED, {}):  # the graph's pool held beside the step ungraphed
        rows.append(memory_row(train[GRAPHED], train["ours"], "ours",
                               train[GRAPHED]["check"].ok,
                               case=f"peak memory train {GRAPHED} vs ours"))
    for name in [n for n in ("ours", GRAPHED) if "busy" in train.get(n, {})]:
        rows.append(busy_row(f"train {name}", train[name]["busy"], train[name]["check"].ok))
    return rows


def unmeasured_row(case: str, tokens: int, ours: dict, reference: dict, reference_name: str):
    """A pair one of whose variants failed to run (a fragile variant's {"error": why})."""
    from benchmarks.e2e_fp8 import missing_row

    rate = [round(tokens / v["ms"] * 1e3, 1) if v.get("ms") else None for v in (ours, reference)]
    why = "; ".join(v["error"] for v in (ours, reference) if "error" in v) or "not measured"
    return missing_row(case, "tokens/s", *rate, reference_name, why)


class GraphedPrefill:
    """A converted model's prefill through ``cutlass_ops.graphed_forward`` as the prefill code
    calls a model: ``eval()``, then ``model(input_ids=...)`` (the graph's own output buffers);
    captured before it is checked."""

    def __init__(self, model, ids):
        import cutlass_ops

        self.model = model.eval()
        self.forward = cutlass_ops.graphed_forward(model)
        for _ in range(2):
            self.forward(input_ids=ids)

    def eval(self):
        return self

    def __call__(self, **kwargs):
        return self.forward(**kwargs)


def graphed_prefill(model, ids) -> GraphedPrefill:
    return GraphedPrefill(model, ids)


def prefill_logits(model, ids):
    """The inference forward's last 16 positions' logits, float32 (what the checks compare)."""
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits[:, -16:].float()


def measure_prefill(variants, ids, reps, fragile=()):
    """Each variant's prefill time (none with ``reps`` 0), interleaved as the train steps'
    (a small model's forward is host-bound), and its last logits. ``fragile`` as in
    ``measure_train``."""
    out, calls = {}, {}
    for name, model in variants.items():
        try:
            if name == GRAPHED:
                model = graphed_prefill(model, ids)
            logits = prefill_logits(model, ids)
        except Exception as error:  # noqa: BLE001
            if name not in fragile:
                raise
            out[name] = {"error": f"its prefill raised {type(error).__name__}: {error}"[:500]}
            continue
        out[name] = {"ms": None, "logits": logits}
        calls[name] = lambda model=model: model(input_ids=ids)
    if reps:
        with torch.no_grad():
            times = do_bench_interleaved(calls, warmup=2, reps=reps, flush_l2=False)
        for name in calls:
            out[name]["ms"] = times[name].median_ms
    return out


def section_of(case: str) -> str:
    """The section that measured a row: "peak memory train ..." and "gpu busy train ..." rows
    are the train section's."""
    words = case.split()
    return words[2] if words[0] in ("peak", "gpu") else words[0]


SAME_MODEL = ("layers", "tokens", "new_tokens")  # the meta keys that make rows comparable


def kept_rows(name: str, meta: dict, sections: set) -> list:
    """The rows of sections not measured now, from the result file, when it was written for the
    same model (``meta``); none otherwise. Each row keeps the reference measured beside it in
    its own run, and a row of another run (other code, or another GPU) says which in
    ``detail["run"]`` (GPU and versions): a run of some sections leaves the others' figures
    standing, labelled, rather than dropping them."""
    import json

    from benchmarks.common import RESULTS, versions

    if sections >= set(SECTIONS):
        return []
    try:
        old = json.loads((RESULTS / f"{name}.json").read_text())
    except (OSError, ValueError):
        return []
    if any(old.get(k) != meta[k] for k in SAME_MODEL if k in meta):
        return []
    this_run = old.get("versions", {}).get("project") == versions()["project"]
    rows = []
    for row in old.get("rows", []):
        if section_of(row["case"]) in sections:
            continue
        run = row.get("detail", {}).get("run")
        if run is None and not this_run:
            run = {"gpu": old.get("gpu"), "versions": old.get("versions")}
        rows.append(row if run is None else {**row, "detail": {**row.get("detail", {}),
                                                                "run": run}})
    return rows


def replaced_rows(old: list, rows: list) -> list:
    """The rows of ``old`` (the result file's, of the same code and model) that no row of
    ``rows`` replaces: a run of some variants only (``--fp8-only``) keeps the others' rows."""
    cases = {r["case"] for r in rows}
    return [r for r in old if r["case"] not in cases]


def two_layer_run() -> dict | None:
    """The 2-layer run (``--quick``, e2e_quick.json) of the same code, for the full run's
    ``detail``: its model, sizes and rows (ratios with both figures), or None when there is
    none for this code."""
    import json

    from benchmarks.common import RESULTS, versions

    try:
        quick = json.loads((RESULTS / "e2e_quick.json").read_text())
    except (OSError, ValueError):
        return None
    if quick.get("versions", {}).get("project") != versions()["project"]:
        return None
    return {"layers": quick.get("layers"), "tokens": quick.get("tokens"),
            "new_tokens": quick.get("new_tokens"),
            "rows": [{k: r[k] for k in ("case", "ours", "reference", "ratio", "correct")}
                     for r in quick.get("rows", [])]}


HF_STATIC = "hf static compile"
# generate() keywords of the decode variants that are not plain generate() calls of their model:
# Hugging Face's static KV cache, with which generate() compiles the decoding forward itself
# (its default CompileConfig: inductor, mode "reduce-overhead", i.e. CUDA graphs).
GENERATE_OPTIONS = {HF_STATIC: {"cache_implementation": "static"}}


OURS_HF_GENERATE = "ours hf generate"


def graphed_generate(model, prompt, new_tokens):
    """Ours' decode: ``cutlass_ops.generate`` (static KV cache, each decode step one CUDA graph,
    the token loop on the device), with the same stopping rule as the generate() calls here."""
    import cutlass_ops

    return cutlass_ops.generate(model, prompt, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, pad_token_id=0)


def measure_decode(variants, batch, new_tokens, reps, vocab: int = VOCAB, options=None,
                   calls=None):
    """generate() of each variant, interleaved repetition by repetition (tuning.timing's
    do_bench_interleaved): decoding is host-bound, and the host's speed drifts over a run by more
    than the differences measured, so sequential timing would credit whoever ran on a quiet
    stretch. ``options``: extra generate() keywords by variant name (``GENERATE_OPTIONS`` by
    default); the warm-up call also compiles a variant whose keywords make generate() compile.
    ``calls``: variants decoded by a function of (model, prompt, new tokens) instead of
    ``model.generate`` (``graphed_generate`` for ours in e2e)."""
    options = GENERATE_OPTIONS if options is None else options
    prompt = torch.randint(0, vocab, (batch, PROMPT), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(batch))
    out = {}
    with torch.no_grad():
        generators = {}
        for name, model in variants.items():
            model.eval()

            def generate(model=model, extra=options.get(name, {}), call=(calls or {}).get(name)):
                if call is not None:
                    return call(model, prompt, new_tokens)
                return model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      do_sample=False, pad_token_id=0, **extra)
            generators[name] = generate
            out[name] = {"tokens": generate()}
        times = do_bench_interleaved(generators, warmup=1, reps=reps, flush_l2=False)
    for name in variants:
        out[name]["ms"] = times[name].median_ms
    return out


def static_peer_settings(model) -> dict:
    """What Hugging Face's static-cache generate() ran with: its version, the cache, the compile
    settings generate() used, and whether it did compile (its compiled forward exists)."""
    import transformers
    from transformers.generation import CompileConfig

    config = model.generation_config.compile_config or CompileConfig()  # generate()'s default
    return {"transformers": transformers.__version__, "cache_implementation": "static",
            "compile_config": config.to_dict(),
            "compiled": getattr(model, "_compiled_call", None) is not None}


def train_problems(model, tokens: int) -> list:
    """The GEMMs the converted model trains with on ``tokens`` tokens: every Linear forward and
    backward, and the chunked loss head's."""
    from cutlass_ops.fused_cross_entropy import default_chunk_rows
    from tuning.shapes import model_problems

    chunk = default_chunk_rows(tokens, model.config.vocab_size, torch.device("cuda"),
                               torch.bfloat16)
    return model_problems(model, tokens, backward=True, loss_chunk_rows=chunk)


def fp8_problems(model, args) -> list:
    """The FP8 GEMMs ``convert(model, fp8=recipe)`` trains with on the train tokens, for each
    of ``args.recipes`` (what ``cutlass-tune tune --fp8 RECIPE --model ... --backward`` tunes)."""
    from tuning.cli import _fp8_model_problems

    from benchmarks.e2e_fp8 import split_variant

    recipes = dict.fromkeys(split_variant(v)[0] for v in getattr(args, "recipes", ()))
    return [problem for recipe in recipes for problem in
            _fp8_model_problems(argparse.Namespace(fp8=recipe, tokens=args.tokens,
                                                   backward=True), model)]


def tune(model, args) -> None:
    """Tunes what the converted model runs: ``train_problems`` on the train / prefill tokens,
    and the forward at each decode batch."""
    from cutlass_ops.gemms import dispatch
    from tuning.backend import GpuBackend
    from tuning.search import tune as run_tune
    from tuning.shapes import model_problems

    problems = train_problems(model, args.tokens)
    for batch in (1, 16):
        problems += model_problems(model, batch)
    problems += fp8_problems(model, args)
    report = run_tune(list(dict.fromkeys(problems)), backend=GpuBackend(), strategy=args.tune)
    print(f"tuned {len(problems)} GEMMs: compiled {report.built} kernels in "
          f"{report.build_seconds:.0f} s, measured in {report.measure_seconds:.0f} s", flush=True)
    dispatch.reset()


def rate_row(case, tokens, ours, ref, ref_name, correct, **detail):
    ours_tps, ref_tps = tokens / ours["ms"] * 1e3, tokens / ref["ms"] * 1e3
    return {"case": case, "unit": "tokens/s", "ours": round(ours_tps, 1),
            "reference": round(ref_tps, 1), "reference_name": ref_name,
            "ratio": round(round(ours_tps, 1) / round(ref_tps, 1), 4), "correct": correct,
            "detail": {"ours_ms": round(ours["ms"], 3), "reference_ms": round(ref["ms"], 3),
                       **detail}}


def memory_breakdown(entry: dict) -> dict | None:
    """An entry's ``peak_memory`` breakdown, rounded for a row's detail (None without one)."""
    memory = entry.get("memory")
    if not memory:
        return None
    return {k: None if v is None else round(v, 3) for k, v in memory.items()}


def at_the_floor(entry: dict) -> bool | None:
    """Whether the entry's peak is its parameters plus its gradients (within ``FLOOR_SLACK`` of
    the peak): the end of backward, where every variant of the same weights lands, activations
    below it."""
    above = (entry.get("memory") or {}).get("above_parameters_and_gradients_gb")
    return None if above is None else above <= FLOOR_SLACK * entry["peak_gb"]


def memory_row(ours, ref, ref_name, correct: bool, case: str | None = None):
    """``correct``: whether the train step whose peak this is passed its check (a peak of a
    wrong step is no figure to keep). ``detail`` has both breakdowns (``peak_memory``), and
    ``at_the_floor`` when both peaks are their parameters plus gradients, with the forward
    peaks' ratio: what still tells the two apart there."""
    detail = {"ours_gb": round(ours["peak_gb"], 2), "reference_gb": round(ref["peak_gb"], 2)}
    breakdowns = memory_breakdown(ours), memory_breakdown(ref)
    if all(breakdowns):
        detail.update(ours_memory=breakdowns[0], reference_memory=breakdowns[1])
        if at_the_floor(ours) and at_the_floor(ref):
            detail["at_the_floor"] = (
                "both peaks are their parameters plus gradients (the end of backward, every "
                "gradient alive), above either's activation peak: equal for equal weights, "
                "whatever the step keeps; forward_peak_ratio compares the rest")
        forwards = ours["memory"].get("forward_peak_gb"), ref["memory"].get("forward_peak_gb")
        if all(forwards):
            detail["forward_peak_ratio"] = round(forwards[1] / forwards[0], 4)
    return {"case": case or f"peak memory train ours vs {ref_name}", "unit": "1/GB",
            "ours": round(1 / ours["peak_gb"], 5), "reference": round(1 / ref["peak_gb"], 5),
            "reference_name": ref_name, "ratio": round(ref["peak_gb"] / ours["peak_gb"], 4),
            "correct": correct, "detail": detail}


def pairs(have):
    """(ours variant, reference variant) pairs the issue names, among the variants measured."""
    wanted = [("ours", "eager"), ("ours", "compile"), ("ours+compile", "compile"),
              ("ours", "ours without fused loss"), (GRAPHED, "compile"),
              (GRAPHED, COMPILE_GRAPHS), (GRAPHED, "ours")]
    return [(a, b) for a, b in wanted if a in have and b in have]


def prefill_rows(prefill: dict, tokens: int) -> list:
    errors = {k: relative_error(v["logits"], prefill["eager"]["logits"]) for k, v in
              prefill.items() if "logits" in v}
    rows = []
    for a, b in pairs(prefill):
        if a not in errors or b not in errors or prefill[a]["ms"] is None:
            rows.append(unmeasured_row(f"prefill {a} vs {b}", tokens, prefill[a], prefill[b], b))
            continue
        # bf16 rounding over the layers moves the logits: a variant passes within 2e-2 of
        # eager's, or no further from them than its reference (torch.compile's own reordering).
        ok = errors[a] < 2e-2 or errors[a] <= 1.5 * errors[b]
        rows.append(rate_row(f"prefill {a} vs {b}", tokens, prefill[a], prefill[b], b, ok,
                             logits_error_vs_eager=round(errors[a], 5),
                             reference_logits_error_vs_eager=round(errors[b], 5)))
    return rows


def decode_row(decode: dict, models: dict, batch: int, new_tokens: int, judge=None,
               reference: str = "eager", graphed: bool = False, check=None) -> dict:
    """The decode row of one batch against ``reference`` (a variant of ``decode``): correct when
    teacher-forced decoding of eager's generated tokens keeps ours' logits within bound at every
    step (always against eager's model: the peers' caches and graphs change no arithmetic).
    Random weights leave near-ties among the logits, so free-running greedy paths may part after
    one rounding difference: their agreement (generated tokens only) is reported, not checked.
    ``judge``: another rule, called with the teacher-forced check, returning a dict with
    "correct" and its own detail. ``graphed``: ours decoded through ``graphed_generate``, so
    the teacher-forced steps go through its static cache and step graph too. ``check``: that
    check already made (``decode_check``), for the batch's other rows."""
    check = check or decode_check(decode, models, graphed)
    same = model_checks.generated_agreement(decode["ours"]["tokens"],
                                            decode["eager"]["tokens"], PROMPT)
    judged = {"correct": check.ok} if judge is None else judge(check)
    correct = judged.pop("correct")
    detail = {"generated_tokens_equal": round(same, 4), **check.detail(), **judged}
    if reference != "eager":
        tokens = batch * new_tokens
        detail["eager"] = round(tokens / decode["eager"]["ms"] * 1e3, 1)  # tokens/s
        detail["reference_generated_tokens_equal_eager"] = round(
            model_checks.generated_agreement(decode[reference]["tokens"],
                                             decode["eager"]["tokens"], PROMPT), 4)
        if reference == HF_STATIC:
            detail["reference_settings"] = static_peer_settings(models["eager"])
    return rate_row(f"decode batch {batch} ours vs {reference}", batch * new_tokens,
                    decode["ours"], decode[reference], reference, correct, **detail)


def decode_check(decode: dict, models: dict, graphed: bool = False):
    """Teacher-forced decoding of eager's generated tokens through ours and eager's model: the
    one check every decode row of a batch is judged by."""
    return model_checks.teacher_forced_decode(models["ours"], models["eager"],
                                              decode["eager"]["tokens"], PROMPT, graphed=graphed)


def parse_args(argv=None):
    from benchmarks.e2e_fp8 import DEFAULT_PEERS, PEERS, RECIPES, TORCHAO, TORCHAO_HF_LOSS, VARIANTS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, 1024 tokens, 32 new")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens a train / prefill step")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generate() decodes")
    parser.add_argument("--reps", type=int, default=20,
                        help="timed repetitions per train / prefill figure (decode: a third, each\n                        a whole generate() of --new-tokens steps)")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled variants")
    parser.add_argument("--no-graphs", action="store_true",
                        help=f"skip {GRAPHED!r} and {COMPILE_GRAPHS!r}")
    parser.add_argument("--no-loss-baseline", action="store_true",
                        help="skip the converted model without the fused loss (train rows)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=None,
                        help="what to measure (default all; train prefill with --fp8-only); the "
                             "rows of the others are kept from the result file when it holds "
                             "the same code and model")
    parser.add_argument("--tune", choices=["quick", "default", "exhaustive"],
                        help="first tune the model's GEMMs (train, prefill and decode rows, and "
                             "the chunked loss head; the FP8 recipes' GEMMs too) with this "
                             "strategy")
    fp8 = parser.add_argument_group("FP8 (issue 38; benchmarks/e2e_fp8.py)")
    fp8.add_argument("--fp8-only", action="store_true",
                     help="only the FP8 rows' variants: eager, ours, ours fp8 per recipe, and "
                          "the torchao peers; train and prefill; the file's other rows of the "
                          "same code are kept")
    fp8.add_argument("--no-fp8", action="store_true", help="no FP8 variants, no peers")
    fp8.add_argument("--recipes", nargs="+", choices=VARIANTS, default=list(RECIPES),
                     help="our FP8 recipes to measure (default the three; R+lm_head: R with "
                          "the LM head FP8 too)")
    fp8.add_argument("--peers", nargs="+", choices=[*PEERS, "none"], default=None,
                     help="peers measured in their own processes (default torchao's two "
                          "recipes with Liger's fused loss and with HF's loss compiled, and "
                          "Liger; torchao's alone with --fp8-only)")
    fp8.add_argument("--peers-only", action="store_true",
                     help="only run the peers into --peer-dir (for a later run to reuse)")
    fp8.add_argument("--peer-dir", default=str(Path(__file__).resolve().parent.parent / "build"
                                               / "e2e_peers"),
                     help="where peers write their results and logs; a result there of the "
                          "same code, model, tokens and reps is reused (default build/e2e_peers)")
    fp8.add_argument("--fresh-peers", action="store_true", help="rerun peers with a result")
    fp8.add_argument("--peer-timeout", type=float, default=540,
                     help="seconds a peer's process may take (default 540)")
    fp8.add_argument("--only-variant", choices=PEERS, help=argparse.SUPPRESS)
    fp8.add_argument("--json", help=argparse.SUPPRESS)  # --only-variant's result file
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.tokens, args.new_tokens = 2, 1024, 32
    if args.sections is None:
        args.sections = ["train", "prefill"] if args.fp8_only else list(SECTIONS)
    if args.no_fp8:
        args.recipes, args.peers = [], ["none"]
    if args.peers is None:
        args.peers = list(TORCHAO + TORCHAO_HF_LOSS) if args.fp8_only else list(DEFAULT_PEERS)
    args.peers = [p for p in args.peers if p != "none"]
    return args


def build_variants(args):
    """The variants measured in this process (eager first), convert's bf16 report, and the FP8
    variants' (reasons of those missing, conversions)."""
    import cutlass_ops

    from benchmarks import e2e_fp8

    eager = llama(args.layers)
    if args.tune:
        tune(eager, args)
    ours = copy.deepcopy(eager)
    report = cutlass_ops.convert(ours)
    variants = {"eager": eager, "ours": ours}
    if not args.fp8_only and not args.no_loss_baseline:
        # The converted model without the chunked loss head: what the fused loss is measured
        # against (its time and its memory).
        unfused_loss = copy.deepcopy(eager)
        cutlass_ops.convert(unfused_loss, fused_loss=False)
        variants["ours without fused loss"] = unfused_loss
    models, missing, conversions = e2e_fp8.fp8_variants(eager, args.recipes)
    variants.update(models)
    if not args.fp8_only and not args.no_graphs:
        variants[GRAPHED] = ours  # the same model, its steps through cutlass_ops.graphed_steps
    if not args.fp8_only and not args.no_compile:
        variants["compile"] = torch.compile(eager)
        variants["ours+compile"] = torch.compile(ours)
        if not args.no_graphs:
            variants[COMPILE_GRAPHS] = torch.compile(eager, mode="reduce-overhead")
    return variants, report, missing, conversions


def main() -> None:
    args = parse_args()
    from benchmarks import e2e_fp8

    require_gpu()
    if args.only_variant:
        raise SystemExit(e2e_fp8.peer_main(args))
    measured = {"train", "prefill"} & set(args.sections)
    peers = e2e_fp8.run_peers(args.peers, args, Path(args.peer_dir), args.peer_timeout,
                              args.fresh_peers) if measured or args.peers_only else {}
    if args.peers_only:
        return
    variants, report, missing, conversions = build_variants(args)
    fragile = set(conversions) | {GRAPHED, COMPILE_GRAPHS}
    ids = token_ids(args.tokens)
    name = "e2e_quick" if args.quick else "e2e"
    meta = {"layers": args.layers, "tokens": args.tokens, "new_tokens": args.new_tokens,
            "converted": len(report.converted), "skipped": len(report.skipped),
            "conversion": str(report).splitlines()[0]}
    # The file's rows of the same code and model that this run does not measure: the other
    # sections' (each run of --sections adds its own), or with --fp8-only every row it does not
    # write again.
    old = rows_of_same_run(name, meta) if args.fp8_only else \
        kept_rows(name, meta, set(args.sections))
    rows = []
    two_layers = None if args.quick else two_layer_run()  # run --quick first

    def save():
        kept = replaced_rows(old, rows) if args.fp8_only else old
        extra = {"detail": {"two_layers": two_layers}} if two_layers else {}
        write_result(name, kept + rows, model="Llama-3-8B-shaped", **meta, **extra)

    emulations = e2e_fp8.Emulations(variants["eager"], ids)
    if "train" in args.sections:
        tolerances = {n: emulations.tolerances(n.rsplit(" ", 1)[1]) for n in conversions}
        train = measure_train(variants, ids, args.reps, tolerances, fragile, busy=True)
        train.update({n: {"error": why} for n, why in missing.items()})
        rows += train_rows(train, args.tokens)
        if args.recipes:
            rows += e2e_fp8.train_rows(train, peers, args.tokens, args.recipes)
        save()
    inference = {k: v for k, v in variants.items() if k != "ours without fused loss"}
    if "prefill" in args.sections:
        prefill = measure_prefill(inference, ids, args.reps, fragile)
        prefill.update({n: {"error": why} for n, why in missing.items()})
        rows += prefill_rows(prefill, args.tokens)
        if args.recipes:
            rows += e2e_fp8.prefill_rows(prefill, args.tokens, args.recipes, emulations, peers)
        save()
    decode_variants = {k: v for k, v in variants.items() if k in ("eager", "ours")}
    if "ours" in decode_variants:
        decode_variants[OURS_HF_GENERATE] = variants["ours"]  # the same model, HF's generate()
    if not args.no_compile:
        decode_variants[HF_STATIC] = variants["eager"]  # generate() compiles it (static cache)
    for batch in (1, 16) if "decode" in args.sections else ():
        decode = measure_decode(decode_variants, batch, args.new_tokens, max(5, args.reps // 2),
                                calls={"ours": graphed_generate})
        check = decode_check(decode, decode_variants, graphed=True)  # once for the batch
        for reference in [r for r in ("eager", HF_STATIC, OURS_HF_GENERATE) if r in decode]:
            rows.append(decode_row(decode, decode_variants, batch, args.new_tokens,
                                   reference=reference, graphed=True, check=check))
        save()
    print_table(["case", "ours", "reference", "ratio", "correct"],
                [[r["case"], r["ours"], r["reference"], r["ratio"], r["correct"]] for r in rows])
    print(report.__str__().splitlines()[0])
    for variant, line in {**conversions, **missing}.items():
        print(f"{variant}: {line}")


if __name__ == "__main__":
    main()
