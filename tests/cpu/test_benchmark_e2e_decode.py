"""benchmarks/e2e.py's decode rows on a CPU, with a tiny random-weight Hugging Face Llama: the
row against Hugging Face's static-cache compiled generate() names that peer, records its settings
and eager's figure beside it, keeps ratio = ours / reference, and is judged by the same
teacher-forced check against eager's model (a copy with a layer skipped fails it)."""

import copy
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import e2e  # noqa: E402
from model_faults import skip_layer  # noqa: E402

VOCAB, NEW = 256, 4


def tiny_llama():
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def decoded(ms: dict) -> dict:
    """measure_decode's result for three variants sharing eager's greedy tokens."""
    tokens = torch.randint(0, VOCAB, (1, e2e.PROMPT + NEW),
                           generator=torch.Generator().manual_seed(3))
    return {name: {"tokens": tokens, "ms": t} for name, t in ms.items()}


def row(ours, reference=e2e.HF_STATIC, ms=None):
    eager = tiny_llama()
    decode = decoded(ms or {"eager": 40.0, "ours": 20.0, e2e.HF_STATIC: 25.0})
    return e2e.decode_row(decode, {"ours": ours(eager), "eager": eager}, 1, NEW,
                          reference=reference)


def test_the_static_cache_row_names_its_peer_and_keeps_eager_beside_it():
    result = row(copy.deepcopy)
    assert result["case"] == "decode batch 1 ours vs hf static compile"
    assert result["reference_name"] == e2e.HF_STATIC
    assert result["ratio"] == round(result["ours"] / result["reference"], 4) == 1.25
    detail = result["detail"]
    assert detail["eager"] == pytest.approx(NEW / 40.0 * 1e3)
    settings = detail["reference_settings"]
    assert settings["cache_implementation"] == "static"
    assert settings["compiled"] is False  # nothing ran generate() with it here
    assert settings["transformers"] == transformers.__version__
    assert settings["compile_config"]["mode"] == "reduce-overhead"
    assert detail["logits_tolerance"] > 0 and "teacher_forced_worst_logits_error" in detail
    assert result["correct"]


def test_the_static_cache_row_fails_a_model_with_a_layer_skipped():
    result = row(lambda eager: skip_layer(copy.deepcopy(eager), 1))
    assert not result["correct"]
    assert result["detail"]["teacher_forced_worst_logits_error"] > \
        result["detail"]["logits_tolerance"]


def test_the_eager_row_is_unchanged():
    result = row(copy.deepcopy, reference="eager")
    assert result["case"] == "decode batch 1 ours vs eager"
    assert "reference_settings" not in result["detail"] and "eager" not in result["detail"]
    assert result["ratio"] == 2.0


def test_ours_decodes_through_the_graphed_decoder_with_generates_tokens():
    """graphed_generate (ours' decode) gives the greedy tokens of generate() with the same
    stopping rule (min_new_tokens = max_new_tokens: the end-of-sequence token held back)."""
    model = tiny_llama()
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=9,
                              min_new_tokens=9, do_sample=False, pad_token_id=0)
    assert torch.equal(e2e.graphed_generate(model, prompt, 9), expected)


@pytest.mark.parametrize("ours, correct", [(copy.deepcopy, True),
                                           (lambda eager: skip_layer(copy.deepcopy(eager), 1),
                                            False)], ids=["copy", "layer skipped"])
def test_the_row_against_hf_generate_checks_ours_through_its_graphed_steps(ours, correct):
    eager = tiny_llama()
    decode = decoded({"eager": 40.0, "ours": 20.0, e2e.OURS_HF_GENERATE: 30.0})
    result = e2e.decode_row(decode, {"ours": ours(eager), "eager": eager}, 1, NEW,
                            reference=e2e.OURS_HF_GENERATE, graphed=True)
    assert result["case"] == "decode batch 1 ours vs ours hf generate"
    assert result["ratio"] == pytest.approx(1.5, abs=1e-3) and result["correct"] is correct


def test_a_batch_s_rows_share_one_teacher_forced_check(monkeypatch):
    """The check is made once and handed to each of the batch's rows, not made again per
    reference (each costs a whole teacher-forced decode of both models)."""
    eager = tiny_llama()
    models = {"ours": copy.deepcopy(eager), "eager": eager}
    decode = decoded({"eager": 40.0, "ours": 20.0, e2e.HF_STATIC: 25.0})
    check = e2e.decode_check(decode, models, graphed=True)
    monkeypatch.setattr(e2e.model_checks, "teacher_forced_decode",
                        lambda *a, **k: pytest.fail("checked again"))
    rows = [e2e.decode_row(decode, models, 1, NEW, reference=r, graphed=True, check=check)
            for r in ("eager", e2e.HF_STATIC)]
    assert all(r["correct"] for r in rows)
    assert rows[0]["detail"]["teacher_forced_worst_logits_error"] == \
        rows[1]["detail"]["teacher_forced_worst_logits_error"]
