"""Two network namespaces as two nodes: a Gloo allreduce between them, and its failures.

Skips, with the reason, where namespaces cannot be made (not Linux, not root, no
`ip`, or a container that forbids them). Every test leaves no namespace behind.
"""

from __future__ import annotations

import pytest

from pcourse.tools.cluster import netns

REASON = netns.unavailable_reason()
needs_netns = pytest.mark.skipif(bool(REASON), reason=f"network namespaces unavailable: {REASON}")


@pytest.fixture
def nodes():
    made = netns.create()
    try:
        yield made
    finally:
        netns.cleanup(made.names)
    assert not set(made.names) & set(netns.list_ours()), "namespaces left behind"


@needs_netns
def test_allreduce_across_namespaces_matches_closed_form(nodes):
    outcomes = netns.run_allreduce(nodes, timeout=30)
    for o in outcomes:
        assert o.error is None, o
        assert o.result == [1.0 + 2.0] * 4  # sum of rank + 1 over 2 ranks
    assert [o.address for o in outcomes] == list(nodes.addrs)  # each bound to its own veth


@needs_netns
def test_wrong_interface_is_a_clear_error_not_a_hang(nodes):
    outcomes = netns.run_allreduce(nodes, ifnames=["eth-missing", nodes.ifnames[1]], timeout=10)
    assert outcomes[0].result is None and "Unable to find address" in outcomes[0].error
    assert netns.diagnose(outcomes[0]).startswith("GLOO_SOCKET_IFNAME names no interface")
    assert outcomes[1].result is None  # the peer fails too, within the deadline


@needs_netns
def test_namespaces_of_a_process_that_is_gone_are_swept():
    made = netns.create(tag=2**22 + 1)  # above any pid Linux can give: its owner is gone
    assert set(made.names) <= set(netns.list_ours())
    assert set(made.names) <= set(netns.cleanup())  # no names: every stale one of ours
    assert not set(made.names) & set(netns.list_ours())


def test_diagnose_without_namespaces():
    ok = netns.RankOutcome(0, "a", "veth-a", [3.0], "10.77.0.1", None, 0.1)
    assert netns.diagnose(ok) == "ok"
    bad = netns.RankOutcome(1, "b", "lo", None, None, "no answer by the deadline: killed", None)
    assert "deadline" in netns.diagnose(bad)


@needs_netns
@pytest.mark.parametrize("one_node", [False, True], ids=["across", "one_node"])
def test_pingpong_times_every_size_on_the_path_it_names(nodes, one_node):
    sizes = [16, 4096, 65536]
    outcomes = netns.run_pingpong(nodes, sizes=sizes, repeats=3, timeout=30, one_node=one_node)
    for o in outcomes:  # each rank checked that the echo came back unchanged
        assert o.error is None, o
    assert [size for size, _ in outcomes[0].result] == sizes
    assert all(seconds > 0 for _, seconds in outcomes[0].result)
    # across: rank 1 in node B over its veth; one node: both in A over lo
    assert [o.namespace for o in outcomes] == ([nodes.names[0]] * 2 if one_node
                                               else list(nodes.names))
    assert [o.address for o in outcomes] == (["127.0.0.1"] * 2 if one_node else list(nodes.addrs))


def test_pingpong_refuses_sizes_it_cannot_send():
    made = netns.Nodes(("pc-a-0", "pc-b-0"))
    for sizes, repeats in (([], 3), ([6], 3), ([-4], 3), ([16], 0)):
        with pytest.raises(ValueError, match="multiples of 4 bytes"):
            netns.run_pingpong(made, sizes=sizes, repeats=repeats)
    for size in (0, 6, -4):
        with pytest.raises(ValueError, match="multiple of 4 bytes"):
            netns.run_node_aware(made, size=size)


@needs_netns
def test_node_aware_allreduce_sends_less_over_the_cable_than_the_flat_ring(nodes):
    size = 1 << 20
    outcomes = netns.run_node_aware(nodes, size=size, timeout=30)
    for o in outcomes:
        assert o.error is None, o
        assert o.result["correct"], o  # 1 + 2 + 3 + 4 on every rank, both ways
    assert [o.namespace for o in outcomes] == [nodes.names[0]] * 2 + [nodes.names[1]] * 2
    for first in (0, 2):  # each node's veth, read by its first rank
        sent = outcomes[first].result
        # a ring over 4 ranks sends 1.5 N on each crossing link, two leaders N; TCP's
        # headers and the barriers add a few percent, never a tenth of N
        assert 1.5 * size <= sent["flat"] < 1.6 * size, sent
        assert 1.0 * size <= sent["node_aware"] < 1.1 * size, sent
