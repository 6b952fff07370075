"""The viewer in a real headless Chromium (Debian's ``chromium``, driven by playwright).

A proxy over the fake engine (a pretend MoE, so tokens have routed experts) records a
weather session through the openai client (tool calls, a tool result, a fork, an injected
message) and a grade on its trainer feed; the browser opens ``/ui#key=…`` and goes where a
person would: the session list, the session's tree, the trajectory's tokens. It checks the
tokens' text and colours (loss weight 0 vs 1, the logprob scale, the advantage), clicks
tokens and reads their details back against the API's numbers, and keeps screenshots under
``out/test-artifacts/`` (printed). No browser is downloaded: without Chromium the test
fails and says how to install it.
"""

from __future__ import annotations

import base64
import colorsys
import hashlib
import io
import json
import math
import os
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from devtools.fake_engine import FakeEngine, FakeEngineServer, FakeMoE
from rollout_proxy.state.feed import JsonlFeed
from tests.conftest import TEMPLATES
from tests.harness import ADMIN_KEY, ProxyHarness
from tests.ui.recording import ADVANTAGE, JOB, REWARD, record

ROOT = Path(__file__).resolve().parents[2]
#: Where the screenshots go (gitignored ``out/``); ``ROLLOUT_PROXY_TEST_ARTIFACTS`` moves them.
ARTIFACTS = Path(os.environ.get("ROLLOUT_PROXY_TEST_ARTIFACTS", ROOT / "out" / "test-artifacts"))
#: Flags that work in containers and CI: no sandbox, GPU, QUIC or background traffic.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WEIGHT_ZERO, WEIGHT_ONE = (229, 231, 235), (187, 247, 208)
SETTLE_MS = 15_000  # the most any view may take to draw (they take well under a second)


def chromium() -> str:
    found = os.environ.get("ROLLOUT_PROXY_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.fail(
            "Chromium is not installed: the viewer's browser test needs Debian's chromium "
            "(scripts/test.sh installs it through scripts/lib.sh's ensure_system_packages; "
            "or apt-get install chromium, or set ROLLOUT_PROXY_CHROMIUM to a Chromium binary)"
        )
    return found


def rgb(css: str) -> tuple[int, int, int]:
    match = re.fullmatch(r"rgba?\((\d+), (\d+), (\d+)(?:, [\d.]+)?\)", css)
    assert match, css
    red, green, blue = (int(part) for part in match.groups())
    return red, green, blue


def hsl(hue: float, saturation: float, lightness: float) -> tuple[int, int, int]:
    red, green, blue = colorsys.hls_to_rgb(hue / 360, lightness, saturation)
    return round(red * 255), round(green * 255), round(blue * 255)


def close(one: tuple[int, int, int], other: tuple[int, int, int]) -> bool:
    return all(abs(a - b) <= 1 for a, b in zip(one, other, strict=True))


@pytest.fixture
async def engine(tokenizer_dir: Path) -> AsyncIterator[FakeEngine]:
    fake = FakeEngine(tokenizer_dir, chat_template=TEMPLATES["qwen3_style"])
    fake.moe = FakeMoE(num_layers=3, top_k=2, num_experts=8)
    async with FakeEngineServer(fake) as url:
        fake.url = url  # type: ignore[attr-defined]
        yield fake


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[Any]:
    """A fresh Chromium profile (its own user-data-dir), headless; playwright drives it."""
    from playwright.async_api import async_playwright

    executable = chromium()
    async with async_playwright() as driver:
        context = await driver.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),
            executable_path=executable,
            headless=True,
            args=FLAGS,
            viewport={"width": 1280, "height": 800},
        )
        try:
            yield context
        finally:
            await context.close()


async def drawn(page: Any, route: str) -> None:
    """Wait until the viewer says it drew ``route`` (``body[data-ready]``)."""
    await page.wait_for_function("(route) => document.body.dataset.ready === route", arg=route, timeout=SETTLE_MS)


async def shot(page: Any, name: str) -> Path:
    path = ARTIFACTS / name  # playwright makes the folder
    await page.screenshot(path=str(path), full_page=True)
    print(f"viewer screenshot: {path}")
    return path


async def test_the_viewer_shows_a_recorded_trajectory_token_by_token(engine, browser, tmp_path):
    feed_path = tmp_path / "feed.jsonl"
    async with ProxyHarness.running(engine_urls=[engine.url], fake=engine, feed=f"jsonl:{feed_path}") as harness:
        recorded = await record(harness, feed=JsonlFeed(feed_path))
        third = recorded.turns[2]
        status, api = await harness.request("GET", f"/v1/admin/responses/{third}/tokens")
        assert status == 200, api
        trajectory = api["trajectory"]
        ids, weights, logprobs = (
            trajectory["total_token_ids"],
            trajectory["total_loss_weight"],
            trajectory["total_token_logprobs"],
        )
        assert api["pieces"] == [engine.decode([token]) for token in ids]

        page = await browser.new_page()
        requested: list[str] = []
        page.on("request", lambda request: requested.append(request.url))
        problems: list[str] = []
        page.on("pageerror", lambda error: problems.append(str(error)))

        # the session list: opened with the key in the fragment, which then leaves the address
        await page.goto(f"{harness.url}/ui#key={ADMIN_KEY}")
        await drawn(page, "/")
        assert ADMIN_KEY not in page.url
        row = page.locator(f'tr[data-session="{recorded.session_id}"]')
        await row.wait_for()
        cells = await row.locator("td").all_inner_texts()
        assert JOB in cells and "finished success" in cells and "stop" in cells and f"{REWARD:.3f}" in cells
        await shot(page, "viewer-sessions.png")

        # the session's tree: five nodes, the fork with its provenance, the injected message
        await row.locator(f'a[href="#/session/{recorded.session_id}"]').click()
        await drawn(page, f"/session/{recorded.session_id}")
        assert await page.locator("li.node").count() == 5
        fork = page.locator(f'li[data-node="{recorded.forked}"]')
        assert "fork: diverged from" in await fork.locator(".badge.fork").inner_text()
        injected = page.locator(f'li[data-node="{recorded.injected}"]')
        assert "injected" in await injected.get_attribute("class")
        assert "Thanks!" in await injected.inner_text()
        # its branches: the fork is a rewrite, trained in the main sequence; the first turn in sequence 2
        assert "rewrite of" in await fork.locator(".badge.branch").inner_text()
        assert "sequence 1 (main)" in await fork.locator(".badge.trained").inner_text()
        first_node = page.locator(f'li[data-node="{recorded.turns[0]}"]')
        assert "sequence 2" in await first_node.locator(":scope > .card > header .badge.trained").inner_text()
        assert await page.locator("table.sequences tbody tr").count() == 2
        await shot(page, "viewer-tree.png")

        # the trajectory's tokens: each token its piece, coloured by loss weight
        await page.locator(f'li[data-node="{third}"] > .card a[href="#/tokens/{third}"]').click()
        await drawn(page, f"/tokens/{third}")
        tokens = page.locator("#tokens .tok")
        assert await tokens.count() == len(ids)
        shown = await tokens.evaluate_all(
            "(nodes) => nodes.map((n) => [n.textContent, getComputedStyle(n).backgroundColor])"
        )
        assert [text for text, _ in shown] == [piece or "∅" for piece in api["pieces"]]
        for index, (_, colour) in enumerate(shown):
            assert rgb(colour) == (WEIGHT_ONE if weights[index] == 1.0 else WEIGHT_ZERO), index
        assert {weight for weight in weights} == {0.0, 1.0}
        await shot(page, "viewer-tokens-weight.png")

        # by logprob: sampled tokens from red (p=0) to green (p=1), the rest grey
        await page.locator('#modes input[value="logprob"]').check()
        shown = await tokens.evaluate_all("(nodes) => nodes.map((n) => getComputedStyle(n).backgroundColor)")
        sampled = [index for index, weight in enumerate(weights) if weight == 1.0]
        for index in sampled:
            expected = hsl(round(120 * math.exp(logprobs[index])), 0.75, 0.78)
            assert close(rgb(shown[index]), expected), (index, logprobs[index], shown[index])
        assert all(rgb(shown[index]) == WEIGHT_ZERO for index, weight in enumerate(weights) if weight == 0.0)
        likeliest = max(sampled, key=lambda index: logprobs[index])
        unlikeliest = min(sampled, key=lambda index: logprobs[index])
        assert logprobs[likeliest] > logprobs[unlikeliest]
        (red_hi, green_hi, _), (red_lo, green_lo, _) = rgb(shown[likeliest]), rgb(shown[unlikeliest])
        assert green_hi - red_hi > green_lo - red_lo  # the likelier token is the greener one
        await shot(page, "viewer-tokens-logprob.png")

        # by advantage (the session was graded: one advantage for the whole trajectory)
        await page.locator('#modes input[value="advantage"]').check()
        shown = await tokens.evaluate_all("(nodes) => nodes.map((n) => getComputedStyle(n).backgroundColor)")
        assert all(close(rgb(shown[index]), hsl(135, 0.70, 0.70)) for index in sampled)
        assert f"{REWARD:.4f} / {ADVANTAGE:.4f}" in await page.locator("#grade").inner_text()
        await page.locator('#modes input[value="logprob"]').check()

        # a click on a sampled token: its id, text, logprob, weight, policy version, routed experts
        picked = sampled[len(sampled) // 2]
        await tokens.nth(picked).click()
        details = page.locator("#token-details")
        await details.wait_for()
        facts = {
            name: await details.locator(f'dd[data-fact="{name}"]').inner_text()
            for name in ("index", "token id", "text", "logprob", "loss weight", "policy version", "node")
        }
        assert facts["index"] == str(picked) and facts["token id"] == str(ids[picked])
        assert facts["text"] == json.dumps(engine.decode([ids[picked]]))
        assert float(facts["logprob"]) == pytest.approx(logprobs[picked], abs=1e-12)
        assert float(facts["loss weight"]) == 1.0
        assert facts["policy version"] == expected_version(trajectory, picked)
        (segment,) = [s for s in api["segments"] if s["start"] <= picked < s["end"]]
        assert segment["node_id"] in recorded.turns
        assert facts["node"] == f"{segment['node_id']} (generated, output)"
        field = trajectory["routed_experts"]
        routing = np.frombuffer(base64.b64decode(field["data"]), dtype=np.int16).reshape(field["shape"])
        cells = await page.locator("#experts tr").evaluate_all(
            "(rows) => rows.slice(1).map((r) => [...r.querySelectorAll('td')].map((c) => Number(c.textContent)))"
        )
        assert cells == routing[picked].tolist() and (routing[picked] >= 0).all()
        await shot(page, "viewer-tokens.png")  # README.md shows it (docs/viewer.png, 64 colours)

        # a click on a prompt token: weight 0, its logprob marked as not sampled
        prompt_token = weights.index(0.0)
        await tokens.nth(prompt_token).click()
        assert await details.locator('dd[data-fact="loss weight"]').inner_text() == "0"
        assert "not sampled" in await details.locator('dd[data-fact="logprob"]').inner_text()

        foreign = [url for url in requested if not (url.startswith(harness.url) or url.startswith("data:"))]
        assert foreign == [] and problems == []


def expected_version(trajectory: dict[str, Any], index: int) -> str:
    """What the details must say: the version of the span holding the token, or a dash without one."""
    for span in trajectory.get("policy_versions") or []:
        if span["start"] <= index < span["end"]:
            return str(span["version"])
    return "—"


async def test_a_wrong_key_is_asked_for_again(engine, browser):
    async with ProxyHarness.running(engine_urls=[engine.url], fake=engine) as harness:
        page = await browser.new_page()
        await page.goto(f"{harness.url}/ui#key=not-the-key")
        problem = page.locator("form.key .problem")
        await problem.wait_for(timeout=SETTLE_MS)
        assert "refused the key" in await problem.inner_text()
        await page.locator('form.key input[name="key"]').fill(ADMIN_KEY)
        await page.locator("form.key button").click()
        await drawn(page, "/")
        assert await page.locator("table.sessions").count() == 1


def picture(width: int, height: int, colour: str, kind: str = "PNG") -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, kind)
    return out.getvalue()


async def test_the_viewer_draws_each_image_where_its_span_is(vlm_engine, browser):
    red, green = picture(200, 120, "red"), picture(64, 48, "green", "JPEG")
    urls = [f"data:image/png;base64,{base64.b64encode(red).decode()}"]
    urls.append(f"data:image/jpeg;base64,{base64.b64encode(green).decode()}")
    async with ProxyHarness.running(engine_urls=[vlm_engine.url], fake=vlm_engine) as harness:
        vlm_engine.queue("Red.", "Green, then red.")
        session = await harness.create_session([])
        history: list[Any] = [
            {
                "role": "user",
                "content": [{"type": "text", "text": "This?"}, {"type": "image_url", "image_url": {"url": urls[0]}}],
            }
        ]
        first = await session.client.chat.completions.create(model="policy", messages=history)
        history += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in (urls[1], urls[0])]},
        ]
        second = await session.client.chat.completions.create(model="policy", messages=history)
        trajectory = await harness.trajectory(second.id)
        images, ids = trajectory["images"], trajectory["total_token_ids"]
        assert [image["sha256"] for image in images] == [hashlib.sha256(d).hexdigest() for d in (red, green, red)]

        page = await browser.new_page()
        requested: list[str] = []
        page.on("request", lambda request: requested.append(request.url))
        problems: list[str] = []
        page.on("pageerror", lambda error: problems.append(str(error)))
        await page.goto(f"{harness.url}/ui#key={ADMIN_KEY}")
        await drawn(page, "/")
        await page.goto(f"{harness.url}/ui#/tokens/{second.id}")
        await drawn(page, f"/tokens/{second.id}")

        # each span collapsed into its image, in place: the token before it, the image, the token after it
        shown = page.locator("#tokens .tok.image")
        assert await shown.count() == len(images)
        tokens = page.locator("#tokens .tok")
        assert await tokens.count() == len(ids) - sum(image["length"] for image in images) + len(images)
        indices = await tokens.evaluate_all("(nodes) => nodes.map((n) => Number(n.dataset.i))")
        for image in images:
            at = indices.index(image["start"])
            assert indices[at - 1] == image["start"] - 1 and indices[at + 1] == image["start"] + image["length"]
        await page.wait_for_function(
            "() => [...document.querySelectorAll('#tokens img.thumb')].every((img) => img.complete && img.naturalWidth)",
            timeout=SETTLE_MS,
        )
        drawn_images = await shown.evaluate_all(
            "(nodes) => nodes.map((n) => { const img = n.querySelector('img'); "
            "return [n.dataset.image, img.naturalWidth, img.naturalHeight, getComputedStyle(n).backgroundColor]; })"
        )
        assert [(sha, w, h) for sha, w, h, _ in drawn_images] == [
            (image["sha256"], image["width"], image["height"]) for image in images
        ]
        assert all(rgb(colour) == WEIGHT_ZERO for *_, colour in drawn_images)  # image tokens are not trained
        await shot(page, "viewer-tokens-images.png")

        # a click on an image: its hash, size and span
        await shown.nth(1).click()
        fact = await page.locator('#token-details dd[data-fact="image"]').inner_text()
        assert fact.startswith(f"{images[1]['sha256']}: 64×48, {len(green)} bytes; tokens {images[1]['start']}–")
        assert await page.locator("#tokens img.thumb.missing").count() == 0
        foreign = [url for url in requested if not (url.startswith(harness.url) or url.startswith("data:"))]
        assert foreign == [] and problems == []
