"""The image task (``examples/image_answer``): its pictures show what their answers say, and its job runs
through the runner on the fake engine serving the tiny Idefics3 model's files, each trajectory holding the
record's picture as an image span the grader's reward stands beside."""

from __future__ import annotations

import base64
import hashlib
import io
import json
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest
from PIL import Image

from devtools.fake_engine import FakeEngine
from rollout_proxy.embedded import BackgroundLoop, serve_app
from rollout_proxy.examples import image_answer
from rollout_proxy.runner import JobConfig, run_job
from rollout_proxy.state.feed import JsonlFeed


def picture(record: dict) -> bytes:
    return base64.b64decode(record["extra"]["image"].removeprefix("data:image/png;base64,"))


def job() -> tuple[JobConfig, list[dict]]:
    with resources.as_file(resources.files("rollout_proxy.examples") / "image_answer_job.yaml") as job_file:
        config = JobConfig.load(job_file)
    return config, [json.loads(line) for line in config.dataset_files()[0].read_text().splitlines()]


def test_each_picture_shows_its_answer():
    _, records = job()
    assert len(records) == len(image_answer.COLOURS) * len(image_answer.SHAPES)
    for record in records:
        with Image.open(io.BytesIO(picture(record))) as image:
            rgb = image.convert("RGB")
        centre = rgb.getpixel((image_answer.SIDE // 2, image_answer.SIDE // 2 + 6))
        corner = rgb.getpixel((2, 2))
        colour = next(name for name, value in image_answer.COLOURS.items() if value == centre)
        assert corner == (255, 255, 255)
        answer, question = record["extra"]["answer"], record["extra"]["question"]
        if "colour" in question:
            assert answer == colour
        else:
            assert answer in image_answer.SHAPES and record["messages"][0]["role"] == "system"
    # the committed file is what records() writes (the pictures compared as pixels, not as PNG bytes)
    written = image_answer.records()
    assert [record["extra"]["answer"] for record in records] == [record["extra"]["answer"] for record in written]
    for record, again in zip(records, written, strict=True):
        assert Image.open(io.BytesIO(picture(record))).tobytes() == Image.open(io.BytesIO(picture(again))).tobytes()


@pytest.fixture
def vlm_engine(vlm_dir: Path) -> Iterator[FakeEngine]:
    loop = BackgroundLoop("fake-vlm-engine")
    fake = FakeEngine(vlm_dir, delay=0.01)
    fake.policy = lambda prompt_ids: "Red"
    runner, fake.url = loop.run(serve_app(fake.app()))  # type: ignore[attr-defined]
    yield fake
    loop.run(runner.cleanup())
    loop.close()


async def test_the_image_job_runs_with_the_picture_in_each_trajectory(vlm_engine: FakeEngine, tmp_path: Path):
    config, records = job()
    hyper = config.hyperparameters
    summary = await run_job(config, engines=[vlm_engine.url], output_dir=tmp_path, progress=False)

    samples = hyper.num_steps * hyper.batch_size
    assert summary.samples_done == samples and summary.trajectories == samples * hyper.num_generations
    by_image = {hashlib.sha256(picture(record)).hexdigest(): record for record in records}
    entries = [entry.group.model_dump(mode="json") for entry in await JsonlFeed(summary.feed[6:]).read(limit=100)]
    assert len(entries) == samples
    for group in entries:
        record = group["sample"]
        data = picture(record)
        # the grader read the reply against the record's answer: the policy always says "Red"
        wanted = 1.0 if record["extra"]["answer"] == "red" else 0.0
        assert group["rewards"] == [wanted] * hyper.num_generations
        for trajectory in group["trajectories"]:
            (image,) = trajectory["images"]
            assert image["sha256"] == hashlib.sha256(data).hexdigest()
            assert (image["width"], image["height"], image["bytes"]) == (
                image_answer.SIDE,
                image_answer.SIDE,
                len(data),
            )
            span = slice(image["start"], image["start"] + image["length"])
            assert image["length"] > 1 and not any(trajectory["total_loss_weight"][span])
            assert trajectory["messages"][1]["content"][1] == {"type": "image", "image": image["sha256"]}
    assert {group["sample"]["extra"]["answer"] for group in entries} >= {"red", "circle"}
    # every call sent its record's picture to the engine's generate route, none went to /v1/completions
    assert len(vlm_engine.generate_requests) == samples * hyper.num_generations and not vlm_engine.completions
    for request in vlm_engine.generate_requests:
        (part,) = request["content_parts"]
        assert part["uuid"] in by_image
