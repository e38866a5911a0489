"""Integers checked against the C types a launcher takes them in, before any call: the GEMM and
grouped launchers' extents and strides, and the NVRTC kernels' counts. Pure shape work: meta
tensors stand for problems far larger than any memory."""

import ctypes

import pytest
import torch

import cutlass_ops
from cutlass_ops.gemms import dispatch, inputs, runtime
from cutlass_ops.gemms.config import GemmConfig, Layout
from custom_kernels.core import int_limits
from custom_kernels.core.errors import UnsupportedInputError

HUGE = 2**32 + 16  # ctypes' int32 would keep 16 of it


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def test_c_ranges_names_and_the_first_misfit():
    assert int_limits.c_range(ctypes.c_int32) == (-2**31, 2**31 - 1)
    assert int_limits.c_range(ctypes.c_uint32) == (0, 2**32 - 1)
    assert int_limits.c_range(ctypes.c_int64) == (-2**63, 2**63 - 1)
    assert int_limits.c_name(ctypes.c_uint64) == "uint64"
    assert int_limits.misfit({"a": 1, "b": 2**31 - 1}, ctypes.c_int32) is None
    why = int_limits.misfit({"a": 1, "M": HUGE}, ctypes.c_int32, "the launcher's")
    assert why == "M = 4294967312 does not fit the launcher's int32 (at most 2147483647)"
    assert "at least 0" in int_limits.misfit({"n": -1}, {"n": ctypes.c_uint32})
    assert int_limits.fits(2**63 - 1, ctypes.c_int64) and not int_limits.fits(2**63,
                                                                              ctypes.c_int64)


def test_ctypes_truncates_silently_which_is_why_the_checks_exist():
    assert runtime.GemmArgs(m=HUGE).m == 16
    fields = int_limits.field_types(runtime.GemmArgs)
    assert {fields[f] for f in "mnkl"} == {inputs.EXTENT_TYPE}
    assert {t for name, t in fields.items() if "_stride_" in name} == {inputs.STRIDE_TYPE}


@pytest.mark.parametrize("a_shape, b_shape, named", [
    ((HUGE, 64), (64, 64), "M = 4294967312"),
    ((64, 64), (64, HUGE), "N = 4294967312"),
    ((64, HUGE), (HUGE, 64), "K = 4294967312"),
    ((2**31, 1, 64), (2**31, 64, 8), "the batch = 2147483648"),
])
def test_gemm_extents_beyond_int32_are_refused_naming_the_extent(a_shape, b_shape, named):
    with pytest.raises(UnsupportedInputError, match=f"{named} does not fit the CUTLASS "
                       r"launcher's int32 \(at most 2147483647\)"):
        inputs.check_product(meta(*a_shape), meta(*b_shape))
    largest = inputs.check_product(meta(2**31 - 1, 64), meta(64, 64))
    assert largest.problem.m == 2**31 - 1  # the largest int32 passes, as it is


def test_strides_beyond_int64_are_refused():
    view = inputs.MatrixView(64, 64, 2, Layout.ROW, 2**63, 64, 0, inputs.DType.BF16)
    with pytest.raises(UnsupportedInputError, match="A's leading dimension = 9223372036854775808 "
                       "does not fit the CUTLASS launcher's int64"):
        inputs.check_launcher_integers(inputs.strides(view, "A"), inputs.STRIDE_TYPE)
    inputs.check_launcher_integers({"A's batch stride": 2**63 - 1}, inputs.STRIDE_TYPE)


def test_gemm_and_plan_raise_before_any_call(monkeypatch):
    """The named-kernel entry points: the device rule passes (as on a GPU), then the integer
    check refuses before an arch query, a build or a load."""
    from cutlass_ops.gemms import loader, plan

    monkeypatch.setattr(plan, "require_cuda", lambda tensors, entry: torch.device("cuda", 0))
    monkeypatch.setattr(loader, "kernel_for", lambda *a: pytest.fail("loaded a kernel"))
    monkeypatch.setattr(inputs, "arch_refusal", lambda *a: pytest.fail("asked the GPU"))
    for entry in (cutlass_ops.gemm, cutlass_ops.plan):
        with pytest.raises(UnsupportedInputError, match="M = 4294967312"):
            entry(meta(HUGE, 64), meta(64, 64), config=GemmConfig())


def test_matmul_routes_an_oversized_problem_to_torch_with_one_log_line(monkeypatch, warnings):
    """``cutlass_ops.matmul`` as on an sm90 GPU (the device rule passes): the refusal sends the
    call to torch.matmul, with one log line naming M and the limit."""
    monkeypatch.setattr(dispatch, "_torch_reason", lambda *args: None)
    a, b = meta(HUGE, 64), meta(64, 64)
    _, reason, _ = dispatch._check(a, b, None, None, "identity", None)
    assert "M = 4294967312" in reason
    for _ in range(2):
        found = dispatch.route(a, b)
        out = cutlass_ops.matmul(a, b)
    assert found.kind == "torch" and found.decision.source == "torch"
    assert out.shape == (HUGE, 64)  # torch's answer, not one for M = 16
    lines = [line for line in warnings() if "M = 4294967312" in line]
    assert len(lines) == 1 and "torch.matmul" in lines[0]


def test_the_residuals_strides_are_checked_too(monkeypatch):
    monkeypatch.setattr(inputs, "strides", lambda view, name: {
        f"{name}'s leading dimension": 2**63 if name == "C" else view.ld})
    product = inputs.check_product(meta(64, 64), meta(64, 64))
    with pytest.raises(UnsupportedInputError, match="C's leading dimension"):
        inputs.check_epilogue(product, c=meta(64, 64), beta=1.0)


def test_grouped_counts_beyond_the_launchers_int32_run_torch(monkeypatch, warnings):
    from cutlass_ops.moe import grouped
    from cutlass_ops.gemms.grouped import grouped_entries, grouped_runtime

    offs = meta(2**31, dtype=torch.int32)
    b = meta(2**31, 8, 8)
    why = grouped_runtime.integer_refusal("2d3d", meta(16, 8), b, offs)
    assert why == "groups = 2147483648 does not fit the grouped launcher's int32 (at most 2147483647)"
    wide = meta(16, 2**31 + 8)
    assert grouped_runtime.integer_refusal("2d3d", wide, meta(4, 2**31 + 8, 8), offs[:4]) == (
        "k = 2147483656 does not fit the grouped launcher's int32 (at most 2147483647)")
    assert grouped_runtime.integer_refusal("2d3d", meta(16, 8), b[:4], offs[:4]) is None
    monkeypatch.setattr(grouped_entries, "tuned_config",
                        lambda *a: pytest.fail("looked up a kernel for it"))
    assert grouped._tuned("2d3d", meta(16, 8), b, offs) is None
    assert any("torch._grouped_mm" in line and "groups = 2147483648" in line
               for line in warnings())


def test_cross_entropy_vocabulary_beyond_the_kernels_int_index_is_refused():
    from custom_kernels import cross_entropy

    largest = 2**31 - 1 - 8 * 1024  # a thread's int index runs up to 8 x 1024 past the row
    labels = meta(2, dtype=torch.int64)
    for vocab in (largest + 1, 2**31):
        logits = meta(2, vocab, dtype=torch.float16)
        with pytest.raises(UnsupportedInputError, match=f"0 < vocab <= {largest} "):
            cross_entropy.chunk_loss_and_grad(logits, labels)
        assert not cross_entropy._kernel_layout(logits)
    assert cross_entropy._kernel_layout(meta(2, largest, dtype=torch.float16))


def test_work_queue_tickets_and_kernel_arguments_never_wrap():
    from custom_kernels import cooperative, work_queue

    work_queue.check_tickets(2**32 - 1 - 132 * 8, 132, 256)  # just fits: each warp draws one more
    with pytest.raises(UnsupportedInputError, match="does not fit the work queue's uint32"):
        work_queue.check_tickets(2**32 - 132 * 8, 132, 256)
    assert cooperative._ctype(2**64 - 1).value == 2**64 - 1  # an address
    assert cooperative._ctype(-2**63).value == -2**63
    for value in (2**64, -2**63 - 1):
        with pytest.raises(UnsupportedInputError, match=f"a kernel argument = {value} does not "
                           "fit a C u?int64"):
            cooperative._ctype(value)


class _CudaGradient:
    """What clip_grad's plan and reasons read of a gradient on cuda:0."""

    device, dtype = "cuda:0", torch.float32

    def get_device(self):
        return 0


def test_clip_grad_with_more_tensors_than_an_int_holds_runs_torch(monkeypatch):
    from custom_kernels import clip_grad

    monkeypatch.setattr(clip_grad, "MAX_TENSORS", 2)  # 2**31 - 1 tensors would not fit a test
    monkeypatch.setattr(clip_grad, "_plan", lambda *a: pytest.fail("planned a launch"))
    grads = [_CudaGradient() for _ in range(3)]
    assert clip_grad._kernel_plan(grads, 2.0)[2] is None
    assert clip_grad._torch_reason(grads, 2) == (
        "3 gradients, more than the kernels' int index holds (2)")
