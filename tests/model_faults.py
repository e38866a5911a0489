"""Faults planted in a Hugging Face decoder model, for the tests that show a check catches them
(tests/cpu/test_benchmark_model_checks.py, tests/gpu/test_benchmark_model_checks_gpu.py)."""

import torch


def skip_layer(model, index):
    """Decoder layer ``index`` returns its input unchanged, in the form Hugging Face's layers
    return their output (the hidden states); its parameters stay, with no gradient."""
    model.model.layers[index].forward = lambda hidden_states, *args, **kwargs: hidden_states
    return model


def zero_mlp(model, index):
    """Decoder layer ``index``'s MLP weights set to zero: the layer adds nothing through it."""
    with torch.no_grad():
        for p in model.model.layers[index].mlp.parameters():
            p.zero_()
    return model
