"""The image half of the StateStore contract, over both stores (memory and a real Redis): images are kept per
session by the hash of their bytes, each once, written with their node (atomically, within the store's bound),
read many in one call, and gone with their session."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator

import pytest

from rollout_proxy.errors import SessionFinished, TooManyImages
from rollout_proxy.ids import new_session_id
from rollout_proxy.state.memory import MemoryStore
from rollout_proxy.state.store import Idempotency, ImageBound
from rollout_proxy.wire.images import ImageBlob
from tests.harness import store_snapshot
from tests.state.test_store_contract import node, session_record


def image(seed: int, size: int = 100) -> ImageBlob:
    data = seed.to_bytes(2, "big") * (size // 2)
    return ImageBlob(data, "image/png", 10 + seed, 20 + seed, hashlib.sha256(data).hexdigest())


A, B, C = image(1), image(2), image(3)
BOUND = ImageBound(count=2, bytes=250)


@pytest.fixture(params=["memory", "redis"])
async def bounded(request: pytest.FixtureRequest) -> AsyncIterator[object]:
    """Each store, empty, that lets a session keep 2 images of 250 bytes at most."""
    if request.param == "memory":
        yield MemoryStore(image_bound=BOUND)
        return
    from rollout_proxy.state.redis import RedisStore

    store = await RedisStore.connect(request.getfixturevalue("redis_url"), image_bound=BOUND)
    await store._redis.flushdb()
    yield store
    await store.close()


async def put(store, session_id, item, images=(), idempotency=None):
    return await store.put_node(
        session_id,
        item,
        paths={item.path_hash: item.id},
        partial_paths={},
        latest="chat",
        images=images,
        idempotency=idempotency,
    )


async def open_session(store, ttl: float = 60.0):
    record = session_record(ttl)
    await store.create_session(record)
    return record


async def test_images_are_written_with_their_node_and_read_many_at_once(bounded):
    record = await open_session(bounded)
    item = node(record.id, None)
    await put(bounded, record.id, item, images=[A, B])
    assert await bounded.get_images(record.id, [B.sha256, A.sha256, C.sha256]) == {B.sha256: B, A.sha256: A}
    assert await bounded.get_images(record.id, []) == {}
    assert await bounded.get_images(new_session_id(), [A.sha256]) == {}  # another session holds none of them
    assert [n.id for n in await bounded.get_path(record.id, item.id)] == [item.id]


async def test_an_image_is_kept_once_however_often_it_is_sent(bounded):
    """Put-if-absent by hash: the same image in a node's write twice, and in later nodes, counts once."""
    record = await open_session(bounded)
    first = node(record.id, None, seed=1)
    await put(bounded, record.id, first, images=[A, A])
    second = node(record.id, first.id, seed=2)
    await put(bounded, record.id, second, images=[A])
    third = node(record.id, second.id, seed=3)
    await put(bounded, record.id, third, images=[A, B])  # 2 images of 200 bytes: within the bound
    assert set(await bounded.get_images(record.id, [A.sha256, B.sha256])) == {A.sha256, B.sha256}


@pytest.mark.parametrize(
    ("held", "adding"),
    [([A, B], [C]), ([], [A, B, C]), ([A], [image(4, size=200)])],  # too many; too many at once; too many bytes
)
async def test_a_write_past_the_bound_is_refused_and_leaves_nothing(bounded, held, adding):
    record = await open_session(bounded)
    parent = None
    if held:
        parent = node(record.id, None, seed=1)
        await put(bounded, record.id, parent, images=held)
    before = await store_snapshot(bounded)
    with pytest.raises(TooManyImages) as raised:
        await bounded.check_images(record.id, [*held, *adding])  # said ahead, as of now
    assert "--max-images-per-session" in raised.value.message and raised.value.status == 400
    refused = node(record.id, None if parent is None else parent.id, seed=9)
    with pytest.raises(TooManyImages):
        await put(bounded, record.id, refused, images=[*held, *adding], idempotency=Idempotency("k", "f"))
    assert await store_snapshot(bounded) == before  # no node, no image, no idempotency key
    assert await bounded.get_path(record.id, refused.id) is None
    assert await bounded.get_images(record.id, [image.sha256 for image in adding]) == {}


async def test_an_idempotent_replay_is_answered_whatever_the_images(bounded):
    record = await open_session(bounded)
    first = node(record.id, None, seed=1)
    await put(bounded, record.id, first, images=[A, B], idempotency=Idempotency("k", "f"))
    again = node(record.id, None, seed=2)
    assert await put(bounded, record.id, again, images=[A, B, C], idempotency=Idempotency("k", "f")) == first.id
    assert await bounded.get_images(record.id, [C.sha256]) == {}


async def test_a_finished_session_stores_no_more_images(bounded):
    record = await open_session(bounded)
    await bounded.finish_session(record.id, {"status": "success"})
    with pytest.raises(SessionFinished):
        await put(bounded, record.id, node(record.id, None), images=[A])
    assert await bounded.get_images(record.id, [A.sha256]) == {}


async def test_a_sessions_images_stay_after_its_finish_and_go_with_it(bounded):
    """A trainer reads a finished session's images (the nodes stay too); its expiry takes them, untouched."""
    record = await open_session(bounded, ttl=0.6)
    await put(bounded, record.id, node(record.id, None), images=[A])
    await bounded.finish_session(record.id, {"status": "success"})
    assert await bounded.get_images(record.id, [A.sha256]) == {A.sha256: A}
    await asyncio.sleep(1.5)
    assert await bounded.get_images(record.id, [A.sha256]) == {}
    assert record.id not in str(await store_snapshot(bounded))


async def test_the_default_bound_is_the_settings(store):
    record = await open_session(store)
    await put(store, record.id, node(record.id, None), images=[A, B, C])
    await store.check_images(record.id, [image(seed) for seed in range(256)])  # 256 images, 3 of them held
    with pytest.raises(TooManyImages):
        await store.check_images(record.id, [image(seed) for seed in range(257)])
