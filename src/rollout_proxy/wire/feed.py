"""The trainer feed's entries: one graded group of trajectories each.

The runner publishes ``FeedGroup``s; the Redis Stream / JSONL feed stores them as JSON;
``GET /v1/feed`` pages them as ``{"id", "data"}``; the trainer's ``TrajectoryConsumer``
yields ``FeedEntry``s (the entry id, for acknowledging, and the typed group).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from rollout_proxy.wire.errors import WireFormatError
from rollout_proxy.wire.trajectory import Trajectory


class TokenAdvantageError(WireFormatError):
    """Per-token advantages that do not fit a rollout's sequences; ``sequence``: which one (None: all), which
    ``message`` leaves to the caller to name (``where``)."""

    def __init__(self, message: str, *, sequence: int | None = None) -> None:
        super().__init__(message, param=None if sequence is None else f"[{sequence}]")
        self.sequence = sequence


def token_advantage_rows(value: Any, lengths: Sequence[int]) -> list[list[float]]:
    """One rollout's per-token ("tok") advantages as one row per sequence, checked against the sequences'
    token counts (``lengths``: ``len(total_token_ids)`` of each of ``Trajectory.sequences()``, in order).

    Two forms: **a flat list**, one value per token, for a rollout of one sequence (the seed's
    ``tok_advantages[i]``); **a list of lists**, one per sequence (the main one, then its branches), for
    any rollout. A flat list for a rollout of several sequences is refused: it cannot say which tokens
    it is for. ``TokenAdvantageError`` (a ``ValueError``) says what is wrong, and in which sequence."""
    if not isinstance(value, list):
        raise TokenAdvantageError(f"per-token advantages must be a list, not {type(value).__name__}")
    if all(isinstance(row, list) for row in value) and value:
        rows = value
    elif any(isinstance(row, list) for row in value):
        raise TokenAdvantageError(
            "per-token advantages mix values and lists: give one value per token or one list per sequence"
        )
    elif len(lengths) == 1:
        rows = [value]
    else:
        raise TokenAdvantageError(
            f"a flat list of {len(value)} per-token advantages for a rollout of {len(lengths)} sequences (its "
            f"branches): give one list per sequence, [main, *branches], each with one value per token"
        )
    if len(rows) != len(lengths):
        raise TokenAdvantageError(
            f"{len(rows)} lists of per-token advantages for a rollout of {len(lengths)} sequences"
        )
    for index, (row, length) in enumerate(zip(rows, lengths, strict=True)):
        if len(row) != length:
            raise TokenAdvantageError(f"{len(row)} per-token advantages for {length} tokens", sequence=index)
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in row):
            raise TokenAdvantageError("per-token advantages that are not all numbers", sequence=index)
    return [[float(v) for v in row] for row in rows]


def token_advantage_value(rows: list[list[float]]) -> list[Any]:
    """The feed's form of one rollout's rows: flat for one sequence (as the seed has it), else one list each."""
    return rows[0] if len(rows) == 1 else list(rows)


class FeedImage(BaseModel):
    """One image's bytes on a feed entry (``FeedGroup.images``, keyed by the sha256 of the bytes): its MIME type
    and the bytes in base64, as the session's image store kept them."""

    mime: str
    data: str

    @field_validator("data")
    @classmethod
    def _base64(cls, value: str) -> str:
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("an image's data must be base64") from None
        return value

    def decoded(self) -> bytes:
        """The image's bytes (what ``TrajectoryImage.sha256`` names)."""
        return base64.b64decode(self.data)

    @classmethod
    def of(cls, data: bytes, mime: str) -> FeedImage:
        return cls(mime=mime, data=base64.b64encode(data).decode("ascii"))


def named_images(trajectories: Sequence[Trajectory]) -> list[str]:
    """The hashes the image spans of ``trajectories`` name (every sequence, branches included), in order, once."""
    found: dict[str, None] = {}
    for trajectory in trajectories:
        for sequence in trajectory.sequences():
            found.update((image.sha256, None) for image in sequence.images)
    return list(found)


def check_feed_images(trajectories: Sequence[Trajectory], images: Mapping[str, FeedImage]) -> None:
    """``images`` holds exactly the images the spans of ``trajectories`` name, each one's bytes hashing to its
    key; ``WireFormatError`` saying which is not."""
    named = named_images(trajectories)
    missing = [sha for sha in named if sha not in images]
    if missing:
        raise WireFormatError(
            f"{len(missing)} image(s) the trajectories' spans name are not on the entry (first {missing[0]})",
            param="images",
        )
    extra = sorted(set(images) - set(named))
    if extra:
        raise WireFormatError(
            f"{len(extra)} image(s) on the entry that no trajectory's span names (first {extra[0]})", param="images"
        )
    for sha, image in images.items():
        if hashlib.sha256(image.decoded()).hexdigest() != sha:
            raise WireFormatError(f"the bytes of image {sha} do not hash to its sha256", param=f"images.{sha}")


class FeedGroup(BaseModel):
    """A sample's graded trajectories with their rewards and advantages."""

    model_config = ConfigDict(extra="allow")

    group_id: str
    job_id: str
    step: int
    sample_index: int
    sample: dict[str, Any] = Field(default_factory=dict)
    trajectories: list[Trajectory]
    rewards: list[float]
    grader_rewards: dict[str, list[float]] = Field(default_factory=dict)
    #: one per rollout (``trajectories[i]``: "grpo", "seq"), applying to each of its sequences; or per token
    #: ("tok"): for a rollout of one sequence a flat list (one value per token), for any rollout one list per
    #: sequence of ``trajectories[i].sequences()`` (``token_advantage_rows``)
    advantages: list[Any]
    advantage_kind: str
    metrics: list[dict[str, float]] = Field(default_factory=list)
    #: the oldest and newest policy version of any generated token in the group (None: not known)
    oldest_policy_version: int | None = None
    newest_policy_version: int | None = None
    #: how many groups the runner published in this step: a trainer's step is complete when it has them all
    step_groups: int | None = None
    #: kept although its oldest token was more than ``max_staleness`` versions old when published
    stale: bool = False
    #: the bytes of every image the trajectories' spans name (``TrajectoryImage.sha256``), each once, by that hash:
    #: with the tokens, what a trainer rebuilds a multimodal sequence's inputs from (absent on a text-only entry)
    images: dict[str, FeedImage] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _images_named(self) -> FeedGroup:
        check_feed_images(self.trajectories, self.images)
        return self

    @model_serializer(mode="wrap")
    def _text_unchanged(self, handler: SerializerFunctionWrapHandler):
        """An entry without images as before. Unannotated on purpose: pydantic then keeps the fields' schema for
        the answer (an annotated return type would replace it)."""
        data: dict[str, Any] = handler(self)
        if not data.get("images"):
            data.pop("images", None)
        return data

    def image_bytes(self, sha256: str) -> bytes:
        """The bytes of the image ``sha256`` (a ``TrajectoryImage.sha256`` of one of the trajectories)."""
        return self.images[sha256].decoded()

    def sequences(self) -> list[tuple[int, Trajectory]]:
        """(rollout index, sequence) for every sequence of every rollout of the group: a rollout's reward and
        advantage (``rewards[i]``, ``advantages[i]``) are those of each of its sequences, and every sampled
        token is trained (loss weight 1) in exactly one of them (``Trajectory.branches``)."""
        return [
            (index, sequence) for index, rollout in enumerate(self.trajectories) for sequence in rollout.sequences()
        ]

    def sequence_advantages(self) -> list[tuple[int, Trajectory, float | list[float]]]:
        """(rollout index, sequence, its advantage) for every sequence of every rollout: the rollout's one
        advantage, or (``advantage_kind`` "tok") that sequence's own per-token list, aligned with its
        ``total_token_ids``. ``WireFormatError`` for advantages that do not fit the rollouts."""
        if len(self.advantages) != len(self.trajectories):
            raise WireFormatError(
                f"{len(self.advantages)} advantages for {len(self.trajectories)} rollouts", param="advantages"
            )
        out: list[tuple[int, Trajectory, float | list[float]]] = []
        for index, (rollout, advantage) in enumerate(zip(self.trajectories, self.advantages, strict=True)):
            sequences = rollout.sequences()
            if isinstance(advantage, list):
                try:
                    rows = token_advantage_rows(advantage, [len(s.total_token_ids or []) for s in sequences])
                except TokenAdvantageError as exc:
                    where = f"advantages[{index}]" + ("" if exc.sequence is None else f", sequence {exc.sequence}")
                    raise WireFormatError(f"{where}: {exc.message}", param=f"advantages[{index}]") from None
                out += [(index, sequence, row) for sequence, row in zip(sequences, rows, strict=True)]
            else:
                out += [(index, sequence, float(advantage)) for sequence in sequences]
        return out


class FeedEntry(BaseModel):
    """One entry of the feed as a trainer reads it: its id (the cursor, what to ack) and the group."""

    id: str
    group: FeedGroup

    @property
    def group_id(self) -> str:
        return self.group.group_id
