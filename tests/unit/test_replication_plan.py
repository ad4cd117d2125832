"""Which ranks keep each other's node-local files: Megatron-LM's / nvidia-resiliency-ext's cliques
(F ranks, J apart, in blocks of J*F), and the default of one partner when the nodes pair up."""

import pytest

from datastates_megatron.engine.errors import OptionsError
from datastates_megatron.engine.tiers.replica_strategy import clique_of, replication_plan


def test_cliques_put_each_member_on_another_node():
    # 4 nodes of 2 ranks, 1 partner: (0,2) (1,3) (4,6) (5,7)
    assert [clique_of(r, 2, 2) for r in (0, 1, 2, 5, 7)] == [[0, 2], [1, 3], [0, 2], [5, 7], [5, 7]]
    # 3 nodes of 4 ranks, 2 partners: one clique per local rank across the 3 nodes
    assert clique_of(6, 4, 3) == [2, 6, 10]
    cliques = {tuple(clique_of(r, 8, 2)) for r in range(64)}
    assert sorted(r for c in cliques for r in c) == list(range(64))  # a partition of the world
    assert all(len({m // 8 for m in c}) == 2 for c in cliques)  # every member on its own node


def test_default_is_one_partner_when_nodes_pair_up(caplog):
    assert replication_plan(16, 4, None, None) == (4, 2)
    assert replication_plan(4, 4, None, None) == (4, 1)  # one node: off
    assert replication_plan(12, 4, None, None) == (4, 1)  # 3 nodes do not pair up: off, with a warning
    assert "do not pair up" in caplog.text
    assert replication_plan(12, 4, 2, None) == (4, 3)  # ... but 2 partners tile them
    assert replication_plan(16, 4, 0, None) == (4, 1)


def test_an_explicit_setting_that_does_not_tile_the_world_is_refused():
    with pytest.raises(OptionsError, match="multiple of jump"):
        replication_plan(12, 4, 1, None)
