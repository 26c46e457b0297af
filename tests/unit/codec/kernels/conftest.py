"""What the fused CPU op's tests share: the op, glibc filling every allocation with a non-zero byte (so an
unwritten payload byte shows).
"""

import ctypes
import platform

import pytest

from deepspeed_dgc.codec.kernels import FusedCPUOps, load_fused_op


@pytest.fixture(scope="module")
def fused():
    return FusedCPUOps(load_fused_op("cpu"))


@pytest.fixture(autouse=True, scope="module")
def dirty_allocations():
    """glibc fills every allocation with a non-zero byte while these tests run (mallopt M_PERTURB), so a payload
    byte the op leaves unwritten differs from the reference's instead of reading as a fresh page's zero."""
    libc = ctypes.CDLL(None) if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc" else None
    m_perturb = -6
    if libc is not None:
        libc.mallopt(m_perturb, 0xA5)
    yield
    if libc is not None:
        libc.mallopt(m_perturb, 0)


