"""``python -m bench.images`` run tiny: every API's text and image variants measured side by side; and in
process, what the image variant sends is what it says: a new ~50 KB PNG at turn 1 and every ``--every``
turns, every image of the conversation reaching the engine on each image turn, none on the text turns."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from bench import images
from devtools.fake_engine import FakeEngine, FakeEngineServer
from tests.harness import ADMIN_KEY, ProxyHarness

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_run_measures_text_and_image_turns_on_each_api(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "bench.images", "--turns", "3", "--sessions", "1", "--rounds", "1"]
    command += ["--every", "2", "--stores", "memory", "--out", str(tmp_path)]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "images.json").read_text())
    measured = {(each["store"], each["api"], each["variant"]): each for each in report["runs"]}
    assert set(measured) == {("memory", api, variant) for api in images.APIS for variant in images.VARIANTS}
    for (_, _, variant), each in measured.items():
        assert len(each["cpu_per_turn"]) == 3 and all(cpu > 0 for cpu in each["cpu_per_turn"])
        assert each["p50_ms"] > 0 and each["engine_cpu_ms"] > 0
        assert each["images"] == (2 if variant == "image" else 0)
    assert 40_000 < report["png_bytes"] < 60_000
    assert all(f"| memory | {api} | " in run.stdout for api in images.APIS)


@pytest.fixture
async def vlm_proxy(vlm_dir: Path) -> AsyncIterator[ProxyHarness]:
    engine = FakeEngine(vlm_dir)
    async with FakeEngineServer(engine) as url, ProxyHarness.running(engine_urls=[url], fake=engine) as proxy:
        yield proxy


@pytest.mark.parametrize("api", images.APIS)
async def test_the_image_variant_sends_the_engine_its_images_and_the_text_one_none(
    vlm_proxy: ProxyHarness, api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = vlm_proxy.fake
    assert fake is not None
    monkeypatch.setattr(images, "ADMIN_KEY", ADMIN_KEY)
    args = argparse.Namespace(sessions=2, turns=6, every=4)
    pids = (os.getpid(), os.getpid())
    async with aiohttp.ClientSession() as http:
        text = await images.lockstep(http, vlm_proxy.url, pids, api, False, args, seed=1)
        assert text["images"] == 0 and not fake.generate_requests and len(fake.completions) == 12
        image = await images.lockstep(http, vlm_proxy.url, pids, api, True, args, seed=2)
    # turns 1 and 5 add an image: each session's turns send the engine 1, 1, 1, 1, 2, 2 images, each distinct
    assert image["images"] == 2 and len(fake.generate_requests) == 12 and len(fake.completions) == 12
    sent = [len(request["content_parts"]) for request in fake.generate_requests]
    assert sorted(sent) == sorted([1, 1, 1, 1, 2, 2] * 2)
    uuids = {part["uuid"] for request in fake.generate_requests for part in request["content_parts"]}
    assert len(uuids) == 4
