"""Topology: exact bandwidth-order ties and hierarchy (levels) detection."""

from tf_blocksparse.planning import Topology


def test_bandwidth_order_ties_are_exact():
    # Every device of a two-level cluster has the same links in a different order; a plain
    # float sum gave totals differing in the last bits and put the last node first.
    t = Topology.two_level(4, 3, 79083611762.4158, 1029209909.0649254)
    assert len({t.total_bandwidth(d) for d in range(12)}) == 1
    assert t.bandwidth_order() == tuple(range(12))
    # Rows {0.3, 0.2, 0.1} in different orders: sum() gives 0.6 for device 0 only.
    assert Topology([[0, 0.3, 0.2, 0.1], [0.3, 0, 0.1, 0.2], [0.2, 0.1, 0, 0.3],
                     [0.1, 0.2, 0.3, 0]]).bandwidth_order() == (0, 1, 2, 3)


def test_topology_hierarchy():
    assert Topology.two_level(3, 2, 10.0, 1.0).hierarchy() == (tuple(range(6)),
                                                               ((2, 10.0), (3, 1.0)))
    assert Topology.homogeneous(4, 5.0).hierarchy() == ((0, 1, 2, 3), ((4, 5.0),))
    assert Topology.homogeneous(1, 5.0).hierarchy() is None
    assert Topology.random_heterogeneous(6, 1e9, seed=0).hierarchy() is None
    # Nodes found by bandwidth, not by id: {0, 2} and {1, 3}.
    inter = Topology([[0, 1, 50, 1], [1, 0, 1, 50], [50, 1, 0, 1], [1, 50, 1, 0]])
    assert inter.hierarchy() == ((0, 2, 1, 3), ((2, 50.0), (2, 1.0)))
    # Nodes of different sizes ({0, 1} and {2}), or non-uniform links across nodes: none.
    assert Topology([[0, 5, 1], [5, 0, 1], [1, 1, 0]]).hierarchy() is None
    assert Topology([[0, 5, 1, 2], [5, 0, 1, 1], [1, 1, 0, 5], [2, 1, 5, 0]]).hierarchy() is None
    # Equal within rtol.
    near = Topology.two_level(2, 2, 10.0, 1.0).bandwidth
    near = [list(r) for r in near]
    near[0][2] = near[2][0] = 1.0 + 1e-12
    assert Topology(near).hierarchy()[1] == ((2, 10.0), (2, 1.0 + 1e-12))

