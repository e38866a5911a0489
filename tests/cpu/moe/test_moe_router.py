"""The one-pass top-k router (cutlass_ops.moe.moe_router) on the CPU (``route``'s torch reference
stands in for its kernels), against Hugging Face's own routers in their blocks (Mixtral: float32
weights, always renormalised; Qwen3-MoE: the logits' dtype, renormalised or not): the block's
output, every gradient (the router's weight too), the experts taking the router's sort (and
sorting for themselves when the index they get is another tensor), the probe finding each
router's normalisation and refusing a router that computes something else, the structure
refusals, the state_dict, the class kept as a base, and convert's report."""

import copy

import pytest
import torch

from cutlass_ops import module_state
from cutlass_ops.moe import experts as moe_experts, moe_router

from test_moe import assert_same_block, mixtral, qwen3_moe  # noqa: E402

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def quiet(warnings):
    yield  # route's CPU rule logs once


def grouped(block):
    block = copy.deepcopy(block)
    block.experts = moe_experts.GroupedExperts(block.experts)
    return block


def qwen3_unnormalised(dtype=torch.float32):
    block = qwen3_moe(dtype)
    block.gate.norm_topk_prob = False
    return block


@pytest.fixture
def handed(monkeypatch):
    """Whether each experts call got the router's sort."""
    seen = []
    forward = moe_experts.experts_forward

    def spy(*args, **kwargs):
        seen.append(args[-1] is not None)  # the pairs (the GEMM comes by keyword)
        return forward(*args, **kwargs)

    monkeypatch.setattr(moe_experts, "experts_forward", spy)
    return seen


@pytest.mark.parametrize("make", [mixtral, qwen3_moe, qwen3_unnormalised],
                         ids=["mixtral", "qwen3_moe", "qwen3_unnormalised"])
def test_the_block_with_the_fused_router_matches_hugging_faces(make, handed):
    theirs = grouped(make())
    ours = copy.deepcopy(theirs)
    assert moe_router.fuse_router(ours) is None
    plan = moe_router.plan_of(ours.gate)
    assert plan.normalize == (make is not qwen3_unnormalised)
    assert plan.weights_dtype is None  # float32 logits: float32 weights either way
    assert_same_block(ours, theirs, x_rtol=1e-4)
    assert handed == [False, True]  # theirs sorts for itself, ours takes the router's


@pytest.mark.parametrize("make,weights", [(mixtral, torch.float32), (qwen3_moe, None)],
                         ids=["mixtral", "qwen3_moe"])
def test_bfloat16_routers_keep_their_weights_dtype(make, weights):
    """Mixtral's router returns float32 weights, Qwen3-MoE's the logits' dtype: the probe finds
    which, and the block stays within bf16's tolerance of Hugging Face's."""
    from custom_kernels.core.tolerances import relative_error

    theirs = grouped(make(torch.bfloat16))
    ours = copy.deepcopy(theirs)
    assert moe_router.fuse_router(ours) is None
    assert moe_router.plan_of(ours.gate).weights_dtype is weights
    x = torch.randn(2, 24, 64).bfloat16()
    assert ours.gate(x.view(-1, 64))[1].dtype == theirs.gate(x.view(-1, 64))[1].dtype
    assert relative_error(ours(x), theirs(x)) < 1e-2


def test_the_experts_sort_for_themselves_when_the_index_is_another_tensor(handed):
    block = grouped(qwen3_moe())
    assert moe_router.fuse_router(block) is None
    h = torch.randn(10, 64)
    _, weights, index = block.gate(h)
    handed.clear()
    out = block.experts(h, index.clone(), weights)  # not the tensor the router handed over
    assert handed == [False]
    torch.testing.assert_close(out, block.experts(h, index, weights))  # (and nothing stale)
    assert module_state.get(block.experts, moe_experts.SortedPairs) is None


def test_the_router_keeps_its_class_as_a_base_its_weight_and_its_state_dict():
    block = grouped(qwen3_moe())
    cls, keys = type(block.gate), set(block.state_dict())
    weight = block.gate.weight
    assert moe_router.fuse_router(block) is None
    assert isinstance(block.gate, cls) and isinstance(block.gate, moe_router.FusedTopKRouter)
    assert block.gate.weight is weight and set(block.state_dict()) == keys
    assert "one routing pass" in moe_router.describe(block.gate)
    assert moe_router.fuse_router(block) == "its router is fused already"
    moe_router.unfuse_router(block.gate)
    assert type(block.gate) is cls and moe_router.plan_of(block.gate) is None


def test_the_probe_refuses_a_router_that_computes_something_else():
    block = grouped(qwen3_moe())
    original = type(block.gate).forward

    def hotter(self, hidden):  # a temperature the structure does not show
        logits, _, _ = original(self, hidden)
        probs = torch.softmax(logits.float() / 0.3, -1)
        weights, index = probs.topk(self.top_k, -1)
        return logits, weights / weights.sum(-1, keepdim=True), index

    block.gate.forward = hotter.__get__(block.gate)
    why = moe_router.fuse_router(block)
    assert why is not None and "not a softmax or sigmoid top-k" in why
    assert not isinstance(block.gate, moe_router.FusedTopKRouter)


@pytest.mark.parametrize("seed", range(6))
def test_the_probe_takes_qwen3_moe_routers_whose_bf16_logits_tie(seed):
    """Qwen3-MoE's router (128 experts, top 8, bf16): tied logits inside the top 8 come out of
    torch.topk in another order than ours, and at the 8th score a tie may pick another expert.
    Compared in top-k order, 10-22% of the probe's rows differed and some layers of one model
    were refused; as sets, with ties at the k-th score allowed, every seed is taken."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = transformers.Qwen3MoeConfig(hidden_size=2048, num_experts=128,
                                         num_experts_per_tok=8, norm_topk_prob=True)
    torch.manual_seed(seed)
    gate = Qwen3MoeTopKRouter(config).to(torch.bfloat16)
    torch.nn.init.normal_(gate.weight, std=0.02)
    plan, why = moe_router.probe(gate)
    assert why is None and plan == moe_router.RoutingPlan(8, "softmax", True, None)


def test_the_probe_refuses_a_router_that_picks_other_experts():
    block = grouped(qwen3_moe())
    original = type(block.gate).forward

    def lowest(self, hidden):  # the same weights' shape, the wrong experts
        logits, _, _ = original(self, hidden)
        probs = torch.softmax(-logits.float(), -1)
        weights, index = probs.topk(self.top_k, -1)
        return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), index

    block.gate.forward = lowest.__get__(block.gate)
    why = moe_router.fuse_router(block)
    assert why is not None and "not a softmax or sigmoid top-k" in why


@pytest.mark.parametrize("change,words", [
    (lambda b: setattr(b, "experts", torch.nn.Identity()), "GroupedExperts"),
    (lambda b: setattr(b.gate, "top_k", 2.0), "top_k"),
    (lambda b: setattr(b.gate, "top_k", 99), "top_k"),
    (lambda b: b.gate.register_parameter("weight", torch.nn.Parameter(torch.zeros(8, 32))),
     "is not (experts, hidden)"),
])
def test_structure_refusals(change, words):
    block = grouped(qwen3_moe())
    change(block)
    why = moe_router.structure_refusal(block)
    assert why is not None and words in why


def test_convert_reports_routers_only_where_experts_were_converted():
    """Off a GPU the experts stay (their decision says why), so no router is touched."""
    import cutlass_ops

    block = qwen3_moe()
    report = cutlass_ops.convert(torch.nn.ModuleDict({"mlp": block}))
    assert not any(d.name.endswith("gate") for d in report.decisions)
    assert not isinstance(block.gate, moe_router.FusedTopKRouter)


def test_the_block_with_the_fused_router_compiles_with_fullgraph():
    """Under torch.compile the router hands nothing over and the experts sort for themselves
    (a dict pop on a module is not traceable)."""
    block = grouped(qwen3_moe())
    assert moe_router.fuse_router(block) is None
    x = torch.randn(1, 8, 64)
    want = block(x)
    got = torch.compile(block, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(got, want)
