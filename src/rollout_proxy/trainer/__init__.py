"""What a trainer imports: the feed's consumer and its typed entries.

Usage::

    from rollout_proxy.trainer import TrajectoryConsumer, FeedEntry, FeedGroup

The reference GRPO trainer lives beside them (docs/training.md): ``batch`` (rollouts, padded
micro-batches), ``mismatch`` (the report), ``fleet`` (pause, reload, resume), ``loop`` (the step)
and ``plot`` need no torch; ``grpo`` (the learner) and ``python -m rollout_proxy.trainer`` need
``rollout-proxy[train]``. Importing this package never imports torch.
"""

from rollout_proxy.trainer.consumer import TrajectoryConsumer
from rollout_proxy.wire.feed import FeedEntry, FeedGroup

__all__ = ["FeedEntry", "FeedGroup", "TrajectoryConsumer"]
