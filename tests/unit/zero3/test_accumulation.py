"""LocalAccumulation (deepspeed_dgc/zero3/accumulation.py) against sums formed directly, on fresh random gradients."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from deepspeed_dgc.zero3.accumulation import LocalAccumulation

SHAPES = [(7, 5), (33,), (2, 3, 4)]


def _window(micro_steps: int, dtype: torch.dtype, gen: torch.Generator):
    return [[torch.randn(s, generator=gen).to(dtype) for s in SHAPES] for _ in range(micro_steps)]


def _autograd_sum(window, i: int) -> torch.Tensor:
    """Tensor ``i``'s gradients added left to right in their own dtype (autograd's accumulation on a parameter)."""
    out = window[0][i].clone()
    for grads in window[1:]:
        out += grads[i]
    return out


@settings(max_examples=20, deadline=None)
@given(micro_steps=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_fp32_window_is_autograds_sum_bit_for_bit(micro_steps, seed):
    """fp32 gradients of ``micro_steps`` micro-steps: held, then folded into the last one's, equal the sum formed
    left to right (autograd's accumulation on the parameters, DeepSpeed's coalesced reduction), bit for bit, and
    nothing stays held; the float64 sum is within fp32 rounding."""
    window = _window(micro_steps + 1, torch.float32, torch.Generator().manual_seed(seed))
    acc = LocalAccumulation()
    keys = ["a", "b", "c"]
    for grads in window[:-1]:
        acc.hold([g.clone() for g in grads], keys)
    last = [g.clone() for g in window[-1]]
    acc.fold(last, keys)
    for i in range(len(SHAPES)):
        assert torch.equal(last[i], _autograd_sum(window, i))
        exact = sum(grads[i].double() for grads in window)
        torch.testing.assert_close(last[i].double(), exact, rtol=1e-6, atol=1e-6)
    assert len(acc) == 0 and acc.peak_bytes == 4 * sum(g.numel() for g in window[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_window_in_the_gradients_dtype_is_autograds_sum_bit_for_bit(dtype):
    """bf16 or fp16 gradients held in their own dtype (ZeRO-3's default accumulation dtype on such an engine): 2
    bytes per element, and the folded gradient is autograd's sum in that dtype, bit for bit."""
    window = _window(5, dtype, torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,)))))
    acc = LocalAccumulation()
    keys = ["a", "b", "c"]
    for grads in window[:-1]:
        acc.hold(grads, keys, dtype)
    assert all(h.dtype == dtype for h in acc.held.values())
    assert acc.peak_bytes == 2 * sum(g.numel() for g in window[0])
    last = [g.clone() for g in window[-1]]
    acc.fold(last, keys)
    for i in range(len(SHAPES)):
        assert torch.equal(last[i], _autograd_sum(window, i))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_window_is_summed_in_fp32_and_rounded_once(dtype):
    """bf16 or fp16 gradients with an fp32 accumulation dtype (``data_types.grad_accum_dtype``): the held sum is
    fp32 (4 bytes per element), and the folded gradient is the fp32 sum of all micro-steps rounded to the gradient's
    dtype once; nearer the float64 sum than autograd's sum in that dtype, which rounds every addition."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    window = _window(8, dtype, gen)
    acc = LocalAccumulation()
    keys = ["a", "b", "c"]
    for grads in window[:-1]:
        acc.hold(grads, keys)
    assert all(h.dtype == torch.float32 for h in acc.held.values())
    assert acc.peak_bytes == 4 * sum(g.numel() for g in window[0])
    last = [g.clone() for g in window[-1]]
    acc.fold(last, keys)
    err_ours = err_autograd = 0.0
    for i in range(len(SHAPES)):
        held = window[0][i].float()
        for grads in window[1:-1]:
            held += grads[i].float()
        assert torch.equal(last[i], (window[-1][i].float() + held).to(dtype))
        exact = sum(grads[i].double() for grads in window)
        naive = _autograd_sum(window, i)
        err_ours += float((last[i].double() - exact).abs().sum())
        err_autograd += float((naive.double() - exact).abs().sum())
    assert err_ours < err_autograd


def test_held_gradients_are_copies_and_leftovers_are_named():
    """What hold copies does not change when the caller reuses the gradients' memory (ZeRO-3's bucket buffer); a key
    held but not folded is a leftover, taken whole; zeros() hands read-only zero views of one buffer."""
    acc = LocalAccumulation()
    g = [torch.randn(5), torch.randn(3, 2)]
    want = [x.clone() for x in g]
    acc.hold(g, ["x", "y"])
    for x in g:
        x.fill_(7.0)  # the next bucket overwrites the buffer
    acc.fold([torch.zeros(5)], ["x"])
    assert acc.leftovers() == ["y"]
    assert torch.equal(acc.take("y"), want[1])
    assert len(acc) == 0
    z = acc.zeros(4, torch.float32, torch.device("cpu"))
    assert z.shape == (4, ) and not z.any()
    assert acc.zeros(2, torch.float32, torch.device("cpu")).data_ptr() == z.data_ptr()
    assert acc.zeros(0, torch.float32, torch.device("cpu")).numel() == 0
