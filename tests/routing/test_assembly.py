"""A trajectory's routing from its nodes' rows: each row at its position, ``-1`` wherever nothing was observed."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_proxy.routing import RoutingRows, assemble_routing


class Node:
    def __init__(self, routing: RoutingRows | None, *, loaded: bool = True, id: str = "resp_x") -> None:
        self.id = id
        self.routing_span = None if routing is None else routing.span
        self.routing = routing if loaded else None


def rows(start: int, values: list[int], valid: list[bool] | None = None) -> RoutingRows:
    experts = np.array([[[value, value + 1]] for value in values], dtype=np.int64)  # (n, 1 layer, top 2)
    mask = np.ones(len(values), dtype=bool) if valid is None else np.array(valid)
    return RoutingRows.compact(start, experts, mask)


def test_a_dense_models_path_has_no_routing():
    assert assemble_routing([Node(None), Node(None)], total_tokens=7) is None
    assert assemble_routing([], total_tokens=0) is None


def test_rows_land_at_their_positions_and_gaps_stay_minus_one():
    path = [Node(rows(0, [1, 2, 3])), Node(None), Node(rows(5, [7, 8]))]  # an injected node in between
    routing = assemble_routing(path, total_tokens=8)
    assert routing is not None and routing.shape == (8, 1, 2) and routing.dtype == np.int16
    assert routing[:, 0, 0].tolist() == [1, 2, 3, -1, -1, 7, 8, -1]
    assert routing[5, 0].tolist() == [7, 8]


def test_unobserved_rows_inside_a_node_stay_minus_one():
    """A prefix-cache hit: the engine computed no routing there, and the zeros stored for it are not experts."""
    routing = assemble_routing([Node(rows(0, [4, 0, 6], valid=[True, False, True]))], total_tokens=4)
    assert routing is not None
    assert routing[:, 0, 0].tolist() == [4, -1, 6, -1]


def test_a_node_loaded_without_its_routing_is_an_error_not_a_hole():
    path = [Node(rows(0, [1, 2])), Node(rows(2, [3]), loaded=False, id="resp_unloaded")]
    with pytest.raises(ValueError, match="resp_unloaded"):
        assemble_routing(path, total_tokens=4)
