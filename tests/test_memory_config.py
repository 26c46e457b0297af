"""Error-feedback memory (staging, commit, rollback, conservation) and the "dgc" config model."""

import pytest
import torch

from deepspeed_dgc.compressor import dequantize_int4, quantize_int4, select_topk
from deepspeed_dgc.config import DGCConfig, DGCConfigError, parse_dgc_config
from deepspeed_dgc.memory import ErrorFeedback


def test_stage_commit_rollback():
    m = ErrorFeedback()
    a, b = torch.randn(10), torch.randn(10)
    m.stage(1, a)
    assert m.get(1) is a and m.committed == {}
    m.commit()
    assert m.get(1) is a
    m.stage(1, b)
    assert m.get(1) is b  # later micro-steps of the window build on the staged value
    m.rollback()
    assert m.get(1) is a  # a skipped step leaves the committed residual as it was
    assert m.state_bytes() == 40
    assert m.residual_norm() == pytest.approx(float(a.norm()), rel=1e-6)


@pytest.mark.parametrize("storage", ["fp32", "bf16", "fp8"])
def test_offloaded_residuals_equal_device_ones_and_reuse_their_host_buffers(storage):
    """residual_offload: every read gives the bits the same memory without offload gives, through commits, a
    rollback, a load and a new shape; the committed copies are host tensors whose buffers are allocated once per
    key and shape, then overwritten (a rollback leaves them as they were)."""
    gen = torch.Generator().manual_seed(5)
    plain, off = ErrorFeedback(storage), ErrorFeedback(storage, offload=True)
    ptrs = None

    def parts(m, k):
        stored = m.committed[k]
        return stored if isinstance(stored, tuple) else (stored, )

    for step in range(4):
        for m in (plain, off):
            g = torch.Generator().manual_seed(100 + step)
            for k, n in ((1, 300), (2, 1000)):
                m.stage(k, torch.randn(n, generator=g) * 10.0**step)
            m.rollback() if step == 2 else m.commit()
        for k in (1, 2):
            assert torch.equal(off.get(k), plain.get(k))
            assert all(t.device.type == "cpu" for t in parts(off, k))
        now = [t.data_ptr() for k in (1, 2) for t in parts(off, k)]
        assert ptrs is None or now == ptrs  # the same host buffers, overwritten
        ptrs = now
    assert off.host_state_bytes() == off.state_bytes() == plain.state_bytes() and plain.host_state_bytes() == 0
    assert off.residual_norm() == plain.residual_norm()
    loaded = {1: torch.randn(300, generator=gen), 2: torch.randn(7, generator=gen)}  # key 2 changes shape
    plain.load(loaded)
    off.load(loaded)
    assert all(torch.equal(off.get(k), plain.get(k)) for k in (1, 2)) and off.get(2).numel() == 7
    assert all(torch.equal(a, b) for a, b in zip(off.residuals().values(), plain.residuals().values()))


def test_error_feedback_conserves_gradient_sum():
    """Single sender, 20 steps of top-1% + INT4: sum of what was sent + the final residual ==
    sum of all gradients (float64 reference), while each step sends only about 1%."""
    gen = torch.Generator().manual_seed(0)
    n = 5000
    m = ErrorFeedback()
    sent_total = torch.zeros(n, dtype=torch.float64)
    grad_total = torch.zeros(n, dtype=torch.float64)
    for step in range(20):
        g = torch.randn(n, generator=gen) * (1 + step % 3)
        grad_total += g.double()
        acc = g + (m.get(0) if m.get(0) is not None else 0)
        mask = select_topk(acc, 0.01, gen)
        packed, scales = quantize_int4(acc[mask], 128)
        sent = torch.zeros(n)
        sent[mask] = dequantize_int4(packed, scales, int(mask.sum()), 128)
        m.stage(0, acc - sent)
        m.commit()
        sent_total += sent.double()
        assert int((sent != 0).sum()) <= 0.013 * n
    torch.testing.assert_close(sent_total + m.get(0).double(), grad_total, rtol=0, atol=1e-4)
    assert float(sent_total.abs().sum()) > 0


def test_config_defaults_and_lossless():
    cfg = parse_dgc_config({"dgc": {"enabled": True}})
    assert (cfg.density, cfg.quantization, cfg.group_size, cfg.error_feedback) == (0.01, "int4", 128, True)
    assert not cfg.lossless
    assert parse_dgc_config({"dgc": {"density": 1.0, "quantization": "none"}}).lossless
    assert parse_dgc_config({"train_batch_size": 8}) is None
    # residual storage "auto": fp8 (the study's cheapest at parity) where supported, fp32 where needed
    assert (cfg.residual_dtype, cfg.residual_storage) == ("auto", "fp8")
    assert DGCConfig(enabled=True, topology="hierarchical").residual_storage == "fp32"
    assert DGCConfig(enabled=True, momentum_correction=True).residual_storage == "fp32"
    assert DGCConfig(enabled=True, residual_dtype="bf16").residual_storage == "bf16"


@pytest.mark.parametrize("section,needle", [
    ({"densty": 0.1}, "unknown key 'dgc.densty'"),
    ({"density": 0}, "'dgc.density'"),
    ({"density": 1.01}, "'dgc.density'"),
    ({"quantization": "fp8"}, "'dgc.quantization'"),
    ({"group_size": 7}, "'dgc.group_size'"),
    ({"group_size": 0}, "'dgc.group_size'"),
    ({"min_numel": -1}, "'dgc.min_numel'"),
    ({"stats_interval": 0}, "'dgc.stats_interval'"),
    ({"enabled": "maybe"}, "'dgc.enabled'"),
    ({"enabled": 1}, "'dgc.enabled'"),
    ({"density": True}, "'dgc.density'"),
    ({"density": "0.5"}, "'dgc.density'"),
    ({"group_size": 4.0}, "'dgc.group_size'"),
    ({"weights": {"quantization": "int2"}}, "'dgc.weights.quantization'"),
    ({"weights": {"group_sise": 64}}, "unknown key 'dgc.weights.group_sise' \\(allowed keys: quantization, group_size\\)"),
    ({"comm_backend": "nccl"}, "'dgc.comm_backend': Input should be 'torch' or 'mpi'"),
    ({"topology": "ring"}, "'dgc.topology': Input should be 'flat' or 'hierarchical'"),
    ({"ranks_per_node": 0}, "'dgc.ranks_per_node'"),
    ({"ranks_per_node": 2.0}, "'dgc.ranks_per_node'"),
    ({"timeout_s": 0}, "'dgc.timeout_s'"),
    ({"timeout_s": -5.0}, "'dgc.timeout_s'"),
    ({"local_clip_norm": 0.0}, "'dgc.local_clip_norm'"),
    ({"local_clip_norm": 1.0}, "'dgc.local_clip_norm' is part of DGC's momentum correction"),
    ({"momentum_factor_masking": False}, "'dgc.momentum_factor_masking' is part of DGC's momentum correction"),
    ({"momentum_correction": True, "residual_dtype": "bf16"}, "'dgc.momentum_correction' needs"),
    ({"momentum_correction": True, "topology": "hierarchical"}, "'dgc.momentum_correction' needs"),
    ({"momentum_correction": True, "error_feedback": False}, "'dgc.momentum_correction' needs"),
    ({"momentum_correction": "yes"}, "'dgc.momentum_correction'"),
    ({"threshold_reuse_steps": 0}, "'dgc.threshold_reuse_steps'"),
    ({"topology": "hierarchical", "residual_dtype": "fp8"}, "'dgc.residual_dtype' = \"fp8\" is not supported"),
    ({"topology": "hierarchical", "density": "auto"}, "'dgc.density' = \"auto\" is not supported"),
    ({"threshold_reuse_steps": 2.0}, "'dgc.threshold_reuse_steps'"),
    ({"threshold_reuse_steps": 4, "threshold": 0.1}, "'dgc.threshold_reuse_steps' reuses estimated top-k"),
])
def test_config_errors_name_the_key(section, needle):
    with pytest.raises(DGCConfigError, match=needle.replace(".", r"\.")):
        parse_dgc_config({"dgc": section})


@pytest.mark.parametrize("section", [True, None, [], "on"])
def test_config_section_must_be_object(section):
    with pytest.raises(DGCConfigError, match="JSON object"):
        parse_dgc_config({"dgc": section})


def test_config_is_frozen():
    cfg = DGCConfig(enabled=True)
    with pytest.raises(Exception):
        cfg.density = 0.5


def test_agreement_digest_and_mismatch_message():
    from deepspeed_dgc.agreement import describe_mismatch, effective_settings, settings_digest
    a = effective_settings(DGCConfig(enabled=True, topology="hierarchical"), 2)
    b = effective_settings(DGCConfig(enabled=True, topology="hierarchical", weights={"quantization": "int8"}), 4)
    flat = effective_settings(DGCConfig(enabled=True), 4)
    assert a["dgc.weights.quantization"] == "none" and "deepspeed version" in a
    assert "ranks per node (resolved)" not in flat  # flat only labels bytes with it
    assert settings_digest(a) == settings_digest(dict(a)) != settings_digest(b)
    msg = describe_mismatch([a, a, b])
    assert "'dgc.weights.quantization' is 'none' on rank 0 but 'int8' on rank(s) [2]" in msg
    assert "'ranks per node (resolved)' is 2 on rank 0 but 4 on rank(s) [2]" in msg
    assert "dgc.density" not in msg


def test_ranks_per_node_from_config_then_launcher(monkeypatch):
    from deepspeed_dgc.topology import LOCAL_SIZE_VARS, resolve_ranks_per_node
    for var in LOCAL_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "8")
    assert resolve_ranks_per_node(DGCConfig(enabled=True)) == (8, "OMPI_COMM_WORLD_LOCAL_SIZE")
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert resolve_ranks_per_node(DGCConfig(enabled=True)) == (4, "LOCAL_SIZE")
    assert resolve_ranks_per_node(DGCConfig(enabled=True, ranks_per_node=2)) == (2, "dgc.ranks_per_node")
