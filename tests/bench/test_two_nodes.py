"""benchmarks/two_nodes.py: two nodes in one namespace, a rate-limited path between them in each direction, node-mates
unlimited; checked with plain sockets and with gloo ranks bound to their nodes' addresses (root only)."""

import subprocess

import pytest

from benchmarks import two_nodes as tn

needs_root = pytest.mark.skipif(tn.check_privileges() is not None, reason=f"two_nodes: {tn.check_privileges()}")
RATE, LIMIT = "100mbit", 100e6
NBYTES = 2_000_000


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@needs_root
def test_between_nodes_at_the_rate_each_way_node_mates_unlimited_and_gloo_follows():
    with tn.TwoNodeLink(RATE) as link:
        before = link.inter_node_bytes()
        a_to_b, b_to_a, mates = link.verify(NBYTES)
        counted = link.inter_node_bytes()
        for t in (a_to_b, b_to_a):  # each direction at its own limit (a full-duplex link, not a shared bus)
            assert 0.8 * LIMIT <= t.bits_per_s <= 1.2 * LIMIT, t
        assert mates.bits_per_s > 5 * LIMIT, mates  # node-mates are not shaped
        for k in ("A->B", "B->A"):  # the data of one transfer (and the ACKs of the other) crossed the classes
            assert NBYTES <= counted[k] - before[k] <= 1.1 * NBYTES, counted
        cross = link.verify_gloo(NBYTES, ("A", "B"))
        # a ring all-reduce of 2 ranks sends the whole buffer each way: every byte through the shaping, at its rate
        assert NBYTES <= cross["A->B"] <= 1.1 * NBYTES and NBYTES <= cross["B->A"] <= 1.1 * NBYTES, cross
        assert cross["seconds"] >= 0.8 * 8 * NBYTES / LIMIT, cross
        same = link.verify_gloo(NBYTES, ("A", "A"), port=29612)
        assert same["A->B"] == 0 and same["B->A"] == 0, same
        name = link.name
        assert name in _namespaces()
    assert name not in _namespaces()


@needs_root
def test_the_namespace_goes_on_error_and_bad_rates_are_refused():
    with pytest.raises(RuntimeError, match="boom"):
        with tn.TwoNodeLink(RATE) as link:
            name = link.name
            raise RuntimeError("boom")
    assert name not in _namespaces()
    with pytest.raises(ValueError, match="not a tc rate"):
        tn.TwoNodeLink("100mbps")
