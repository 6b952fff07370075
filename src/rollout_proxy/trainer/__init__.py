"""What a trainer imports: the feed's consumer and its typed entries.

Usage::

    from rollout_proxy.trainer import TrajectoryConsumer, FeedEntry, FeedGroup
"""

from rollout_proxy.trainer.consumer import TrajectoryConsumer
from rollout_proxy.wire.feed import FeedEntry, FeedGroup

__all__ = ["FeedEntry", "FeedGroup", "TrajectoryConsumer"]
