"""Which ranks share a node: the config first, then the launcher's variables."""

from deepspeed_dgc.comm.topology import LOCAL_SIZE_VARS, node_of, resolve_ranks_per_node
from deepspeed_dgc.config import DGCConfig


def test_ranks_per_node_from_config_then_launcher(monkeypatch):
    for var in LOCAL_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "8")
    assert resolve_ranks_per_node(DGCConfig(enabled=True)) == (8, "OMPI_COMM_WORLD_LOCAL_SIZE")
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert resolve_ranks_per_node(DGCConfig(enabled=True)) == (4, "LOCAL_SIZE")
    assert resolve_ranks_per_node(DGCConfig(enabled=True, ranks_per_node=2)) == (2, "dgc.ranks_per_node")


def test_nodes_are_consecutive_ranks():
    assert [node_of(r, 4) for r in range(9)] == [0, 0, 0, 0, 1, 1, 1, 1, 2]
