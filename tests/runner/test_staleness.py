"""``max_staleness`` on its own, over a scripted fleet version: which version a step waits for, which groups are stale.

The arithmetic is what a job relies on to stay on-policy (S = 0) or one step ahead (S = 1): step k waits for
``initial + steps on the feed - S``, and a group whose oldest token is more than S versions old is dropped or
marked. ``tests/runner/test_training_loop.py`` runs it with a real trainer; here each rule alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from rollout_proxy.runner.job import TrainingLoop
from rollout_proxy.runner.retries import JobFailed
from rollout_proxy.runner.staleness import StalenessGate, is_stale
from rollout_proxy.sdk.transport import ProxyRequestError, ProxyUnreachable


class ScriptedAdmin:
    """The proxy's ``GET /v1/admin/engines`` version: each read takes the next answer, the last one repeats;
    ``policies``: the fixed versions of LoRA policies (``GET /v1/admin/policies/{name}``)."""

    def __init__(self, *answers: int | Exception, policies: dict[str, int] | None = None) -> None:
        self.answers = list(answers)
        self.policies = policies or {}
        self.reads = 0
        self.asked: list[str] = []

    async def policy_version(self, policy: str = "base") -> int:
        self.asked.append(policy)
        if policy != "base":
            return self.policies[policy]
        self.reads += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


@dataclass
class Group:
    group_id: str
    oldest: int | None
    stale: bool = False
    policy: str = "base"

    def policy_versions(self) -> tuple[int | None, int | None]:
        return self.oldest, self.oldest

    def oldest_by_policy(self) -> dict[str, int]:
        return {} if self.oldest is None else {self.policy: self.oldest}


def gate(admin: ScriptedAdmin, **loop: Any) -> StalenessGate:
    settings = {"max_staleness": 1, "poll_interval": 0.01, "version_wait": 5.0, **loop}
    return StalenessGate(admin, TrainingLoop(**settings))


@pytest.mark.parametrize(
    "fleet, oldest, max_staleness, stale",
    [(5, 5, 0, False), (6, 5, 0, True), (6, 5, 1, False), (7, 5, 1, True), (9, None, 0, False)],
)
def test_a_group_is_stale_when_its_oldest_token_is_more_than_max_staleness_behind(fleet, oldest, max_staleness, stale):
    assert is_stale(fleet, oldest, max_staleness) is stale


def test_a_gate_needs_max_staleness():
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessGate(ScriptedAdmin(0), TrainingLoop())


async def test_the_target_counts_only_steps_that_put_groups_on_the_feed():
    staleness = gate(ScriptedAdmin(10), max_staleness=0)
    assert await staleness.start() == 10  # no initial_policy_version: the fleet's now
    assert staleness.target() == 10
    staleness.step_done(on_feed=True)
    staleness.step_done(on_feed=False)  # nothing to train on: the trainer's version will not move for it
    staleness.step_done(on_feed=True)
    assert staleness.target() == 12


async def test_a_step_waits_until_the_fleet_reaches_its_target():
    admin = ScriptedAdmin(3, 3, 4)
    waits: list[int | None] = []
    staleness = StalenessGate(
        admin,
        TrainingLoop(max_staleness=0, initial_policy_version=3, poll_interval=0.01),
        on_wait=waits.append,
    )
    assert await staleness.start() == 3
    staleness.step_done(on_feed=True)
    assert await staleness.before_step(1) == 4
    assert admin.reads == 3
    assert waits == [4, None]  # told what it waited for, then that it stopped


async def test_one_step_ahead_does_not_wait_for_the_previous_steps_weights():
    admin = ScriptedAdmin(0)
    staleness = gate(admin, max_staleness=1, initial_policy_version=0)
    await staleness.start()
    staleness.step_done(on_feed=True)
    assert await staleness.before_step(1) == 0  # target 0 + 1 - 1


async def test_a_version_that_never_comes_fails_the_job_naming_it():
    staleness = gate(ScriptedAdmin(2), max_staleness=0, initial_policy_version=2, version_wait=0.05)
    await staleness.start()
    staleness.step_done(on_feed=True)
    with pytest.raises(JobFailed, match="needs policy version 3"):
        await staleness.before_step(1)


async def test_an_unreachable_proxy_is_asked_again_and_a_proxy_without_the_fleet_api_fails_at_once():
    down = ProxyUnreachable("GET /v1/admin/engines", ConnectionRefusedError())
    admin = ScriptedAdmin(down, down, 7)
    assert await gate(admin).start() == 7 and admin.reads == 3
    no_fleet_api = ScriptedAdmin(ProxyRequestError("GET /v1/admin/engines", 404))
    with pytest.raises(JobFailed, match="fleet API"):
        await gate(no_fleet_api).start()
    assert no_fleet_api.reads == 1


@pytest.mark.parametrize(
    "policy, published", [("drop", ["fresh", "tokenless"]), ("keep", ["fresh", "old", "tokenless"])]
)
async def test_stale_groups_are_dropped_or_kept_marked(policy, published):
    staleness = gate(ScriptedAdmin(5), max_staleness=1, initial_policy_version=5, stale_groups=policy)
    groups = [Group("fresh", 4), Group("old", 3), Group("tokenless", None)]
    kept = await staleness.sort(0, groups)
    assert [group.group_id for group in kept] == published
    assert [group.group_id for group in kept if group.stale] == (["old"] if policy == "keep" else [])
    assert (staleness.stale.dropped, staleness.stale.kept) == ((1, 0) if policy == "drop" else (0, 1))


async def test_max_staleness_holds_per_policy():
    """A LoRA job's steps wait for its own policy's versions (the base's and another adapter's moving changes
    nothing), and each group is measured against the current version of the policy that sampled it."""
    admin = ScriptedAdmin(50, policies={"a": 3, "b": 9})
    waits: list[int | None] = []
    staleness = StalenessGate(
        admin, TrainingLoop(max_staleness=1, poll_interval=0.01, version_wait=0.05), on_wait=waits.append, policy="a"
    )
    assert await staleness.start() == 3  # the job's policy's version, not the fleet's 50
    for _ in range(3):
        staleness.step_done(on_feed=True)
    assert staleness.target() == 5
    with pytest.raises(JobFailed, match=r"needs policy 'a' version 5.*policy 'a' stayed at 3.*publishing new versions"):
        await staleness.before_step(3)
    groups = [Group("a-fresh", 2, policy="a"), Group("a-old", 1, policy="a"), Group("b-old", 7, policy="b")]
    kept = await staleness.sort(3, groups)
    assert [group.group_id for group in kept] == ["a-fresh"]  # a: 3 - 1 > 1; b: 9 - 7 > 1, against b's own
    assert "base" not in admin.asked
