"""From feed groups to what a policy-gradient step needs: rollouts, their sequences, padded micro-batches.

A **rollout** is one attempt at a sample: one reward, one advantage, and the token sequences it
produced: a feed group's trajectory and its branches (``Trajectory.sequences()``: the main
conversation, subagents, compactions, edits, kept retries), each sampled token trained in exactly
one of them. The rollout's reward and advantage apply to each sequence; per-token ("tok")
advantages are per sequence (``wire.feed.token_advantage_rows``: a flat list for a rollout of one
sequence, else one list per sequence). A whole rollout's main trajectory carries its counts
(``rollout_counts``): they must agree with its sequences (a feed that lost a branch on the way is
refused, not trained short), and they bring the retries the export dropped, which no sequence holds.

A sequence's arrays are aligned with its tokens: ``loss_weight`` is > 0 where the policy sampled
the token (what is trained), ``sampling_logprobs`` the engine's logprob of it (the old policy),
``versions`` the policy version that sampled it (-1: none recorded), and ``policies`` which policies
sampled it (``base``, or LoRA policies: ``docs/policies.md``). A trainer of one policy passes it to
``rollouts_of``: a sequence with tokens another policy sampled is refused, never trained as its own.

Layout: **padded**, not packed. Each micro-batch holds whole sequences, right-padded to its
longest one with ``attention_mask`` 0 on the padding, sorted by length so little is padded, at
most ``max_tokens`` (rows × longest) per micro-batch. Packing several sequences into one row
would need a block-diagonal attention mask (or a varlen attention kernel) to keep them apart;
padding needs only the standard causal mask. numpy only: the base package never imports torch.

A sequence with images (``Trajectory.images``) keeps its tokens as they are (each placeholder span already
expanded, loss weight 0) and carries each image's span and bytes (from its group's entry, ``FeedGroup.images``)
in span order; the learner turns the bytes into the model's vision inputs. Such a sequence is a micro-batch of
its own: its rows' images never have to be padded to one count across rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from rollout_proxy.wire.feed import FeedGroup, TokenAdvantageError, token_advantage_rows
from rollout_proxy.wire.trajectory import Trajectory

#: the version of a token whose sampling version was not recorded
NO_VERSION = -1


class BatchError(ValueError):
    """A group the trainer cannot train on, and why (it names the group, the rollout and the sequence)."""


@dataclass(frozen=True, slots=True)
class SequenceImage:
    """One image of a sequence: tokens ``[start, start + length)`` are its placeholder span; ``data`` its bytes."""

    start: int
    length: int
    sha256: str
    data: bytes


@dataclass(frozen=True, slots=True)
class TrainSequence:
    """One token sequence: every token, which are trained, their sampling logprobs and versions."""

    token_ids: np.ndarray  # int64 (n,)
    loss_weight: np.ndarray  # float32 (n,): > 0 where trained
    sampling_logprobs: np.ndarray  # float32 (n,): the engine's logprob where trained
    versions: np.ndarray  # int64 (n,): the policy version that sampled each token, NO_VERSION elsewhere
    #: one advantage per token ("tok" advantages), else None: the rollout's advantage applies
    token_advantages: np.ndarray | None = None
    #: where it comes from, for reports: its leaf response id and where it leaves the tree (``branch.kind``)
    response_id: str | None = None
    branch: str | None = None
    #: the policies whose spans cover its tokens, sorted (one for a session's sequence: its policy)
    policies: tuple[str, ...] = ()
    #: its images in span order (empty: text only)
    images: tuple[SequenceImage, ...] = ()

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def trained(self) -> np.ndarray:
        return self.loss_weight > 0


@dataclass(frozen=True, slots=True)
class Rollout:
    """One rollout of a sample: its reward, its advantage, its sequences."""

    group_id: str
    index: int  # within its group
    reward: float
    advantage: float | None  # None when the advantages are per token (each sequence has its own)
    sequences: tuple[TrainSequence, ...]
    #: the retries the export dropped (``retry: drop``): sequences and sampled tokens no sequence trains
    dropped_sequences: int = 0
    dropped_tokens: int = 0

    def advantages(self, sequence: TrainSequence) -> np.ndarray:
        """The advantage of every token of one of this rollout's sequences."""
        if sequence.token_advantages is not None:
            return sequence.token_advantages
        return np.full(len(sequence), 0.0 if self.advantage is None else self.advantage, dtype=np.float32)


def sequence_of(
    trajectory: Trajectory,
    *,
    where: str,
    policy: str | None = None,
    image_bytes: Callable[[str], bytes] | None = None,
) -> TrainSequence:
    """A trajectory's tokens as one training sequence (checked: aligned arrays, versions on trained tokens;
    with ``policy``, every span that policy's; image spans in order, inside the tokens, never trained).
    ``image_bytes``: an image's bytes by its sha256 (``FeedGroup.image_bytes``)."""
    ids = trajectory.token_ids().astype(np.int64)
    weight = trajectory.loss_weight()
    logprobs = trajectory.token_logprobs()
    if not len(weight) == len(logprobs) == len(ids):
        raise BatchError(
            f"{where}: {len(ids)} token ids, {len(weight)} loss weights, {len(logprobs)} logprobs: they must align"
        )
    if len(ids) and weight[0] > 0:
        raise BatchError(f"{where}: its first token is trained, but a causal model has no logit for it")
    versions = np.full(len(ids), NO_VERSION, dtype=np.int64)
    for span in trajectory.policy_versions:
        if not 0 <= span.start <= span.end <= len(ids):
            raise BatchError(f"{where}: policy version span [{span.start}, {span.end}) outside its {len(ids)} tokens")
        versions[span.start : span.end] = span.version
    policies = tuple(sorted({span.policy for span in trajectory.policy_versions}))
    if policy is not None and policies not in ((), (policy,)):
        others = ", ".join(repr(name) for name in policies if name != policy)
        raise BatchError(f"{where}: tokens sampled by policy {others}, not by {policy!r} that this trainer trains")
    images = _images_of(trajectory, ids, weight, where=where, image_bytes=image_bytes)
    kind = (trajectory.branch or {}).get("kind")
    return TrainSequence(
        ids,
        weight,
        logprobs,
        versions,
        response_id=trajectory.response_id,
        branch=kind if isinstance(kind, str) else None,
        policies=policies,
        images=images,
    )


def _images_of(
    trajectory: Trajectory,
    ids: np.ndarray,
    weight: np.ndarray,
    *,
    where: str,
    image_bytes: Callable[[str], bytes] | None,
) -> tuple[SequenceImage, ...]:
    images: list[SequenceImage] = []
    end = 0
    for index, image in enumerate(trajectory.images):
        if not end <= image.start < image.end <= len(ids):
            raise BatchError(
                f"{where}: image {index}'s span [{image.start}, {image.end}) is not after the previous one and "
                f"inside its {len(ids)} tokens"
            )
        if (weight[image.start : image.end] > 0).any():
            raise BatchError(f"{where}: image {index}'s span [{image.start}, {image.end}) has trained tokens")
        if image_bytes is None:
            raise BatchError(f"{where}: image {index} ({image.sha256}) has no bytes: the trainer needs its group's")
        try:
            data = image_bytes(image.sha256)
        except KeyError:
            raise BatchError(f"{where}: image {index} ({image.sha256}) is not on its group's entry") from None
        images.append(SequenceImage(image.start, image.length, image.sha256, data))
        end = image.end
    return tuple(images)


def _named(where: str, index: int, trajectory: Trajectory) -> str:
    """``where`` with the sequence: its index within the rollout, its leaf and branch kind where known."""
    known = [part for part in (trajectory.response_id, (trajectory.branch or {}).get("kind")) if part]
    return f"{where}, sequence {index}" + (f" ({', '.join(map(str, known))})" if known else "")


def rollouts_of(group: FeedGroup, *, policy: str | None = None) -> list[Rollout]:
    """A feed group's rollouts, each with all its sequences (``Trajectory.sequences()``) and its advantage
    (per rollout, or per token of each sequence); ``BatchError`` names the group, rollout and sequence.
    ``policy``: the one the trainer trains (a sequence another policy sampled is refused); None: any."""
    count = len(group.trajectories)
    if len(group.rewards) != count or len(group.advantages) != count:
        raise BatchError(
            f"group {group.group_id}: {count} trajectories, {len(group.rewards)} rewards, "
            f"{len(group.advantages)} advantages: one of each per rollout"
        )
    rollouts = []
    for index, (trajectory, reward, advantage) in enumerate(
        zip(group.trajectories, group.rewards, group.advantages, strict=True)
    ):
        where = f"group {group.group_id}, rollout {index}"
        members = trajectory.sequences()
        sequences = [
            sequence_of(member, where=_named(where, k, member), policy=policy, image_bytes=group.image_bytes)
            for k, member in enumerate(members)
        ]
        per_rollout: float | None = None
        if isinstance(advantage, list):  # "tok": one per token of each sequence
            try:
                rows = token_advantage_rows(advantage, [len(sequence) for sequence in sequences])
            except TokenAdvantageError as exc:
                place = where if exc.sequence is None else _named(where, exc.sequence, members[exc.sequence])
                raise BatchError(f"{place}: {exc.message}") from None
            sequences = [
                dataclasses.replace(sequence, token_advantages=np.asarray(row, dtype=np.float32))
                for sequence, row in zip(sequences, rows, strict=True)
            ]
        else:
            per_rollout = float(advantage)
        counts = trajectory.rollout_counts
        dropped_sequences = dropped_tokens = 0
        if counts is not None:
            trained = sum(int(sequence.trained.sum()) for sequence in sequences)
            if counts.sequences != len(sequences) or counts.trained_tokens != trained:
                raise BatchError(
                    f"{where}: its rollout counts {counts.sequences} sequences and {counts.trained_tokens} trained "
                    f"tokens, the feed carries {len(sequences)} sequences and {trained} trained tokens: a branch "
                    "was lost on the way"
                )
            dropped_sequences, dropped_tokens = counts.dropped_sequences, counts.dropped_tokens
        rollouts.append(
            Rollout(
                group.group_id,
                index,
                float(reward),
                per_rollout,
                tuple(sequences),
                dropped_sequences=dropped_sequences,
                dropped_tokens=dropped_tokens,
            )
        )
    return rollouts


@dataclass(frozen=True, slots=True)
class SequenceRef:
    """Where a micro-batch row comes from: the rollout (index in the step's list) and its sequence."""

    rollout: int
    sequence: int


@dataclass(frozen=True, slots=True)
class PaddedBatch:
    """Whole sequences, right-padded to the longest. Row i is ``rows[i]``; arrays are (rows, longest).

    ``loss_weight[:, t]`` is the weight of predicting token t (from the logits at t - 1), so column 0
    is always 0; ``sampling_logprobs``, ``advantages`` and ``versions`` are aligned the same way."""

    rows: tuple[SequenceRef, ...]
    lengths: np.ndarray  # int64 (rows,)
    input_ids: np.ndarray  # int64
    attention_mask: np.ndarray  # int64: 1 on tokens, 0 on padding
    loss_weight: np.ndarray  # float32, 0 on padding and on untrained tokens
    sampling_logprobs: np.ndarray  # float32
    advantages: np.ndarray  # float32
    versions: np.ndarray  # int64
    #: each row's images in span order (empty: text only)
    images: tuple[tuple[SequenceImage, ...], ...] = ()

    @property
    def has_images(self) -> bool:
        return any(self.images)

    @property
    def trained_span(self) -> tuple[int, int]:
        """[first, last + 1) over the columns with a trained token in any row ((0, 0) if none)."""
        columns = np.flatnonzero((self.loss_weight > 0).any(axis=0))
        return (int(columns[0]), int(columns[-1]) + 1) if len(columns) else (0, 0)


def pad(rollouts: Sequence[Rollout], refs: Sequence[SequenceRef], *, pad_id: int = 0) -> PaddedBatch:
    """The given sequences as one padded batch."""
    sequences = [rollouts[ref.rollout].sequences[ref.sequence] for ref in refs]
    lengths = np.asarray([len(s) for s in sequences], dtype=np.int64)
    shape = (len(sequences), int(lengths.max()) if len(sequences) else 0)
    input_ids = np.full(shape, pad_id, dtype=np.int64)
    attention_mask = np.zeros(shape, dtype=np.int64)
    loss_weight = np.zeros(shape, dtype=np.float32)
    logprobs = np.zeros(shape, dtype=np.float32)
    advantages = np.zeros(shape, dtype=np.float32)
    versions = np.full(shape, NO_VERSION, dtype=np.int64)
    for row, (ref, sequence) in enumerate(zip(refs, sequences, strict=True)):
        n = len(sequence)
        input_ids[row, :n] = sequence.token_ids
        attention_mask[row, :n] = 1
        loss_weight[row, :n] = sequence.loss_weight
        logprobs[row, :n] = sequence.sampling_logprobs
        advantages[row, :n] = rollouts[ref.rollout].advantages(sequence)
        versions[row, :n] = sequence.versions
    images = tuple(sequence.images for sequence in sequences)
    return PaddedBatch(
        tuple(refs), lengths, input_ids, attention_mask, loss_weight, logprobs, advantages, versions, images
    )


def micro_batches(rollouts: Sequence[Rollout], *, max_tokens: int, pad_id: int = 0) -> list[PaddedBatch]:
    """Every sequence with a trained token, longest first, in micro-batches of at most ``max_tokens``
    (rows × longest row; a sequence longer than that, or one with images, is a micro-batch of its own)."""
    refs = [
        SequenceRef(r, s)
        for r, rollout in enumerate(rollouts)
        for s, sequence in enumerate(rollout.sequences)
        if sequence.trained.any()
    ]

    def length(ref: SequenceRef) -> int:
        return len(rollouts[ref.rollout].sequences[ref.sequence])

    refs.sort(key=lambda ref: (-length(ref), ref.rollout, ref.sequence))
    batches: list[list[SequenceRef]] = []

    def alone(ref: SequenceRef) -> bool:
        return bool(rollouts[ref.rollout].sequences[ref.sequence].images)

    for ref in refs:  # longest first: a batch's first row is its longest
        fits = batches and (len(batches[-1]) + 1) * length(batches[-1][0]) <= max_tokens
        if fits and not alone(ref) and not alone(batches[-1][0]):
            batches[-1].append(ref)
        else:
            batches.append([ref])
    return [pad(rollouts, chunk, pad_id=pad_id) for chunk in batches]


def trained_tokens(rollouts: Sequence[Rollout]) -> int:
    return sum(int(sequence.trained.sum()) for rollout in rollouts for sequence in rollout.sequences)


def dropped_counts(rollouts: Sequence[Rollout]) -> dict[str, int]:
    """The sequences and sampled tokens the export dropped (retries the conversation did not go on from)."""
    return {
        "dropped_sequences": sum(r.dropped_sequences for r in rollouts),
        "dropped_tokens": sum(r.dropped_tokens for r in rollouts),
    }
