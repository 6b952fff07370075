"""MoE routed experts for routing replay (R3), aligned with every token.

Contract: row ``i`` of a trajectory's routing holds the experts chosen when position
``i`` was an input of a forward pass. A turn adds the rows the engine returns for the
positions it computed; the previous turn's last token becomes an input of the next
prefill, so the child fills that boundary row (and keeps it: siblings may disagree).
Positions never observed stay ``-1``; the last position of a trajectory always is.
"""

from rollout_proxy.routing.alignment import align_turn, first_row_position, prompt_start
from rollout_proxy.routing.assembly import assemble_routing
from rollout_proxy.routing.engine_format import RoutingFormatError, decode_engine_routing
from rollout_proxy.routing.rows import RoutingRows, RoutingSpan

__all__ = [
    "RoutingFormatError",
    "RoutingRows",
    "RoutingSpan",
    "align_turn",
    "assemble_routing",
    "decode_engine_routing",
    "first_row_position",
    "prompt_start",
]
