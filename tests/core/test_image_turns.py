"""Image turns through the TurnRunner, against the fake vLLM serving the tiny Idefics3 model's files: the node keeps
the expanded tokens the engine echoed, records where each image is, and every later turn sends every image of
its prompt again (the parents' read from the session's image store) with the spans collapsed."""

from __future__ import annotations

import dataclasses
import hashlib
import io
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from devtools.fake_engine import FakeEngine, FakeEngineServer
from rollout_proxy.core.rendering import Renderers, RenderingConfig, RenderSource
from rollout_proxy.core.trajectory import assemble
from rollout_proxy.core.tree import ResponseTree
from rollout_proxy.core.turns import TurnRunner, path_image_spans, path_tokens
from rollout_proxy.engines.fleet import Fleet
from rollout_proxy.engines.vllm_http import VLLMEngine
from rollout_proxy.errors import EngineError, ImagesUnsupported, InvalidRequest
from rollout_proxy.metrics import Metrics
from rollout_proxy.state.memory import MemoryStore
from rollout_proxy.tokenization.parsers import OutputParser
from rollout_proxy.wire.images import ImageBlob, image_part
from tests.core.builders import session_record
from tests.core.conftest import Clock, Turns

SPAN = 19  # <fake_token_around_image> <global-img> <image> x 16 <fake_token_around_image>


def blob(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30)) -> ImageBlob:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    data = buffer.getvalue()
    return ImageBlob(data, "image/png", width, height, hashlib.sha256(data).hexdigest())


def user(text: str, *images: ImageBlob) -> dict:
    return {
        "role": "user",
        "content": [*(image_part(image.sha256) for image in images), {"type": "text", "text": text}],
    }


async def running(tokenizer: Path) -> AsyncIterator[Turns]:
    fake = FakeEngine(tokenizer)
    async with FakeEngineServer(fake) as url:
        clock, store, metrics = Clock(), None, Metrics()
        store = MemoryStore(clock=clock)
        engine = VLLMEngine(url)
        fleet = Fleet([engine], metrics=metrics)
        await fleet.start()
        runner = TurnRunner(
            store=store,
            engines=fleet,
            parser=OutputParser.named("hermes", "think"),
            metrics=metrics,
            renderers=Renderers(RenderingConfig(), metrics=metrics),
        )
        yield Turns(fake, engine, store, clock, metrics, runner, ResponseTree(store=store, metrics=metrics))
        await fleet.close()


@pytest.fixture
async def turns(vlm_dir: Path) -> AsyncIterator[Turns]:
    async for each in running(vlm_dir):
        yield each


async def open_session(turns: Turns):
    session = session_record(engine=turns.engine.url, now=turns.clock.now)
    await turns.store.create_session(session)
    return session


def span_ids(fake: FakeEngine) -> list[int]:
    return fake.encode("<fake_token_around_image><global-img>" + "<image>" * 16 + "<fake_token_around_image>")


async def test_a_multi_turn_image_conversation_is_token_exact(turns: Turns):
    fake = turns.fake
    red, green = blob(200, 120), blob(40, 300, (10, 200, 10))
    session = await open_session(turns)
    first = [user("What is this?", red)]
    placement = await turns.tree.locate(session, first, api="chat")
    fake.queue("A red square.")
    one = await turns.runner.generate(session, placement, api="chat", tools=None, images=(red,))

    assert one.node.prompt_ids.tolist() == fake.generations[-1].prompt  # what the engine ran, token for token
    (span,) = one.node.images
    assert (span.length, span.sha256, span.width, span.height, span.nbytes) == (
        SPAN,
        red.sha256,
        200,
        120,
        len(red.data),
    )
    assert one.node.prompt_ids[span.start : span.end].tolist() == span_ids(fake)
    sent = fake.generate_requests[-1]
    assert sent["token_ids"].count(fake.images.marker_id) == 1 and len(sent["token_ids"]) == len(one.prompt_ids) - 18
    assert [part["uuid"] for part in sent["content_parts"]] == [red.sha256]

    # the second turn brings a new image and the first one again; the parent's image comes from the store
    second = [*first, one.node.messages[-1], user("And these two?", green, red)]
    placement = await turns.tree.locate(session, second, api="chat")
    fake.queue("Green, then red.")
    two = await turns.runner.generate(session, placement, api="chat", tools=None, images=(green,))
    prompt = fake.generations[-1].prompt
    assert np.array_equal(two.prompt_ids, prompt)
    assert (
        prompt[: len(path_tokens([one.node]))] == path_tokens([one.node]).tolist()
    )  # the parent's tokens as they were
    assert [(s.sha256, s.length) for s in two.node.images] == [(green.sha256, SPAN), (red.sha256, SPAN)]
    sent = fake.generate_requests[-1]
    assert [part["uuid"] for part in sent["content_parts"]] == [red.sha256, green.sha256, red.sha256]
    assert len(sent["token_ids"]) == len(prompt) - 3 * 18

    # a text-only turn after them still sends every image of its prompt
    third = [*second, two.node.messages[-1], {"role": "user", "content": "Thanks."}]
    placement = await turns.tree.locate(session, third, api="chat")
    fake.queue("You are welcome.")
    three = await turns.runner.generate(session, placement, api="chat", tools=None)
    assert three.node.images == ()
    assert [part["uuid"] for part in fake.generate_requests[-1]["content_parts"]] == [
        red.sha256,
        green.sha256,
        red.sha256,
    ]
    assert not fake.completions  # nothing of this conversation went to /v1/completions

    path = await turns.store.get_path(session.id, three.node.id)
    trajectory = assemble(session.id, path)
    assert trajectory.total_token_ids.tolist() == fake.generations[-1].prompt + fake.generations[-1].tokens
    where = [(image.start, image.sha256) for image in trajectory.images]
    offset = len(path_tokens([one.node]))
    assert where == [
        (span.start, red.sha256),
        (offset + two.node.images[0].start, green.sha256),
        (offset + two.node.images[1].start, red.sha256),
    ]
    for image in trajectory.images:
        assert trajectory.total_token_ids[image.start : image.start + image.length].tolist() == span_ids(fake)
        assert not trajectory.total_loss_weight[image.start : image.start + image.length].any()
    assert turns.metrics.value("prompt_drift_total") == 0


async def test_a_fork_off_an_image_turn_keeps_the_parents_images(turns: Turns):
    fake = turns.fake
    red, blue = blob(64, 64), blob(90, 30, (0, 0, 250))
    session = await open_session(turns)
    first = [user("Describe.", red)]
    fake.queue("Red.")
    one = await turns.runner.generate(
        session, await turns.tree.locate(session, first, api="chat"), api="chat", tools=None, images=(red,)
    )
    fake.queue("One.")
    await turns.runner.generate(
        session,
        await turns.tree.locate(session, [*first, one.node.messages[-1], user("Count.")], api="chat"),
        api="chat",
        tools=None,
    )
    fake.queue("Blue.")
    fork = await turns.runner.generate(
        session,
        await turns.tree.locate(session, [*first, one.node.messages[-1], user("And this?", blue)], api="chat"),
        api="chat",
        tools=None,
        images=(blue,),
    )
    assert fork.node.parent_id == one.node.id
    assert [part["uuid"] for part in fake.generate_requests[-1]["content_parts"]] == [red.sha256, blue.sha256]
    assert np.array_equal(fork.prompt_ids, fake.generations[-1].prompt)


async def test_a_turn_after_an_appended_note_still_sends_the_images_before_it(turns: Turns):
    """The images of a path are kept on its leaf (asked every turn); an appended node's are found by walking the
    path once, a generated node's are its prompt's."""
    fake = turns.fake
    red, blue = blob(64, 64), blob(90, 30, (0, 0, 250))
    session = await open_session(turns)
    fake.queue("Red.")
    first = [user("Describe.", red)]
    one = await turns.runner.generate(
        session, await turns.tree.locate(session, first, api="chat"), api="chat", tools=None, images=(red,)
    )
    assert one.node.path_images == one.node.images
    note = await turns.runner.inject(
        session, await turns.tree.after(session, one.node.id, [{"role": "user", "content": "A note."}]), api="chat"
    )
    fake.queue("Noted.")
    after = await turns.runner.generate(session, await turns.tree.after(session, note.id, []), api="chat", tools=None)
    assert [part["uuid"] for part in fake.generate_requests[-1]["content_parts"]] == [red.sha256]
    assert np.array_equal(after.prompt_ids, fake.generations[-1].prompt)
    assert after.node.path_images == one.node.images

    fake.queue("Blue.")
    then = await turns.runner.generate(
        session,
        await turns.tree.after(session, after.node.id, [user("And this?", blue)]),
        api="chat",
        tools=None,
        images=(blue,),
    )
    assert [part["uuid"] for part in fake.generate_requests[-1]["content_parts"]] == [red.sha256, blue.sha256]
    path = [one.node, note, after.node, then.node]
    walked = path_image_spans([*path[:-1], dataclasses.replace(then.node, path_images=None)])
    assert then.node.path_images == walked and [span.sha256 for span in walked] == [red.sha256, blue.sha256]
    tokens = path_tokens(path)
    for span, (node, own) in zip(
        walked, [(one.node, one.node.images[0]), (then.node, then.node.images[0])], strict=True
    ):
        assert np.array_equal(tokens[span.start : span.end], node.prompt_ids[own.start : own.end])
    assert walked[1].start == len(path_tokens(path[:-1])) + then.node.images[0].start

    text = await open_session(turns)
    fake.queue("Hello.")
    plain = await turns.runner.generate(
        text, await turns.tree.locate(text, [{"role": "user", "content": "Hi."}], api="chat"), api="chat", tools=None
    )
    assert plain.node.path_images == () and path_image_spans([plain.node]) == ()
    assert path_image_spans([one.node, note]) == one.node.images and path_image_spans([]) == ()


async def test_an_engine_that_expands_images_otherwise_is_drift(turns: Turns):
    fake = turns.fake
    assert fake.images is not None
    shorter = span_ids(fake)[:-2] + span_ids(fake)[-1:]  # one <image> fewer than the processor config says
    fake.images.span_for = lambda width, height: shorter
    session = await open_session(turns)
    red = blob(30, 30)
    placement = await turns.tree.locate(session, [user("What?", red)], api="chat")
    with pytest.raises(EngineError, match="expanded the prompt's images into other tokens"):
        await turns.runner.generate(session, placement, api="chat", tools=None, images=(red,))
    assert turns.metrics.value("prompt_drift_total") == 1
    assert await turns.store.get_images(session.id, [red.sha256]) == {}  # nothing stored

    # same tokens, spans said elsewhere: drift too
    fake.images.span_for = None
    real_expand = fake.images.expand

    def misplaced(token_ids, parts):
        prompt, ranges = real_expand(token_ids, parts)
        return prompt, [{"offset": ranges[0]["offset"] + 1, "length": ranges[0]["length"] - 1}]

    fake.images.expand = misplaced  # type: ignore[method-assign]
    with pytest.raises(EngineError, match="placed the prompt's images at"):
        await turns.runner.generate(session, placement, api="chat", tools=None, images=(red,))
    assert turns.metrics.value("prompt_drift_total") == 2


async def test_a_marker_written_where_no_image_is_is_refused_in_words(turns: Turns):
    fake = turns.fake
    session = await open_session(turns)
    first = [{"role": "user", "content": "Say <image> please."}]
    fake.queue("<image>")
    one = await turns.runner.generate(
        session, await turns.tree.locate(session, first, api="chat"), api="chat", tools=None
    )
    assert fake.completions  # a text-only prompt: /v1/completions, markers and all
    red = blob(20, 20)
    placement = await turns.tree.locate(session, [*first, one.node.messages[-1], user("Now this.", red)], api="chat")
    with pytest.raises(InvalidRequest, match="where no image is"):
        await turns.runner.generate(session, placement, api="chat", tools=None, images=(red,))
    assert not fake.generate_requests


async def test_a_model_without_an_image_rule_refuses_images_in_words(tokenizer_dir: Path):
    async for turns in running(tokenizer_dir):  # SmolLM2: a text model
        session = await open_session(turns)
        red = blob(20, 20)
        placement = await turns.tree.locate(session, [user("What?", red)], api="chat")
        with pytest.raises(ImagesUnsupported, match="no image placeholder rule"):
            await turns.runner.generate(session, placement, api="chat", tools=None, images=(red,))
        assert turns.runner._renderers.source(turns.engine.url) is RenderSource.LOCAL
        assert not turns.fake.generate_requests and not turns.fake.completions
