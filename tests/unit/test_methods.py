"""The method table: each config picks one registered method, and a method added in a file of its own with a
registration is what the reducer dispatches to, with no edit to the reducer or the patches."""

import pytest
import torch

from deepspeed_dgc import methods
from deepspeed_dgc.config import DGCConfig
from deepspeed_dgc.memory.error_feedback import ErrorFeedback
from deepspeed_dgc.methods import base
from deepspeed_dgc.zero3.reduce_scatter import CompressedReduceScatter


@pytest.mark.parametrize("cfg, device, name", [
    (dict(), "cpu", "topk_exact"),
    (dict(layout="fixed"), "cpu", "topk_fixed"),
    (dict(), "cuda", "topk_fixed"),
    (dict(decoupled_momentum={"chunk": 16, "topk": 2}), "cpu", "decoupled_momentum"),
    (dict(shared_mask={"density": 0.1}), "cuda", "shared_mask"),
    (dict(compressed_momentum={"freeze_step": 2}), "cpu", "compressed_momentum"),
    (dict(momentum_correction=True, density=0.1), "cuda", "momentum_correction"),
])
def test_each_config_picks_its_method(cfg, device, name):
    config = DGCConfig(enabled=True, **cfg)
    assert methods.method_name(config, device) == name
    method = methods.build(CompressedReduceScatter(config, ErrorFeedback("fp32")), device)
    assert type(method) is methods.METHODS[name]
    hier = methods.build(CompressedReduceScatter(DGCConfig(enabled=True, topology="hierarchical", **cfg),
                                                 ErrorFeedback("fp32")), device)
    assert isinstance(hier, methods.Hierarchical) and type(hier.inner) is methods.METHODS[name]


def test_a_new_method_is_a_class_and_a_registration():
    """A method registered from outside the package, chosen by its own condition, is what the reducer uses."""

    @methods.register("test_only_dense_sum", lambda cfg, device: cfg.stats_interval == 4321, order=100)
    class DenseSum(methods.GradientMethod):
        def reduce(self, bucket, exchange, A=None):
            out = torch.cat([s.float().reshape(-1) for s in bucket.srcs]) / bucket.divisor
            return methods.Reduced(out, list(out.split(bucket.numels)), True, out.numel())

    try:
        reducer = CompressedReduceScatter(DGCConfig(enabled=True, stats_interval=4321), ErrorFeedback("fp32"))
        assert type(reducer.method_for("cpu")) is DenseSum
        plain = CompressedReduceScatter(DGCConfig(enabled=True), ErrorFeedback("fp32"))
        assert type(plain.method_for("cpu")).name == "topk_exact"
    finally:
        methods.METHODS.pop("test_only_dense_sum")
        base._WHEN.pop("test_only_dense_sum")


@pytest.fixture
def scratch_registry():
    """The method table as it was, restored after the test (registrations made in it are dropped)."""
    saved = dict(methods.METHODS), dict(base._WHEN)
    yield
    methods.METHODS.clear()
    methods.METHODS.update(saved[0])
    base._WHEN.clear()
    base._WHEN.update(saved[1])


class _DenseSum(methods.GradientMethod):
    def reduce(self, bucket, exchange, A=None):
        out = torch.cat([s.float().reshape(-1) for s in bucket.srcs]) / bucket.divisor
        return methods.Reduced(out, list(out.split(bucket.numels)), True, out.numel())


@pytest.mark.parametrize("name, when, order, match", [
    ("topk_exact", lambda cfg, device: False, 0, "registered already"),
    ("", lambda cfg, device: False, 0, "non-empty name"),
    ("test_only_x", "stats_interval == 4321", 0, "must be callable"),
    ("test_only_x", lambda cfg, device: False, 1.5, "must be an int"),
])
def test_a_registration_that_cannot_work_is_refused(scratch_registry, name, when, order, match):
    with pytest.raises(ValueError, match=match):
        methods.register(name, when, order)(_DenseSum)
    assert methods.METHODS["topk_exact"].__name__ == "TopKExact"  # the built-in is still there


def test_a_condition_that_raises_is_named(scratch_registry):
    methods.register("test_only_raises", lambda cfg, device: cfg.no_such_key, order=100)(_DenseSum)
    with pytest.raises(RuntimeError, match="'test_only_raises' raised .*AttributeError"):
        methods.method_name(DGCConfig(enabled=True), "cpu")


def test_two_methods_of_the_highest_order_are_an_error(scratch_registry):
    methods.register("test_only_a", lambda cfg, device: cfg.stats_interval == 4321, order=100)(_DenseSum)
    methods.register("test_only_b", lambda cfg, device: cfg.stats_interval == 4321, order=100)(_DenseSum)
    with pytest.raises(ValueError, match=r"\['test_only_a', 'test_only_b'\] \(order 100\)"):
        methods.method_name(DGCConfig(enabled=True, stats_interval=4321), "cpu")
    assert methods.method_name(DGCConfig(enabled=True), "cpu") == "topk_exact"  # other configs unaffected


def test_the_hierarchical_topology_refuses_a_method_without_a_layout(scratch_registry):
    methods.register("test_only_dense_sum", lambda cfg, device: cfg.stats_interval == 4321, order=100)(_DenseSum)
    flat = CompressedReduceScatter(DGCConfig(enabled=True, stats_interval=4321), ErrorFeedback("fp32"))
    assert type(flat.method_for("cpu")) is _DenseSum
    hier = DGCConfig(enabled=True, stats_interval=4321, topology="hierarchical")
    with pytest.raises(ValueError, match="'test_only_dense_sum' says no owner matrix"):
        methods.build(CompressedReduceScatter(hier, ErrorFeedback("fp32")), "cpu")



class MyAdamW(torch.optim.AdamW):
    """A user's subclass of AdamW (its own class name)."""


class Adam8bitLike(torch.optim.Optimizer):
    """Stands in for an optimizer of another library whose name says Adam (bitsandbytes' AdamW8bit)."""

    def __init__(self, params, betas=(0.9, 0.999)):
        super().__init__(params, {"lr": 1e-3, "betas": betas})


@pytest.mark.parametrize("make", [torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam,
                                  torch.optim.Adamax, MyAdamW, Adam8bitLike], ids=lambda c: c.__name__)
def test_update_optimizer_refuses_every_adam_with_a_first_moment(make):
    """``decoupled_momentum.update: "optimizer"`` with ``decay`` above 0: any optimizer of torch's Adam family
    (subclasses too) or named Adam whose betas[0] is above 0 is refused naming it and the fix; at betas[0] 0, or with
    ``decay`` 0, or under the sign step, it is not."""
    from deepspeed_dgc.config import DGCConfigError, DecoupledMomentumConfig
    from deepspeed_dgc.zero3.optimizer import refuse_double_momentum
    params = [torch.nn.Parameter(torch.randn(3))]

    def refuse(betas, **dm):
        refuse_double_momentum(DecoupledMomentumConfig(**dm), make(params, betas=betas), "")

    with pytest.raises(DGCConfigError, match=rf"hands {make.__name__} .*{make.__name__}'s first moment \(betas\[0\] = "
                                              r"0\.9\) would average it again.*betas\[0\] to 0"):
        refuse((0.9, 0.99), update="optimizer", decay=0.99)
    refuse((0.0, 0.99), update="optimizer", decay=0.99)
    refuse((0.9, 0.99), update="optimizer", decay=0.0)
    refuse((0.9, 0.99), decay=0.99)
