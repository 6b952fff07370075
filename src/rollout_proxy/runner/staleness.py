"""The tie between a job's steps and the trainer's weights: ``max_staleness``.

Policy versions are the trainer's integer steps, set on the fleet by ``POST /v1/admin/resume``
and read back from ``GET /v1/admin/engines``. With ``max_staleness`` S and the version
``v0`` the fleet had before step 0, the trainer's version after it trained on n of the
job's steps is ``v0 + n``, so:

- step k starts once the fleet's version is at least ``v0 + k - S`` (k counts only steps
  that put groups on the feed: a step with none is never trained on). S = 0 is synchronous
  on-policy (step k waits for the weights trained on step k-1); S = 1 lets step k roll out
  while the trainer trains on step k-1.
- a group is stale when, as it is published, the fleet's version minus the oldest version
  of any of its generated tokens is more than S; ``stale_groups`` drops it (default) or
  publishes it with ``stale: true``.

The wait is bounded (``version_wait``): a trainer that never resumes fails the job with a
message that says which version it waited for, instead of hanging it.

**Per policy.** A job whose sessions name a LoRA policy (``proxy.policy``) counts that policy's versions (its
adapter's, ``GET /v1/admin/policies/{name}``), not the fleet's: another job's adapter publishing, or the base
being updated, neither holds its steps nor makes its groups stale. A group's staleness is measured per policy
that sampled its tokens, each against that policy's current version.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from rollout_proxy.runner.admin import AdminClient
from rollout_proxy.runner.job import TrainingLoop
from rollout_proxy.runner.publish import GradedGroup
from rollout_proxy.runner.retries import JobFailed
from rollout_proxy.sdk.transport import ProxyRequestError, ProxyUnreachable
from rollout_proxy.wire.generation import BASE_POLICY

log = structlog.get_logger(__name__)


def is_stale(fleet_version: int, oldest: int | None, max_staleness: int) -> bool:
    """Whether a group whose oldest generated token has version ``oldest`` is too old now (None: no tokens)."""
    return oldest is not None and fleet_version - oldest > max_staleness


@dataclass(slots=True)
class StaleCount:
    dropped: int = 0
    kept: int = 0


def _ignore_wait(version: int | None) -> None:
    return None


class StalenessGate:
    """Holds each step until the fleet's policy version is recent enough; sorts out stale groups."""

    def __init__(
        self,
        admin: AdminClient,
        loop: TrainingLoop,
        *,
        on_wait: Callable[[int | None], None] = _ignore_wait,
        policy: str = BASE_POLICY,
    ) -> None:
        """``on_wait(version)`` is told when a step starts waiting for ``version``, and ``None`` when it stops;
        ``policy``: the job's (its versions are the steps')."""
        if loop.max_staleness is None:
            raise ValueError("a staleness gate needs max_staleness")
        self._admin = admin
        self._loop = loop
        self.max_staleness: int = loop.max_staleness
        self._on_wait = on_wait
        self.policy = policy
        self.initial_version: int | None = loop.initial_policy_version
        self.steps_on_feed = 0  # steps that put groups on the feed: what the trainer trains on
        self.waited = 0.0  # seconds spent waiting for versions, all steps together
        self.stale = StaleCount()

    async def start(self) -> int:
        """The version before step 0: the job's ``initial_policy_version``, else the fleet's now."""
        if self.initial_version is None:
            self.initial_version = await self._version(time.monotonic() + self._loop.version_wait)
        log.info(
            "training_loop",
            policy=self.policy,
            initial_policy_version=self.initial_version,
            max_staleness=self.max_staleness,
        )
        return self.initial_version

    def target(self) -> int:
        """The version the next step needs: ``initial + steps on the feed - max_staleness``."""
        assert self.initial_version is not None, "start() first"
        return self.initial_version + self.steps_on_feed - self.max_staleness

    async def before_step(self, step: int) -> int:
        """Wait until the fleet's version is at least the step's target; that version."""
        target = self.target()
        deadline = time.monotonic() + self._loop.version_wait
        started = time.monotonic()
        version = await self._version(deadline)
        if version < target:
            log.info("waiting_for_policy_version", step=step, policy=self.policy, target=target, policy_version=version)
            self._on_wait(target)
            try:
                while version < target:
                    if time.monotonic() >= deadline:
                        raise JobFailed(
                            f"step {step} needs {self._named} version {target} or newer (max_staleness "
                            f"{self.max_staleness}), but {self._holder} stayed at {version} for "
                            f"{self._loop.version_wait:g}s (training_loop.version_wait): is a trainer consuming "
                            f"the feed and {self._updating}?"
                        )
                    await asyncio.sleep(min(self._loop.poll_interval, max(deadline - time.monotonic(), 0.0)))
                    version = await self._version(deadline)
            finally:
                self._on_wait(None)
            waited = time.monotonic() - started
            self.waited += waited
            log.info("policy_version_reached", step=step, policy_version=version, waited_s=round(waited, 3))
        return version

    def step_done(self, *, on_feed: bool) -> None:
        """A step ended; ``on_feed``: it has groups on the feed (published now or by an earlier run)."""
        self.steps_on_feed += int(on_feed)

    async def sort(self, step: int, groups: Sequence[GradedGroup]) -> list[GradedGroup]:
        """The groups to publish: stale ones dropped, or kept and marked, as the job says. Each policy that
        sampled a group's tokens is measured against its own current version (read once per policy)."""
        deadline = time.monotonic() + self._loop.version_wait
        current: dict[str, int] = {self.policy: await self._version(deadline)}
        publish = []
        for group in groups:
            stale = None
            for policy, oldest in sorted(group.oldest_by_policy().items()):
                if policy not in current:
                    current[policy] = await self._version(deadline, policy)
                if is_stale(current[policy], oldest, self.max_staleness):
                    stale = (policy, oldest)
                    break
            if stale is None:
                publish.append(group)
                continue
            keep = self._loop.stale_groups == "keep"
            log.warning(
                "stale_group",
                group_id=group.group_id,
                step=step,
                policy=stale[0],
                oldest_policy_version=stale[1],
                policy_version=current[stale[0]],
                max_staleness=self.max_staleness,
                kept=keep,
            )
            if keep:
                group.stale = True
                self.stale.kept += 1
                publish.append(group)
            else:
                self.stale.dropped += 1
        return publish

    @property
    def _named(self) -> str:
        return "policy" if self.policy == BASE_POLICY else f"policy {self.policy!r}"

    @property
    def _updating(self) -> str:
        if self.policy == BASE_POLICY:
            return "resuming the fleet with a new policy_version"
        return f"publishing new versions of it (POST /v1/admin/policies/{self.policy}/versions)"

    @property
    def _holder(self) -> str:
        return "the fleet" if self.policy == BASE_POLICY else f"policy {self.policy!r}"

    async def _version(self, deadline: float, policy: str | None = None) -> int:
        """A policy's current version (the job's by default; the base's is the fleet's); a proxy that does not
        answer is asked again until ``deadline``."""
        while True:
            remaining = deadline - time.monotonic()
            try:
                async with asyncio.timeout(max(remaining, self._loop.poll_interval)):
                    return await self._admin.policy_version(policy or self.policy)
            except (ProxyUnreachable, TimeoutError) as exc:
                if time.monotonic() >= deadline:
                    raise JobFailed(f"the proxy did not say its policy version in time: {exc}") from None
                log.warning("policy_version_unreadable", error=str(exc) or type(exc).__name__)
                await asyncio.sleep(min(self._loop.poll_interval, max(deadline - time.monotonic(), 0.0)))
            except ProxyRequestError as exc:  # an answer, but not a version: waiting will not change it
                raise JobFailed(f"max_staleness needs the proxy's fleet API: {exc}") from None
