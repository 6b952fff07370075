"""Rewards and advantages for the viewer, from the trainer feed this proxy serves (``--feed``).

The runner grades what it rolled out and publishes groups to the feed: each trajectory of a
group carries its response id, with the group's rewards and advantages. ``GradeBook`` reads
the feed forward from where it stopped (a few pages per call, so a long feed is caught up
over several calls, never in one slow answer) and keeps, per response id, the reward and,
when there is one per trajectory, the advantage. Per-token advantages are not kept: the
entry is read again when a trajectory view asks for them.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from rollout_proxy.errors import ProxyError
from rollout_proxy.state.feed import Feed
from rollout_proxy.wire.feed import FeedEntry

#: Feed entries read per call, and pages per refresh.
PAGE = 200
MAX_PAGES = 25
#: Grades kept (the oldest go first).
MAX_GRADES = 200_000


@dataclass(frozen=True, slots=True)
class Grade:
    session_id: str | None
    group_id: str
    job_id: str
    step: int
    index: int  # the trajectory's place in its group
    reward: float | None
    advantage: float | None  # one per trajectory (grpo, seq); None when they are per token (tok)
    advantage_kind: str
    entry_id: str
    reread_after: str | None  # the cursor whose next entry is this one

    def to_json(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "job_id": self.job_id,
            "step": self.step,
            "index": self.index,
            "reward": self.reward,
            "advantage": self.advantage,
            "advantage_kind": self.advantage_kind,
        }


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class GradeBook:
    def __init__(self, feed: Feed | None, *, page: int = PAGE, max_pages: int = MAX_PAGES) -> None:
        self._feed = feed
        self._page = page
        self._max_pages = max_pages
        self._cursor: str | None = None
        self._lock = asyncio.Lock()
        self._grades: OrderedDict[str, Grade] = OrderedDict()  # response id -> grade
        self._by_session: dict[str, list[str]] = {}  # session id -> response ids

    @property
    def available(self) -> bool:
        return self._feed is not None

    async def refresh(self) -> str | None:
        """Read what the feed gained since the last call; why it could not, or None."""
        if self._feed is None:
            return None
        async with self._lock:
            try:
                for _ in range(self._max_pages):
                    entries = await self._feed.read(self._cursor, self._page)
                    previous = self._cursor
                    for entry in entries:
                        self._add(entry, previous)
                        previous = entry.id
                    self._cursor = previous
                    if len(entries) < self._page:
                        break
            except ProxyError as exc:
                return f"the trainer feed cannot be read now: {exc.message}"
        return None

    def _add(self, entry: FeedEntry, reread_after: str | None) -> None:
        group = entry.group
        per_token = group.advantage_kind == "tok"
        for index, trajectory in enumerate(group.trajectories):
            response_id, session_id = trajectory.response_id, trajectory.session_id
            if not response_id:
                continue
            advantage = group.advantages[index] if index < len(group.advantages) else None
            self._grades[response_id] = Grade(
                session_id=session_id,
                group_id=group.group_id,
                job_id=group.job_id,
                step=group.step,
                index=index,
                reward=_number(group.rewards[index]) if index < len(group.rewards) else None,
                advantage=None if per_token else _number(advantage),
                advantage_kind=group.advantage_kind,
                entry_id=entry.id,
                reread_after=reread_after,
            )
            self._grades.move_to_end(response_id)
            if session_id:
                known = self._by_session.setdefault(session_id, [])
                if response_id not in known:
                    known.append(response_id)
        while len(self._grades) > MAX_GRADES:
            response_id, dropped = self._grades.popitem(last=False)
            held = self._by_session.get(dropped.session_id or "")
            if held is not None and response_id in held:
                held.remove(response_id)
                if not held:
                    del self._by_session[dropped.session_id or ""]

    def of_response(self, response_id: str) -> Grade | None:
        return self._grades.get(response_id)

    def of_session(self, session_id: str) -> dict[str, Grade]:
        """The session's graded responses (response id -> grade)."""
        return {
            response_id: self._grades[response_id]
            for response_id in self._by_session.get(session_id, [])
            if response_id in self._grades
        }

    async def token_advantages(self, grade: Grade) -> list[float] | None:
        """A per-token (``tok``) grade's advantages (of its main sequence, the graded trajectory's tokens), read
        again from its feed entry; None otherwise."""
        if self._feed is None or grade.advantage_kind != "tok":
            return None
        entries = await self._feed.read(grade.reread_after, 1)
        if not entries or entries[0].id != grade.entry_id:
            return None  # the entry is gone from the feed (trimmed)
        advantages = entries[0].group.advantages
        values = advantages[grade.index] if grade.index < len(advantages) else None
        if not isinstance(values, list):
            return None
        if values and isinstance(values[0], list):  # one list per sequence: the graded (main) one's is first
            values = values[0]
        return [float(value) for value in values]
