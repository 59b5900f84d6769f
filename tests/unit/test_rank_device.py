"""Which device a rank takes: its local rank where it sees every device of its node, the only one
where the launcher bound one device to each task; more ranks than devices is refused, clearly."""

from __future__ import annotations

import pytest

from runtime.dist import device_index


def test_a_rank_seeing_the_nodes_devices_takes_its_local_rank():
    assert [device_index(r, 4) for r in range(4)] == [0, 1, 2, 3]


def test_a_rank_bound_to_one_device_takes_it():
    assert [device_index(r, 1) for r in range(4)] == [0, 0, 0, 0]


def test_more_ranks_than_devices_is_refused():
    with pytest.raises(RuntimeError, match="local rank 4 sees 4 devices"):
        device_index(4, 4)
