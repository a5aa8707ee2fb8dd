"""Where tensor-parallel ranks run (models/placement.py), on sysfs trees written here."""

from __future__ import annotations

import pytest

from tilefx.models.placement import Placement, cpus_for, format_cpu_list, numa_nodes, parse_cpu_list


def fake_sysfs(root, nodes: dict[int, str]):
    for node, cpulist in nodes.items():
        (root / f"node{node}").mkdir(parents=True)
        (root / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    (root / "possible").write_text("0-1\n")  # not a node directory
    return root


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("5\n") == [5]
    with pytest.raises(ValueError, match="neither N nor N-M"):
        parse_cpu_list("0-x")


def test_format_cpu_list_is_the_inverse():
    assert format_cpu_list((5, 0, 1, 2, 10, 11)) == "0-2,5,10-11"
    assert parse_cpu_list(format_cpu_list([3, 4, 7])) == [3, 4, 7]
    assert Placement((0, 1, 2, 3), 0, "NUMA node 0").describe() == "cpus 0-3 (NUMA node 0)"


def test_one_rank_per_numa_node(tmp_path):
    nodes = numa_nodes(fake_sysfs(tmp_path, {0: "0-3", 1: "4-7"}))
    assert nodes == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    first, second = (cpus_for(r, 2, list(range(8)), nodes) for r in (0, 1))
    assert (first.cpus, first.node) == ((0, 1, 2, 3), 0)
    assert (second.cpus, second.node) == ((4, 5, 6, 7), 1)
    # only the CPUs this process may use, of the rank's node
    assert cpus_for(1, 2, [0, 1, 5, 6], nodes).cpus == (5, 6)


def test_one_node_slices_the_cpus(tmp_path):
    nodes = numa_nodes(fake_sysfs(tmp_path, {0: "0-7"}))
    placements = [cpus_for(r, 2, list(range(8)), nodes) for r in (0, 1)]
    assert [p.cpus for p in placements] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert all(p.node is None for p in placements)  # memory left to the kernel
    with pytest.raises(ValueError, match="3 ranks on this host but this process may use 2 CPU"):
        cpus_for(0, 3, [0, 1], nodes)


def test_override(tmp_path):
    nodes = numa_nodes(fake_sysfs(tmp_path, {0: "0-3", 1: "4-7"}))
    placement = cpus_for(1, 2, list(range(8)), nodes, override="0-1|6-7")
    assert (placement.cpus, placement.node, placement.how) == ((6, 7), 1, "TILEFX_CPU_BIND")
    with pytest.raises(ValueError, match="names 1 CPU lists for 2 ranks"):
        cpus_for(0, 2, list(range(8)), nodes, override="0-3")
