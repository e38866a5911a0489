"""Fixtures of the CPU tests."""

import logging

import pytest


@pytest.fixture
def warnings(caplog):
    """The warnings on the "cutlass_ops" logger, each reason logged afresh for this test."""
    import cutlass_ops.gemms.dispatch
    from custom_kernels.core import fallback

    fallback.logged.clear()
    cutlass_ops.gemms.dispatch.reset()  # routes memoized by other tests log nothing
    with caplog.at_level(logging.WARNING, logger="cutlass_ops"):
        yield lambda: [r.getMessage() for r in caplog.records if r.name == "cutlass_ops"]
