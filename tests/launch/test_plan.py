"""Memberships and their changes (pure): who trains, who takes a lost rank."""

from __future__ import annotations

from unickpt.launch.plan import NodeSpec, first_membership, replace, slots, spares

NODES = [NodeSpec("a", 2, 2), NodeSpec("b", 2, 1)]


def test_first_membership_ranks_nodes_in_order_and_leaves_the_rest_spare() -> None:
    m = first_membership(0, 3, NODES, "start")
    assert m.ranks == {"3.0.0": 0, "3.0.1": 1, "3.1.0": 2, "3.1.1": 3}
    assert slots(3, NODES) == ["3.0.0", "3.0.1", "3.0.2", "3.0.3", "3.1.0", "3.1.1", "3.1.2"]
    assert spares(m, NODES, ["3.0.3"]) == ["3.0.2", "3.1.2"]
    assert (m.world_size, m.local_world(0), m.slot_of(2)) == (4, 2, "3.1.0")


def test_a_lost_rank_goes_to_a_spare_of_its_node_first() -> None:
    m = first_membership(0, 0, NODES, "start")
    nxt = replace(m, ["0.1.0"], spares(m, NODES, ["0.1.0"]), "rank 2 lost")
    assert not isinstance(nxt, str)
    assert nxt.ranks == {"0.0.0": 0, "0.0.1": 1, "0.1.2": 2, "0.1.1": 3}  # survivors stay
    assert (nxt.epoch, nxt.gen, nxt.why) == (1, 0, "rank 2 lost")


def test_a_lost_node_goes_to_the_spares_of_the_node_with_most_left() -> None:
    nodes = [NodeSpec("a", 1, 1), NodeSpec("b", 2, 0), NodeSpec("c", 1, 2)]
    m = first_membership(4, 0, nodes, "start")
    dead = ["0.1.0", "0.1.1"]
    nxt = replace(m, dead, spares(m, nodes, dead), "node b lost")
    assert not isinstance(nxt, str)
    # node c has two spares, node a one: c's first, then one of each, the lower node first
    assert nxt.ranks == {"0.0.0": 0, "0.2.1": 1, "0.0.1": 2, "0.2.0": 3}
    assert nxt.local_world(0) == 2 and nxt.local_world(1) == 0


def test_no_spare_left_says_what_was_lost() -> None:
    m = first_membership(0, 0, [NodeSpec("a", 2, 1)], "start")
    dead = ["0.0.0", "0.0.1"]
    assert replace(m, dead, spares(m, [NodeSpec("a", 2, 1)], dead), "") == (
        "no spare left: 2 rank(s) lost (0, 1), 1 spare(s) alive"
    )
