"""The trainer on image groups: the image job (``examples/image_answer``) through the runner on the fake engine,
its feed entries read back, and a tiny random Idefics3 scoring them. Each sequence's inputs are its trajectory's
tokens and its entry's image bytes through the model's image processor: the trainer's logprobs are those of the
model run directly on the record's own picture, a wrong picture or a span off by one shows, and the mismatch
report counts every sampled token of the image sequences (the fake engine's logprobs are a hash, so its Δ says
nothing here; ``tests/integration/test_images_real.py`` measures Δ against vLLM)."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import shutil
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from devtools.fake_engine import FakeEngine
from rollout_proxy.embedded import BackgroundLoop, serve_app
from rollout_proxy.runner import JobConfig, run_job
from rollout_proxy.state.feed import JsonlFeed
from rollout_proxy.trainer.batch import BatchError, Rollout, micro_batches, rollouts_of
from rollout_proxy.trainer.mismatch import mismatch_report
from rollout_proxy.wire.feed import FeedGroup

torch = pytest.importorskip("torch")

from rollout_proxy.trainer.grpo import GRPOLearner, token_logprobs  # noqa: E402


@pytest.fixture(scope="module")
def tiny_vlm(vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The VLM files with random weights: the tiny tower of the real checkpoint, a one-layer text model."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    out = tmp_path_factory.mktemp("tiny-vlm")
    for path in vlm_dir.iterdir():
        shutil.copy2(path, out / path.name)
    config = json.loads((vlm_dir / "config.json").read_text())
    config["text_config"].update(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    config["text_config"].pop("head_dim", None)
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(Idefics3Config(**config)).save_pretrained(out)
    return out


@pytest.fixture
def vlm_engine(tiny_vlm: Path) -> Iterator[FakeEngine]:
    loop = BackgroundLoop("fake-vlm-engine")
    fake = FakeEngine(tiny_vlm, delay=0.01)
    fake.policy = lambda prompt_ids: "Red"
    runner, fake.url = loop.run(serve_app(fake.app()))  # type: ignore[attr-defined]
    yield fake
    loop.run(runner.cleanup())
    loop.close()


async def image_groups(engine: FakeEngine, tmp_path: Path) -> list[FeedGroup]:
    with resources.as_file(resources.files("rollout_proxy.examples") / "image_answer_job.yaml") as job_file:
        config = JobConfig.load(job_file)
    config.hyperparameters.num_steps, config.hyperparameters.batch_size = 1, 2
    config.hyperparameters.num_generations = 2
    summary = await run_job(config, engines=[engine.url], output_dir=tmp_path, progress=False)
    return [entry.group for entry in await JsonlFeed(summary.feed[6:]).read(limit=100)]


def direct_logprobs(model, rollout: Rollout, picture: bytes) -> np.ndarray:
    """The model run on the sequence's tokens and ``picture`` by the image processor: logprob of every token."""
    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(model.name_or_path)
    pixels = processor(images=[[Image.open(io.BytesIO(picture))]], return_tensors="pt")
    ids = torch.from_numpy(rollout.sequences[0].token_ids)[None]
    with torch.no_grad():
        logits = model(input_ids=ids, **pixels).logits[0, :-1]
    chosen = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    return np.concatenate([[0.0], chosen.numpy()])


def record_picture(group: FeedGroup) -> bytes:
    return base64.b64decode(group.sample["extra"]["image"].removeprefix("data:image/png;base64,"))


async def test_the_trainer_scores_image_sequences_on_their_own_pictures(
    vlm_engine: FakeEngine, tiny_vlm: Path, tmp_path: Path
):
    groups = await image_groups(vlm_engine, tmp_path)
    learner = GRPOLearner(tiny_vlm)
    assert learner.vision is not None and learner.vision.tokens_per_image == 16
    rollouts = [rollout for group in groups for rollout in rollouts_of(group)]
    assert all(len(sequence.images) == 1 for rollout in rollouts for sequence in rollout.sequences)
    scored = learner.score(rollouts)
    trained = sum(int(sequence.trained.sum()) for rollout in rollouts for sequence in rollout.sequences)
    report = mismatch_report(scored, trainer_version=0, threshold=1e-2)
    assert report.tokens == trained == sum(len(part.trainer) for part in scored) > 0
    assert report.with_images.tokens == report.current.tokens == trained  # all sampled at version 0
    assert type(report).from_dict(report.as_dict()) == report
    for part, rollout in zip(scored, rollouts, strict=True):
        (image,) = rollout.sequences[0].images
        assert not ((part.positions >= image.start) & (part.positions < image.start + image.length)).any()

    # the trainer's logprobs are the model's on the record's own picture, and another picture moves them
    first, other = groups[0], next(g for g in groups if record_picture(g) != record_picture(groups[0]))
    rollout, part = rollouts[0], scored[0]
    own = direct_logprobs(learner.model, rollout, record_picture(first))[part.positions]
    np.testing.assert_allclose(part.trainer, own, atol=1e-5)
    wrong = direct_logprobs(learner.model, rollout, record_picture(other))[part.positions]
    assert np.abs(wrong - part.trainer).max() > 1e-3

    # a step on image groups: the same forward with gradients, weights saved as a checkpoint the trainer reloads
    # (the fake policy always answers "Red": a group's rewards, hence its advantages, are all equal; set some)
    signed = [dataclasses.replace(r, advantage=1.0 if k % 2 else -1.0) for k, r in enumerate(rollouts)]
    step = learner.train_step(signed)
    assert np.isfinite(step.metrics["loss"]) and step.metrics["grad_norm"] > 0
    np.testing.assert_allclose(
        np.concatenate([p.trainer for p in step.scored]), np.concatenate([p.trainer for p in scored]), atol=1e-5
    )
    learner.save(tmp_path / "v1")
    again = GRPOLearner(tmp_path / "v1")
    assert again.vision is not None
    moved = np.concatenate([p.trainer for p in again.score(rollouts)]) - np.concatenate([p.trainer for p in scored])
    assert np.abs(moved).max() > 1e-4


async def test_a_span_that_disagrees_with_the_tokens_is_refused_in_words(
    vlm_engine: FakeEngine, tiny_vlm: Path, tmp_path: Path, tiny_checkpoint: Path
):
    groups = await image_groups(vlm_engine, tmp_path)
    (rollout, *_) = rollouts_of(groups[0])
    sequence = rollout.sequences[0]
    (image,) = sequence.images
    shifted = dataclasses.replace(sequence, images=(dataclasses.replace(image, start=image.start - 1),))
    (batch,) = micro_batches([dataclasses.replace(rollout, sequences=(shifted,))], max_tokens=4096)
    learner = GRPOLearner(tiny_vlm)
    with pytest.raises(
        BatchError, match=r"image 0's span \[\d+, \d+\) holds 16 image token\(s\) .* the span and the tokens disagree"
    ):
        token_logprobs(learner.model, batch, vision=learner.vision)
    (batch,) = micro_batches([rollout], max_tokens=4096)
    with pytest.raises(BatchError, match="a model that takes none"):
        token_logprobs(GRPOLearner(tiny_checkpoint).model, batch)
