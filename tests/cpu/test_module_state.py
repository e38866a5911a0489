"""cutlass_ops.module_state: one place for what the library keeps on a model's modules. States
are kept per class, survive deepcopy as their class says, never reach the state_dict, and a
forward that reads them (or makes one it lacks) traces under torch.compile(fullgraph=True)."""

import copy
import dataclasses

import torch
from torch import nn

from cutlass_ops import module_state


@dataclasses.dataclass
class Counter:
    calls: int = 0


@dataclasses.dataclass
class Scale:
    value: float = 2.0


class Scaled(nn.Linear):
    def forward(self, x):
        return super().forward(x) * module_state.ensure(self, Scale).value


def test_states_are_kept_per_class_and_dropped():
    module = nn.Linear(2, 2)
    assert module_state.get(module, Counter) is None
    counter = module_state.ensure(module, Counter)
    counter.calls += 1
    assert module_state.ensure(module, Counter) is counter
    module_state.put(module, Scale(3.0))
    assert module_state.get(module, Scale).value == 3.0 and module_state.get(module, Counter).calls == 1
    assert module_state.take(module, Scale).value == 3.0 and module_state.get(module, Scale) is None
    module_state.drop(module, Counter)
    assert module_state.get(module, Counter) is None
    module_state.drop(module, Counter)  # dropping what is not there is fine


def test_states_are_copied_with_the_module_and_stay_out_of_the_state_dict():
    module = nn.Linear(2, 2)
    module_state.put(module, Scale(5.0))
    twin = copy.deepcopy(module)
    assert module_state.get(twin, Scale) == Scale(5.0)
    assert module_state.get(twin, Scale) is not module_state.get(module, Scale)
    assert set(module.state_dict()) == {"weight", "bias"}


def test_a_forward_reading_its_state_compiles_fullgraph():
    module = Scaled(4, 4)
    module_state.put(module, Scale(0.5))
    x = torch.randn(3, 4)
    compiled = torch.compile(module, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), module(x))


def test_a_forward_making_its_state_compiles_fullgraph():
    module = Scaled(4, 4)  # no state yet: the traced forward makes it
    x = torch.randn(3, 4)
    out = torch.compile(module, fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(out, nn.functional.linear(x, module.weight, module.bias) * 2.0)
    assert module_state.get(module, Scale) == Scale(2.0)
