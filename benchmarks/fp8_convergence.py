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

    python benchmarks/fp8_convergence.py [--steps 200] [--recipes tensorwise rowwise blockwise]

Writes benchmarks/results/fp8_convergence.json. ``run()`` is what tests/gpu calls.
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


def build_model(device, dtype, seed: int = 0, positions: int = SEQ, **sizes):
    """The Llama-shaped model with random weights (seeded), without a download."""
    import torch
    import transformers

    config = transformers.LlamaConfig(**{**MODEL, **sizes}, max_position_embeddings=positions)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)


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


def row(recipe: str, reference: list[float], losses: list[float], check: dict) -> dict:
    """A BENCHMARKS.md row for one recipe (module docstring)."""
    return {"case": f"convergence fp8 {recipe} vs bf16", "unit": "1/loss",
            "ours": 1.0 / losses[-1], "reference": 1.0 / reference[-1],
            "reference_name": "ours bf16 (convert)", "ratio": reference[-1] / losses[-1],
            "correct": check["passed"],
            "detail": {**check, "curve_bound": CURVE_BOUND, "final_bound": FINAL_BOUND,
                       "first_loss": losses[0], "final_loss": losses[-1],
                       "reference_final_loss": reference[-1]}}


def run(recipes=RECIPES, steps: int = 200, device: str = "cuda", batch: int = BATCH,
        seq: int = SEQ, seed: int = 0, **sizes) -> dict:
    """Trains bf16 and each recipe (module docstring); returns {"rows": [...], "curves":
    {"bf16": [...], recipe: [...]}, "config": {...}}, JSON-able. ``sizes``: LlamaConfig fields
    replacing the default model's (smaller models for tests)."""
    import torch

    import cutlass_ops

    config = {**MODEL, **sizes}
    stream = markov_stream(config["vocab_size"], steps * batch * seq, seed)
    initial = build_model(device, torch.bfloat16, seed, seq, **sizes)
    curves, reports = {}, {}
    for variant in ("bf16", *recipes):
        model = copy.deepcopy(initial)
        report = cutlass_ops.convert(model, fp8=None if variant == "bf16" else variant)
        reports[variant] = report.fp8
        curves[variant] = train(model, stream, steps, batch, seq)
        del model
    rows = []
    for recipe in recipes:
        check = compare(curves["bf16"], curves[recipe])
        rows.append(row(recipe, curves["bf16"], curves[recipe], check))
        rows[-1]["detail"]["fp8_layers"] = len(reports[recipe])
    return {"rows": rows, "curves": curves,
            "config": {**config, "steps": steps, "batch": batch, "seq": seq, "seed": seed,
                       "branching": BRANCHING, "device": str(device)}}


def main() -> None:
    from benchmarks.common import print_table, require_gpu, write_result

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    args = parser.parse_args()
    require_gpu()
    result = run(args.recipes, args.steps)
    print_table(["case", "max deviation", "final deviation", "correct"],
                [[r["case"], f"{r['detail']['max_deviation']:.4f}",
                  f"{r['detail']['final_deviation']:.4f}", r["correct"]]
                 for r in result["rows"]])
    path = write_result("fp8_convergence", result["rows"], config=result["config"],
                        curves=result["curves"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
