"""The wire format: what a payload decodes to against a float64 oracle of what was accumulated, the checks a
receiver makes before decoding, and what a kept element costs on the wire."""

import math

import pytest
import torch

from deepspeed_dgc.codec import wire
from deepspeed_dgc.codec.kernels import get_ops
from deepspeed_dgc.codec.reference import REFERENCE

from .jobs import acc64, decode_row, make_job

# error of a decoded value, in units of the absmax of the kept values of its tensor in its row (a group's absmax is
# at most that): half a step of INT4 (absmax/7) and INT2 (absmax/1.5); INT1 sends the group's mean magnitude
# with the value's sign (at most absmax away); FP8 below is relative
BOUND = {"int4": 1 / 14, "int2": 1 / 3, "int1": 1.0}
FP8_REL = {"fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}


def check_decodes_to_what_was_accumulated(job, out, ops=REFERENCE):
    """Every row's payload, decoded, against the float64 accumulator: kept values within the format's bound and of
    the right sign, unkept ones 0; the residual equals accumulator minus decoded (kept) or the accumulator; each
    sparse tensor keeps within DGC's [0.8 k, 1.3 k] of its target in the rows not sent whole (those that send no
    positions: :meth:`~deepspeed_dgc.codec.wire.RowLayout.sends_whole`), and at least one value. Returns the kept
    count."""
    acc = acc64(job)
    total_kept = 0
    per_tensor = [0] * len(job.numels)
    rows_whole = 0
    for row, payload in enumerate(out.payloads):
        decoded, body = decode_row(ops, job, row, payload)
        decoded = decoded.double()
        kept = decoded != 0
        total_kept += body.kept
        whole = body.index_bytes.numel() == 0 and body.kept == sum(job.row_layout(row).seg_real)
        rows_whole += whole
        col = 0
        for i, c in enumerate(job.chunks):
            a, d, k = acc[row, col:col + c], decoded[col:col + c], kept[col:col + c]
            per_tensor[i] += 0 if whole else int(k.sum())
            if bool(k.any()):
                absmax = float(a[k].abs().max())
                if job.value_format in FP8_REL:
                    tiny = absmax / 448 * 2.0**-9 if job.value_format == "fp8_e4m3" else absmax / 57344 * 2.0**-16
                    assert bool(((d[k] - a[k]).abs() <= FP8_REL[job.value_format] * a[k].abs() + tiny).all())
                else:
                    step = 2 if job.rounding_generator is not None else 1  # stochastic rounding: below one step
                    assert float((d[k] - a[k]).abs().max()) <= step * BOUND[job.value_format] * absmax * (1 + 1e-5)
                assert bool((torch.sign(d[k]) == torch.sign(a[k])).all() | (job.value_format != "int1"))
            res = torch.nn.functional.pad(out.residuals[i].double(), (0, job.rows * c - out.residuals[i].numel()))
            res = res.view(job.rows, c)[row]
            torch.testing.assert_close(res, a - d, rtol=0, atol=1e-6 * max(1.0, float(a.abs().max())))
            col += c
    assert total_kept == out.kept > 0
    for i, (n_i, k) in enumerate(zip(job.numels, job.targets())):
        m = sum(job.real_counts(i))
        if job.sparse[i] and k < m:
            # a kept value INT1/INT2/INT4 rounds to 0 decodes as 0: count at most k * 1.3
            assert per_tensor[i] <= math.ceil(1.3 * k), (i, per_tensor[i], k)
            if job.value_format in ("int2", "int1") and not rows_whole:  # no zero level: kept values decode non-zero
                assert per_tensor[i] >= 0.8 * k, (i, per_tensor[i], k)
    return total_kept


@pytest.mark.parametrize("index_coding", ["varint", "bitmap"])
@pytest.mark.parametrize("fmt", ["int4", "int2", "int1", "fp8_e4m3", "fp8_e5m2"])
def test_payloads_decode_to_what_was_accumulated(fmt, index_coding):
    job = make_job([5, 3000, 2, 20000, 64], 2, value_format=fmt, index_coding=index_coding, density=0.3, seed=3)
    check_decodes_to_what_was_accumulated(job, REFERENCE.compress(job))


def test_raw_values_travel_times_the_loss_scale():
    """Raw values (no quantization) in fp16 at loss scale 1024: on the wire they are ``acc * 1024`` in fp16 (the
    range stock's loss scaling gives fp16), decoded back to ``acc`` exactly (1024 is a power of two)."""
    job = make_job([3000], 2, loss_scale=1024.0, density=0.1, seed=4)
    job.quantize, job.value_dtype, job.raw_scale = False, torch.float16, 1024.0
    out = REFERENCE.compress(job)
    acc = acc64(job)
    for row, payload in enumerate(out.payloads):
        decoded, body = decode_row(REFERENCE, job, row, payload)
        kept = decoded != 0
        want = (acc[row][kept].float() * 1024).to(torch.float16)
        assert torch.equal(body.values, want)
        assert torch.equal(decoded[kept], want.float() / 1024)
        assert 0.8 * 150 <= body.kept <= 1.3 * 150


def _payload(job, row=0):
    return REFERENCE.compress(job).payloads[row]


def test_receiver_refuses_what_it_cannot_read():
    """Another fingerprint (config or bucket), a truncated payload, trailing bytes, negative sizes: each raises
    DGCProtocolError naming the sender, before anything is decoded."""
    job = make_job([3000, 70], 2, seed=5)
    payload, layout = _payload(job), job.row_layout(0)
    wire.parse(payload, 0, layout)  # as sent: fine
    other = make_job([3000, 70], 2, seed=5)
    other.fingerprint = 99
    with pytest.raises(wire.DGCProtocolError, match=r"rank 3 sent a payload this rank cannot read .*fingerprint 99 "
                       r"vs 1234.*differ between ranks"):
        wire.parse(_payload(other), 3, layout)
    with pytest.raises(wire.DGCProtocolError, match="payload too short"):
        wire.parse(payload[:-8], 1, layout)
    with pytest.raises(wire.DGCProtocolError, match=f"rank 1 sent {payload.numel() + 8} bytes, expected"):
        wire.parse(torch.cat([payload, payload.new_zeros(8)]), 1, layout)
    bad = payload.clone()
    bad[8:12] = torch.tensor([-5], dtype=torch.int32).view(torch.uint8)
    with pytest.raises(wire.DGCProtocolError, match="rank 2 sent negative sizes"):
        wire.parse(bad, 2, layout)
    corrupt = payload.clone()
    corrupt[-4:] = 0xFF  # the last varints run past the row
    with pytest.raises(wire.DGCProtocolError, match="rank 1: "):
        wire.decode_sum([payload, corrupt], layout, REFERENCE.decode_add)


def test_decode_sum_adds_senders_in_order():
    """Two senders' payloads for row 1 sum to the float64 sum of what each decodes to."""
    a, b = make_job([3000, 5], 2, seed=6), make_job([3000, 5], 2, seed=7)
    pa, pb = REFERENCE.compress(a).payloads[1], REFERENCE.compress(b).payloads[1]
    total = wire.decode_sum([pa, pb], a.row_layout(1), REFERENCE.decode_add)
    da, _ = decode_row(REFERENCE, a, 1, pa)
    db, _ = decode_row(REFERENCE, b, 1, pb)
    assert torch.equal(total, da + db)
    assert float(total.abs().sum()) > 0


@pytest.mark.parametrize("n", [1_000_000, 4_000_000])
def test_bits_per_kept_element_at_density_001(n):
    """INT4 at density 0.01, groups of 128 (the default): everything on the wire (values, varint positions, scales,
    headers) costs 14 to 15.5 bits per kept element on tensors of a million elements or more (14.8 here): 4 of
    value, about 10.3 of position (gaps are about exponential with mean 100, so 28% need a second byte), 0.25 of
    scale (the promise of docs/kernels.md)."""
    values = torch.randn(n, generator=torch.Generator().manual_seed(n))
    job = make_job([n], 2, residual=False, density=0.01, group_size=128, seed=n)
    job.srcs = [values]
    out = get_ops("auto", "cpu", True).compress(job)
    bits = 8 * sum(p.numel() for p in out.payloads) / out.kept
    assert 0.8 * 0.01 * n <= out.kept <= 1.3 * 0.01 * n  # DGC's threshold correction keeps k within [0.8 k, 1.3 k]
    assert 14.0 <= bits <= 15.5, bits
