"""The runner against the fake engine (on its own loop), with a weather-answering policy."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools.fake_engine import FakeEngine
from rollout_proxy.embedded import BackgroundLoop, serve_app
from rollout_proxy.examples.weather_tool import WEATHER_TOOL
from tests.conftest import TEMPLATES
from tests.runner import runner_plugins

CITIES = ["Paris", "Berlin", "Rome", "Oslo", "Cairo", "Lima", "Tokyo", "Delhi", "Quito", "Seoul"]


def weather_policy(fake: FakeEngine):
    """Call the tool for the city asked about; then state the tool's answer."""

    def policy(prompt_ids: list[int]) -> str:
        last_user = fake.decode(prompt_ids).split("<|im_start|>")[-2]
        response = re.search(r"<tool_response>\n(.*?)\n</tool_response>", last_user, re.DOTALL)
        if response:
            weather = json.loads(response.group(1))
            return f"It is {weather['condition']} in {weather['location']}."
        city = last_user.removesuffix("<|im_end|>\n").rstrip("?").split()[-1]
        return f'<tool_call>\n{{"name": "get_current_weather", "arguments": {{"location": "{city}"}}}}\n</tool_call>'

    return policy


@pytest.fixture
def engine(tokenizer_dir: Path) -> Iterator[FakeEngine]:
    loop = BackgroundLoop("fake-engine")
    fake = FakeEngine(tokenizer_dir, chat_template=TEMPLATES["qwen3_style"], delay=0.02)
    fake.policy = weather_policy(fake)
    runner, fake.url = loop.run(serve_app(fake.app()))  # type: ignore[attr-defined]
    runner_plugins.CALLS.clear()
    runner_plugins.ACTIVE.update(now=0, max=0)
    yield fake
    loop.run(runner.cleanup())
    loop.close()


def write_dataset(path: Path, behaviours: list[str], *, quality=lambda i: i % 2, extra=None) -> Path:
    with path.open("w") as out:
        for index, behaviour in enumerate(behaviours):
            record = {
                "messages": [{"role": "user", "content": f"What is the weather in {CITIES[index % len(CITIES)]}?"}],
                "tools": [WEATHER_TOOL],
                "extra": {
                    "id": f"s{index}",
                    "behaviour": behaviour,
                    "quality": quality(index),
                    **(extra(index) if extra else {}),
                },
            }
            out.write(json.dumps(record) + "\n")
    return path


def write_job(
    directory: Path, *, dataset: Path, graders: list[tuple[str, float]], engine_url: str, **hyper: Any
) -> Path:
    job = {
        "name": "weather-e2e",
        "customization_type": "GRPO",
        "model_reference": {"foundation_model": {"name": "smollm2", "model_version": "135m"}},
        "custom_rl_pipeline": {
            "rollout": {
                "plugin": {
                    "name": "status_rollout",
                    "python_func": "tests.runner.runner_plugins:status_rollout",
                    "envs": {"WEATHER_MODE": "fake"},
                }
            },
            "graders": [
                {"plugin": {"python_func": f"tests.runner.runner_plugins:{name}"}, "weight": weight}
                for name, weight in graders
            ],
        },
        "data": {"training_set": {"local_files": [str(dataset)]}},
        "hyperparameters": {
            "num_generations": 3,
            "max_new_tokens": 128,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "batch_size": 10,
            **hyper,
        },
        "proxy": {"engines": [engine_url], "output_dir": str(directory / "out")},
    }
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(job, allow_unicode=True))
    return path
