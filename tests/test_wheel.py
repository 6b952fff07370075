"""The package as a user installs it: the wheel ``python -m build`` makes, in a clean venv, serving a session.

The venv has nothing but the wheel and what its metadata pulls in (from PyPI, or pip's cache), and the proxy
runs from outside the repository, so nothing is imported from ``src/``: a module, a template, a page or an
entry point the wheel forgot fails here. The engine is the fake one, started from this tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from load_tests.run import Services, free_port, start_engine
from rollout_proxy import __version__

ROOT = Path(__file__).resolve().parents[1]
ADMIN_KEY = "wheel-admin-key"


def call(url: str, body: dict | None = None, token: str = ADMIN_KEY) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Authorization": f"Bearer {token}"})
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=60) as answer:
        return answer.status, json.loads(answer.read() or b"{}")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean venv holding the wheel built from this tree; its bin/ directory."""
    work = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(work / "dist"), str(ROOT)],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (work / "dist").glob("rollout_proxy-*.whl")
    assert wheel.name.startswith(f"rollout_proxy-{__version__}-")
    subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    pip = subprocess.run(
        [str(work / "venv" / "bin" / "pip"), "install", "-q", str(wheel)], capture_output=True, text=True, env=env
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    return work / "venv" / "bin"


def test_the_installed_cli_says_its_version(installed: Path):
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([str(installed / "rollout-proxy"), "--version"], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout.strip() == f"rollout-proxy {__version__}"


def test_the_installed_proxy_serves_a_session_round_trip(installed: Path, tmp_path: Path):
    services = Services(tmp_path)
    try:
        _, engine_url = start_engine(services)
        port = free_port()
        log = (tmp_path / "proxy.log").open("wb")
        env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        argv = [str(installed / "rollout-proxy"), "serve", "--engine", engine_url, "--port", str(port)]
        proxy = subprocess.Popen(
            [*argv, "--admin-key", ADMIN_KEY, "--log-format", "json"],
            cwd=tmp_path,  # outside the repository: the wheel's modules, not src/
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        services.processes.append(("proxy", proxy))
        url = f"http://127.0.0.1:{port}"
        services.wait_http("proxy", f"{url}/readyz")
        question = [{"role": "user", "content": "What is the answer?"}]
        status, session = call(f"{url}/v1/sessions", {"sample": {"messages": question}})
        assert status == 201
        status, answer = call(
            f"{session['base_url']}/chat/completions", {"model": "m", "messages": question}, token=session["api_key"]
        )
        assert status == 200 and answer["choices"][0]["message"]["content"]
        status, trajectory = call(f"{url}/v1/responses/{answer['id']}/trajectory")
        assert (
            status == 200
            and trajectory["total_token_ids"][-len(answer["choices"][0]["token_ids"]) :]
            == (answer["choices"][0]["token_ids"])
        )
        with urllib.request.urlopen(f"{url}/ui", timeout=10) as page:  # the viewer's files are in the wheel
            assert page.status == 200 and b"viewer.js" in page.read()
        module = subprocess.run(
            [str(installed / "python"), "-c", "import rollout_proxy, sys; print(rollout_proxy.__file__)"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
        )
        assert "site-packages" in module.stdout, module.stdout
        tooling = subprocess.run(  # the fake engine, the checkpoint builder, the demo: not in the product
            [str(installed / "python"), "-c", "import devtools"], capture_output=True, text=True, cwd=tmp_path, env=env
        )
        assert tooling.returncode != 0 and "No module named 'devtools'" in tooling.stderr
    finally:
        services.stop()
