"""DeepSpeed's gradient and optimizer-state APIs under the gradient methods (issue 51, item 1): 2 ranks, one launch.

- dense INT4 (top-k's defaults): ``safe_get_full_grad`` gives the averaged gradient the owners reconstructed, the same
  tensor ZeRO-3's partitions hold; Adam's moments as stock; ``"dgc_residual"`` is this rank's residual;
- decoupled momentum (the recommended method, int8 storage): the gradient APIs raise ``DGCStateError`` naming the
  method (no averaged gradient exists), ``"exp_avg"`` raises it naming the keys there are, ``"dgc_momentum"`` is this
  rank's momentum (full and at its partition), the sign step's count is the engine's ``global_steps``, and the state
  set through the API is the state the next step starts from.
"""

import math
import tempfile

import pytest
import torch

from dist_launch import run_scenarios
from scenarios.ds_api import QueryAPIs

STEPS = 3
DM = {"enabled": True, "decoupled_momentum": {"chunk": 16, "topk": 2, "quantization": "int4", "storage": "int8"}}


@pytest.fixture(scope="module")
def out():
    return tempfile.mkdtemp()


@pytest.fixture(scope="module")
def records(out):
    return run_scenarios({"int4": QueryAPIs(steps=STEPS, config={"dgc": {"enabled": True}}),
                          "dm": QueryAPIs(steps=STEPS, config={"dgc": DM}, ckpt=f"{out}/dm_ckpt")}, timeout_s=400)


def _error(answer) -> str:
    assert isinstance(answer, str), f"expected an error, got a {type(answer).__name__}"
    return answer


def test_under_dense_int4_the_gradient_and_adam_state_apis_answer_as_stock(records):
    for rank, rec in enumerate(records["int4"]):
        n = len(rec.train.grads[-1])
        for i in range(n):
            full = rec.answers["full_grad"][i]
            torch.testing.assert_close(full, rec.train.grads[-1][i], rtol=0, atol=0)  # the partitions' mean
            start, size = rec.partitions[i]
            local = rec.answers["local_grad"][i]
            want = full.flatten()[start:start + size]
            torch.testing.assert_close(local[:want.numel()], want, rtol=0, atol=0)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.is_tensor(rec.answers[f"full:{key}"][i]), rec.answers[f"full:{key}"][i]
            assert rec.answers["full:exp_avg_sq"][i].min() >= 0
            residual = rec.answers["full:dgc_residual"][i]
            torch.testing.assert_close(residual.flatten(), rec.stored["residual"][i].float(), rtol=0, atol=0)
            err = _error(rec.answers["full:dgc_momentum"][i])
            assert err.startswith("DGCStateError") and "keeps no 'dgc_momentum'" in err, err
            assert "the default codec" in err, err
        assert rec.steps == [float(rec.global_steps)] * len(rec.steps)  # Adam's own count
        assert math.isfinite(rec.grad_norm) and rec.grad_norm > 0
        assert rec.answers["averaged_gradients"] == [[0]]  # ZeRO-3's internal dict, read as stock
        assert rec.answers["has_averaged_gradients"] == [True]
        # the residual set through the API is what the store holds, full and at this rank's partition
        got, want = rec.after_set["full"], rec.after_set["set_full"]
        # fp8 (e4m3) storage with a scale per group: 3 mantissa bits, so within 1/16 of each value
        torch.testing.assert_close(got, want.to(got), rtol=1 / 16, atol=1e-3 * float(want.abs().max()))
        assert math.isfinite(rec.after_set["loss_after"])


def test_under_decoupled_momentum_the_gradient_apis_refuse_naming_the_method(records):
    for rec in records["dm"]:
        for api in ("full_grad", "local_grad", "set_full_grad", "grad_partitions", "averaged_gradients"):
            for answer in rec.answers[api]:
                err = _error(answer)
                # averaged_gradients: a DGCStateError that is also an AttributeError (hasattr says False)
                kind = "DGCAttributeError" if api == "averaged_gradients" else "DGCStateError"
                assert err.startswith(kind) and "'dgc.decoupled_momentum'" in err, err
                assert "DCT top-k momenta" in err and "'dgc_momentum'" in err, err
        assert rec.answers["has_averaged_gradients"] == [False]
        # deepspeed_dgc.uninstall(engine): ZeRO-3's class, attribute and gradient API as stock again
        assert rec.after_set["uninstalled"] == (True, [0], True), rec.after_set["uninstalled"]


def test_under_decoupled_momentum_adam_keys_refuse_and_the_method_state_answers(records):
    for rank, rec in enumerate(records["dm"]):
        for i, stored in enumerate(rec.stored["momentum"]):
            err = _error(rec.answers["full:exp_avg"][i])
            assert err.startswith("DGCStateError") and "keeps no 'exp_avg'" in err and "['step']" in err, err
            assert "'dgc.decoupled_momentum'" in err and "'dgc_momentum'" in err, err
            full = rec.answers["full:dgc_momentum"][i]
            assert stored is not None and float(stored.abs().max()) > 0
            torch.testing.assert_close(full.flatten(), stored.float(), rtol=0, atol=0)
            start, size = rec.partitions[i]
            local = rec.answers["local:dgc_momentum"][i]
            want = full.flatten()[start:start + size]
            assert local.numel() == size
            torch.testing.assert_close(local[:want.numel()], want, rtol=0, atol=0)
            assert not local[want.numel():].any()  # the padding past the parameter's end
            assert _error(rec.answers["full:dgc_residual"][i]).startswith("DGCStateError")
            err = _error(rec.answers["full:step"][i])  # a scalar per sub-group: where to read it instead
            assert err.startswith("DGCStateError") and "engine.global_steps" in err, err
        # the sign step counts its steps as Adam would: DeepSpeed's step count answers
        assert rec.steps == [float(STEPS)] * len(rec.steps) and rec.global_steps == STEPS
        assert math.isfinite(rec.grad_norm) and rec.grad_norm > 0


def test_decoupled_momentum_set_through_the_api_is_the_state_the_next_step_starts_from(records):
    for rec in records["dm"]:
        after = rec.after_set
        assert after["set_full_result"] is None and after["set_local_result"] is None
        tol = 0.02  # int8 storage: a code per value, an absmax scale per 64
        got, want = after["full"].flatten(), after["set_full"].flatten()
        torch.testing.assert_close(got, want, rtol=0, atol=tol * float(want.abs().max()))
        start, size = rec.partitions[1]
        whole, before = after["whole_second"].flatten(), rec.answers["full:dgc_momentum"][1].flatten()
        n = min(size, whole.numel() - start)
        mine = after["set_local"][:n]
        torch.testing.assert_close(whole[start:start + n], mine, rtol=0, atol=tol * float(mine.abs().max()))
        # outside the partition: as before the set, but for the rounding of int8 groups (64 values) that share a
        # scale with the set values across the partition's edge: within one code step of the largest value
        rest = torch.cat([whole[:start], whole[start + n:]])
        ref = torch.cat([before[:start], before[start + n:]])
        torch.testing.assert_close(rest, ref, rtol=0, atol=float(mine.abs().max()) / 127 + 1e-12)
        # the next step started from the set momentum: delta = decay delta + g / W, less the 2 of 16 DCT coefficients
        # per chunk it sent; with random set values (a flat spectrum, far larger than g / W) most of them stay: the
        # momentum after it points along the set values, not along the momentum the first three steps built
        m = after["momentum_after"].flatten()
        assert math.isfinite(after["loss_after"])
        cos = torch.nn.functional.cosine_similarity
        before = rec.answers["full:dgc_momentum"][0].flatten()
        assert float(cos(m, want, dim=0)) > 0.6 and float(cos(m, before, dim=0)) < 0.3, (cos(m, want, dim=0),
                                                                                           cos(m, before, dim=0))


def test_zero_to_fp32_reads_a_decoupled_momentum_checkpoint(records, out):
    """DeepSpeed's own files of a decoupled-momentum checkpoint (whose optimizer state holds only the sign step's
    count) give the trained fp32 weights through zero_to_fp32."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    weights = get_fp32_state_dict_from_zero_checkpoint(f"{out}/dm_ckpt", tag="trained")
    trained = records["dm"][0].train.params[-1]
    assert list(weights) == ["l1.weight", "l1.bias", "ln.weight", "ln.bias", "l2.weight", "l2.bias"]
    for got, want in zip(weights.values(), trained):
        assert torch.equal(got.float(), want)


def test_inside_a_held_accumulation_window_the_gradient_apis_say_so():
    """Between the micro-steps of a window (2 micro-steps, after the first backward), under the default codec: with
    the window held (``accumulate_locally``, the default) ZeRO-3's partitions hold none of its gradient yet, so every
    gradient API raises DGCStateError naming ``accumulate_locally`` (not the zeros the partitions hold); sending every
    micro-step, they answer with what was reduced so far (the first micro-step's averaged gradient, not zero)."""
    runs = run_scenarios({
        "held": QueryAPIs(steps=2, gas=2, mid_window=True, config={"dgc": {"enabled": True}}),
        "every": QueryAPIs(steps=2, gas=2, mid_window=True, config={"dgc": {"enabled": True,
                                                                            "accumulate_locally": False}})})
    for rec in runs["held"]:
        for api in ("full_grad", "local_grad", "set_full_grad", "grad_partitions"):
            for answer in rec.answers[api]:
                err = _error(answer)
                assert err.startswith("DGCStateError") and "'dgc.accumulate_locally'" in err, (api, err)
        assert rec.after_set["loss_after"] > 0  # the window then ends and steps as usual
    for rec in runs["every"]:
        assert all(torch.is_tensor(g) and g.abs().max() > 0 for g in rec.answers["full_grad"])
