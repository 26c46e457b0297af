"""The reused memory of large residuals (cpu_residual_cache.cpp).
"""


import torch

from deepspeed_dgc.codec.reference import REFERENCE

from ..jobs import assert_same, make_job


def test_residuals_of_32_mb_and_more_are_reused_and_equal_reference(fused, tmp_path):
    """A new residual of 32 MB or more is 2 MB-aligned memory of the op's own: the same bits as the reference's, fed
    back as the next step's residual, saved and loaded; freed, its memory is handed out again for the next residual
    of its size, and at most two freed ones are kept."""
    fused.op.release_residual_cache()
    seed = int(torch.randint(0, 1 << 30, ()))
    big = (32 << 20) // 4 + 1001  # a residual of 32 MB and 4004 bytes
    for density, fmt in ((0.01, "int4"), (1.0, "int2")):
        job = make_job([big, 3000], 1, density=density, value_format=fmt, group_size=128, seed=seed,
                       min_numel=64 if density < 1 else 10**9)
        ref, out = REFERENCE.compress(job), fused.compress(job)
        assert_same(ref, out)
        ptr = out.residuals[0].data_ptr()
        assert ptr % (2 << 20) == 0
        job.residuals = out.residuals  # the next step reads the op's residual
        job.srcs = [torch.randn_like(s) for s in job.srcs]
        assert_same(REFERENCE.compress(job), fused.compress(job))
        torch.save(out.residuals[0], tmp_path / "r.pt")
        assert torch.equal(torch.load(tmp_path / "r.pt").view(torch.int32), ref.residuals[0].view(torch.int32))
        del out, job.residuals
        assert fused.compress(make_job([big, 3000], 1, density=density, value_format=fmt, group_size=128,
                                       seed=seed)).residuals[0].data_ptr() == ptr  # (freed again at once)
    job = make_job([big, 3000], 1, density=0.01, group_size=128, seed=seed)
    outs = [fused.compress(job) for _ in range(3)]  # three buffers (one from the cache), all freed: two kept
    assert len({o.residuals[0].data_ptr() for o in outs}) == 3
    del outs
    assert fused.op.release_residual_cache() == 2 * 4 * big
    assert fused.op.release_residual_cache() == 0
