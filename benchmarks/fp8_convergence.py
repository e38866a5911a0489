"""FP8 convergence (issue 38, Numerics): a 2-layer Llama-shaped model trained ``--steps`` (200)
AdamW steps on a fixed synthetic token stream whose loss falls, converted bf16
(``cutlass_ops.convert(model)``, the reference) and converted FP8 per recipe
(``convert(model, fp8=recipe)``), from the same initial weights on the same batches.

The stream is a first-order Markov chain: each token of the vocabulary has ``BRANCHING`` (4)
successors drawn once, each equally likely, so the loss falls from ln(vocab) toward ln(4) ~ 1.39
and never to zero (a loss near zero would make relative deviations meaningless). The model:
hidden 512, MLP 1536, 8 heads (head 64), 4 KV heads, vocabulary 1024, bf16 weights, the LM head
bf16 (convert's default); AdamW (lr 1e-3, betas 0.9 / 0.95, weight decay 0.01), gradients
clipped to norm 1; 8 sequences of 256 tokens a step (2048 tokens, a multiple of 128).

A recipe passes when its training loss is within ``CURVE_BOUND`` (3%) of bf16's at every 20th
step (the losses of the same step, on the same batch, before that step's update) and within
``FINAL_BOUND`` (1.5%) at the last step. Each row (BENCHMARKS.md schema): ``unit`` "1/loss" of
the last step, so that ``ratio`` = bf16's final loss over the recipe's (above 1: FP8 ended
lower); ``correct`` = passed; ``detail``: max_deviation, final_deviation, both bounds and both
loss curves at the checkpoints.

Issue 53 adds two kinds of rows, run by the same rule:
- ``--family qwen3-moe`` or ``mixtral``: a 2-layer mixture-of-experts model of those families
  (``MOE_MODELS``: widths blockwise takes, 8 or 4 experts, top 2), whose experts become FP8
  under the blockwise recipe (``cutlass_ops.fp8.fp8_experts``); rows ``convergence <family> fp8
  <recipe> vs bf16``, written to ``fp8_convergence_<family>.json``.
- ``--lm-head``: each recipe also with the LM head FP8 (``convert(..., fp8_lm_head=True)``;
  bf16 stays the default): rows ``convergence fp8 <recipe>+lm_head vs bf16``.

    python benchmarks/fp8_convergence.py [--steps 200] [--recipes tensorwise rowwise blockwise]
        [--family llama|qwen3-moe|mixtral] [--lm-head]

Writes benchmarks/results/fp8_convergence.json (``fp8_convergence_<family>.json`` for the MoE
families). ``run()`` is what tests/gpu calls.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RECIPES = ("tensorwise", "rowwise", "blockwise")
CHECK_EVERY = 20
CURVE_BOUND = 0.03
FINAL_BOUND = 0.015
BRANCHING = 4
MODEL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=4, vocab_size=1024)
BATCH, SEQ = 8, 256
FAMILIES = ("llama", "qwen3-moe", "mixtral")
# The MoE families' 2-layer models: expert widths multiples of 128 (the blockwise recipe's).
MOE_MODELS = {
    "qwen3-moe": dict(hidden_size=512, moe_intermediate_size=256, num_experts=8,
                      num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=64, vocab_size=1024, norm_topk_prob=True),
    "mixtral": dict(hidden_size=512, intermediate_size=768, num_local_experts=4,
                    num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=1024),
}
LM_HEAD = "+lm_head"  # a variant's suffix: the LM head FP8 too (convert(fp8_lm_head=True))


def variants(recipes, lm_head: bool) -> list[str]:
    """The FP8 variants a run trains: each recipe, and with ``lm_head`` each recipe + LM head."""
    return [*recipes, *([f"{r}{LM_HEAD}" for r in recipes] if lm_head else [])]


def model_config(family: str, **sizes) -> dict:
    """The family's model sizes, ``sizes`` replacing some."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    return {**(MODEL if family == "llama" else MOE_MODELS[family]), **sizes}


def markov_stream(vocab: int, tokens: int, seed: int = 0, branching: int = BRANCHING):
    """``tokens`` tokens of the fixed Markov chain (module docstring), on the CPU."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, branching), generator=generator)
    picks = torch.randint(0, branching, (tokens,), generator=generator)
    table, out, token = successors.tolist(), [], 0
    for pick in picks.tolist():
        out.append(token)
        token = table[token][pick]
    return torch.tensor(out, dtype=torch.long)


def build_model(device, dtype, seed: int = 0, positions: int = SEQ, family: str = "llama",
                **sizes):
    """The family's model (Llama-shaped by default) with random weights (seeded), without a
    download."""
    import torch
    import transformers

    kind = {"llama": transformers.LlamaConfig, "qwen3-moe": transformers.Qwen3MoeConfig,
            "mixtral": transformers.MixtralConfig}[family]
    config = kind(**model_config(family, **sizes), max_position_embeddings=positions)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype)


def train(model, stream, steps: int, batch: int, seq: int) -> list[float]:
    """The training loss of each AdamW step (before its update)."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95),
                                  weight_decay=0.01)
    device = next(model.parameters()).device
    losses = []
    model.train()
    for step in range(steps):
        chunk = stream[step * batch * seq:(step + 1) * batch * seq]
        ids = chunk.view(batch, seq).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach().float()))
    return losses


def compare(reference: list[float], losses: list[float], every: int = CHECK_EVERY,
            curve_bound: float = CURVE_BOUND, final_bound: float = FINAL_BOUND) -> dict:
    """The check of one curve against the reference's: the relative deviation at every
    ``every``-th step (1-based: steps every, 2 * every, ...) and at the last step."""
    checkpoints = list(range(every, len(reference) + 1, every)) or [len(reference)]
    deviations = [abs(losses[s - 1] - reference[s - 1]) / abs(reference[s - 1])
                  for s in checkpoints]
    final = abs(losses[-1] - reference[-1]) / abs(reference[-1])
    return {"checkpoints": checkpoints, "max_deviation": max(deviations),
            "final_deviation": final,
            "passed": max(deviations) <= curve_bound and final <= final_bound,
            "reference_losses": [reference[s - 1] for s in checkpoints],
            "losses": [losses[s - 1] for s in checkpoints]}


def case(variant: str, family: str = "llama") -> str:
    return f"convergence {'' if family == 'llama' else family + ' '}fp8 {variant} vs bf16"


def row(recipe: str, reference: list[float], losses: list[float], check: dict,
        family: str = "llama") -> dict:
    """A BENCHMARKS.md row for one recipe (module docstring)."""
    return {"case": case(recipe, family), "unit": "1/loss",
            "ours": 1.0 / losses[-1], "reference": 1.0 / reference[-1],
            "reference_name": "ours bf16 (convert)", "ratio": reference[-1] / losses[-1],
            "correct": check["passed"],
            "detail": {**check, "curve_bound": CURVE_BOUND, "final_bound": FINAL_BOUND,
                       "first_loss": losses[0], "final_loss": losses[-1],
                       "reference_final_loss": reference[-1]}}


def run(recipes=RECIPES, steps: int = 200, device: str = "cuda", batch: int = BATCH,
        seq: int = SEQ, seed: int = 0, family: str = "llama", lm_head: bool = False,
        **sizes) -> dict:
    """Trains bf16 and each FP8 variant (``variants``; module docstring); returns {"rows":
    [...], "curves": {"bf16": [...], variant: [...]}, "config": {...}}, JSON-able. ``sizes``:
    config fields replacing the family's default model's (smaller models for tests)."""
    import torch

    import cutlass_ops

    config = model_config(family, **sizes)
    stream = markov_stream(config["vocab_size"], steps * batch * seq, seed)
    initial = build_model(device, torch.bfloat16, seed, seq, family, **sizes)
    curves, reports = {}, {}
    for variant in ("bf16", *variants(recipes, lm_head)):
        model = copy.deepcopy(initial)
        recipe = None if variant == "bf16" else variant.removesuffix(LM_HEAD)
        report = cutlass_ops.convert(model, fp8=recipe, fp8_lm_head=variant.endswith(LM_HEAD))
        reports[variant] = report.fp8
        curves[variant] = train(model, stream, steps, batch, seq)
        del model
    rows = []
    for variant in variants(recipes, lm_head):
        check = compare(curves["bf16"], curves[variant])
        rows.append(row(variant, curves["bf16"], curves[variant], check, family))
        rows[-1]["detail"]["fp8_layers"] = len(reports[variant])
        rows[-1]["detail"]["fp8_modules"] = sorted(reports[variant])
    return {"rows": rows, "curves": curves,
            "config": {**config, "family": family, "steps": steps, "batch": batch, "seq": seq,
                       "seed": seed, "branching": BRANCHING, "device": str(device)}}


def main() -> None:
    from benchmarks.common import print_table, require_gpu, write_result

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--recipes", nargs="+", default=None, choices=RECIPES,
                        help="default: all; blockwise for the MoE families (their experts' "
                        "only FP8 recipe)")
    parser.add_argument("--family", default="llama", choices=FAMILIES)
    parser.add_argument("--lm-head", action="store_true",
                        help="each recipe also with the LM head FP8")
    args = parser.parse_args()
    require_gpu()
    recipes = args.recipes or (list(RECIPES) if args.family == "llama" else ["blockwise"])
    result = run(recipes, args.steps, family=args.family, lm_head=args.lm_head)
    print_table(["case", "max deviation", "final deviation", "correct"],
                [[r["case"], f"{r['detail']['max_deviation']:.4f}",
                  f"{r['detail']['final_deviation']:.4f}", r["correct"]]
                 for r in result["rows"]])
    name = "fp8_convergence" + ("" if args.family == "llama" else f"_{args.family}")
    path = write_result(name, result["rows"], config=result["config"], curves=result["curves"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
