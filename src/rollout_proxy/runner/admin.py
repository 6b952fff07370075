"""The runner's side of the proxy's trainer API: sessions, finishing, counters.

Every call goes through the SDK's transport with the admin key, so an error
answer surfaces as ``ProxyRequestError`` (its ``status`` and the proxy's
``message``), and no answer at all as ``ProxyUnreachable``, never as a transport
library's own exception.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from rollout_proxy.runner.retries import JobFailed
from rollout_proxy.sdk.proxy import RolloutInferenceProxy, session_body
from rollout_proxy.sdk.transport import ProxyClient, ProxyRequestError
from rollout_proxy.sdk.types import ChatCompletionSample, Trajectory
from rollout_proxy.wire.feed import FeedImage
from rollout_proxy.wire.generation import BASE_POLICY

#: seconds an admin request may take (finishing a long session assembles its trajectories)
ADMIN_TIMEOUT = 300.0


@dataclass(slots=True)
class Finished:
    """A finished session as the runner publishes it: its trajectories, and the bytes of every image their
    spans name (by sha256, each once; empty for text)."""

    trajectories: list[Trajectory]
    images: dict[str, FeedImage] = field(default_factory=dict)

    def extend(self, other: Finished) -> Finished:
        """This one's trajectories, then ``other``'s, with the images of both."""
        return Finished([*self.trajectories, *other.trajectories], {**self.images, **other.images})


class AdminClient:
    """Admin requests to one proxy. Pass a ``transport`` to share one; else it owns its own."""

    def __init__(
        self, proxy_url: str, admin_key: str, *, transport: ProxyClient | None = None, timeout: float = ADMIN_TIMEOUT
    ) -> None:
        self._owned = transport is None
        self._transport = transport or ProxyClient(proxy_url, admin_key, timeout=timeout)

    async def create_session(
        self, sample: ChatCompletionSample, *, n_sample: int | None = None, **fields: Any
    ) -> RolloutInferenceProxy:
        """Open a rollout session for ``sample`` (its generation settings pinned); the plugin's handle on it."""
        body = session_body(sample, n_sample=n_sample, **fields)
        created = await self._transport.apost("/v1/sessions", body, what="creating a session")
        return RolloutInferenceProxy(created["base_url"], created["api_key"], sample=sample)

    async def finish(self, session_id: str, body: dict[str, Any]) -> Finished:
        """Send a rollout's result; the trajectories the proxy emitted for it, and the images they name."""
        finished = await self._transport.apost(
            f"/v1/sessions/{session_id}/finish", body, what=f"finishing session {session_id}"
        )
        return Finished(
            [Trajectory.model_validate(trajectory) for trajectory in finished["trajectories"]],
            {sha: FeedImage.model_validate(image) for sha, image in (finished.get("images") or {}).items()},
        )

    async def teacher_pass(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """``{"response_id", "teacher", "teacher_context", "topk"}`` -> the teacher's fields for that trajectory."""
        answer = await self._transport.apost(
            f"/v1/admin/sessions/{session_id}/teacher_pass", body, what=f"the teacher pass of session {session_id}"
        )
        return dict(answer)

    async def critic_view(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """``{"response_id", "critic_context"}`` -> ``{"critic_token_ids", "n_tokens_injected"}``."""
        answer = await self._transport.apost(
            f"/v1/admin/sessions/{session_id}/critic_view", body, what=f"the critic view of session {session_id}"
        )
        return dict(answer)

    async def counters(self) -> dict[str, float]:
        """The proxy's counters summed over their labels (``prompt_drift_total``, ``forks_total``, ...).

        A counter that never moved is absent."""
        counters = await self._transport.aget("/v1/admin/counters", what="reading the proxy's counters")
        return {str(name): float(value) for name, value in counters.items()}

    async def fleet(self) -> dict[str, Any]:
        """``GET /v1/admin/engines``: the fleet's ``policy_version``, whether it is ``paused``, its ``engines``."""
        fleet = await self._transport.aget("/v1/admin/engines", what="reading the fleet's policy version")
        return dict(fleet)

    async def policy_version(self, policy: str = BASE_POLICY) -> int:
        """A policy's current version: the base's is the fleet's (the last ``resume`` set it; at start, the
        engines'), a LoRA policy's its adapter's last published version (0 before the first)."""
        if policy == BASE_POLICY:
            return int((await self.fleet())["policy_version"])
        view = await self._transport.aget(
            f"/v1/admin/policies/{quote(policy, safe='')}", what=f"reading policy {policy!r}'s version"
        )
        return int(view.get("version") or 0)

    async def lora_version(self, name: str) -> int:
        """A LoRA policy's version (``GET /v1/admin/policies/{name}``; 0: not registered, or none published)."""
        try:
            view = await self._transport.aget(f"/v1/admin/policies/{name}", what=f"reading LoRA policy {name}")
        except ProxyRequestError as exc:
            if exc.status == 404:
                return 0
            raise
        return int(view.get("version") or 0)

    async def until_lora_published(self, name: str, *, within: float, poll: float) -> int:
        """Wait (at most ``within`` seconds) until the LoRA policy ``name`` has a version, which its trainer
        publishes (the first: its untrained adapter); that version, or JobFailed in words."""
        deadline = time.monotonic() + within
        while (version := await self.lora_version(name)) == 0:
            if time.monotonic() >= deadline:
                raise JobFailed(
                    f"the job's sessions sample with LoRA policy {name!r}, which had no version after {within:g}s "
                    f"(training_loop.version_wait): start its trainer (python -m rollout_proxy.trainer --job JOB, or "
                    f"--lora-rank R --policy {name}), which registers it with the untrained adapter as version 1"
                )
            await asyncio.sleep(min(poll, max(deadline - time.monotonic(), 0.0)))
        return version

    async def aclose(self) -> None:
        """Close the transport if this client opened it."""
        if self._owned:
            await self._transport.aclose()

    async def __aenter__(self) -> AdminClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
