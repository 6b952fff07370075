"""The shapes on the wire, shared by the server, the SDK, the runner and the trainer.

Everything here is plain data and pure functions over it: the generation parameters a
session pins, OpenAI message and Responses input-item normal forms, the routed-experts
array codec, the ``Trajectory`` schema and the trainer feed's entry. It imports
nothing from the server (``proxy``, ``core``, ``state``, ``engines``...), so plugin
code that imports the SDK never pulls the server in, and its errors are its own
(``WireFormatError``), never a server exception.
"""

from rollout_proxy.wire.errors import WireFormatError
from rollout_proxy.wire.feed import FeedEntry, FeedGroup
from rollout_proxy.wire.generation import PINNED_GENERATION_PARAMETERS
from rollout_proxy.wire.routed_experts import decode_routed_experts, encode_routed_experts
from rollout_proxy.wire.trajectory import Trajectory

__all__ = [
    "PINNED_GENERATION_PARAMETERS",
    "FeedEntry",
    "FeedGroup",
    "Trajectory",
    "WireFormatError",
    "decode_routed_experts",
    "encode_routed_experts",
]
