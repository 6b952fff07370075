"""docker/compose.yaml as local processes: what each service runs here, on which port.

The compose file is the one description of the topology. ``plan()`` reads it and keeps each
service's entrypoint + command and environment, changed by these rules only:

- hosts: ``SERVICE:PORT`` (the port a service exposes) → ``127.0.0.1:<a free port>``;
  ``0.0.0.0`` → ``127.0.0.1``; a service's own port (the value of ``--port``/``-p``, or
  ``ROLLOUT_PROXY_PORT``) → its local port;
- paths: ``/app`` (the images' work dir: the repository's layout) → the repository,
  ``/opt/engine`` (the engine image's ``ROLLOUT_PROXY_CACHE``) → the dev cache, ``/data`` →
  the run's work directory; processes run in the repository, as the images in ``/app``;
- programs: ``rollout-proxy`` → ``python -m rollout_proxy`` of this interpreter,
  ``redis-server`` → the one on ``PATH``;
- images not run here: nginx → ``devtools.balancer`` on nginx.conf's upstreams;
  with ``engine="fake"`` the vLLM engine → the fake vLLM engine on the same port and template.

``${VAR:-default}`` is interpolated from the environment as compose does. Readiness comes
from each healthcheck (its ``http://127.0.0.1:PORT/PATH``, or ``redis-cli ... ping``), start
order from ``depends_on``; the service without a port (the runner) is the job that runs last.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from devtools import paths

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "docker" / "compose.yaml"
NGINX_CONF = REPO / "docker" / "nginx.conf"
ENGINES = ("vllm", "fake")
#: flags whose value is a service's own port
PORT_FLAGS = ("--port", "-p")
PORT_VARIABLES = ("ROLLOUT_PROXY_PORT",)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def interpolate(value: Any, environ: Mapping[str, str]) -> Any:
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}`` and ``$$``, in every string of ``value``."""
    if isinstance(value, dict):
        return {key: interpolate(item, environ) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, environ) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, operator, default = match.group(1), match.group(2), match.group(3) or ""
        found = environ.get(name)
        if operator == ":-" and not found:
            return default
        if operator == "-" and found is None:
            return default
        return found or ""

    return re.sub(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}", substitute, value)


def load_compose(path: Path = COMPOSE_FILE, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The compose file's services (anchors resolved, variables interpolated)."""
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    return interpolate(raw, os.environ if environ is None else environ)


def as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return [str(item) for item in value] if isinstance(value, list) else str(value).split()


def nginx_upstreams(path: Path = NGINX_CONF) -> list[str]:
    """``host:port`` of every ``server`` line in nginx.conf's upstream block."""
    text = re.sub(r"#.*", "", path.read_text(encoding="utf-8"))
    block = re.search(r"upstream\s+\S+\s*\{(.*?)\}", text, re.DOTALL)
    if block is None:
        raise ValueError(f"{path}: no upstream block")
    return re.findall(r"^\s*server\s+(\S+?)\s*;", block.group(1), re.MULTILINE)


@dataclass
class Probe:
    """How readiness is checked: ``kind`` "redis" (PING) or "http" (GET ``path``, 200)."""

    kind: str
    path: str = ""


@dataclass
class LocalService:
    """One service of the plan: compose's view of it and the local process that stands in."""

    name: str
    argv: list[str]
    env: dict[str, str]
    compose_argv: list[str]
    compose_env: dict[str, str]
    port: int | None
    container_port: int | None
    probe: Probe | None
    depends_on: list[str]
    replaces: str = ""  # what compose runs that is not run here: "nginx" (→ the balancer), "vllm" (→ the fake engine)

    @property
    def url(self) -> str:
        if self.port is None:
            return ""
        scheme = "redis" if self.probe is not None and self.probe.kind == "redis" else "http"
        return f"{scheme}://127.0.0.1:{self.port}"


@dataclass
class LocalPlan:
    """Every service, in start order, with the substitutions that made it."""

    services: list[LocalService]
    ports: dict[str, tuple[int, int]]  # service -> (container port, local port)
    paths: dict[str, str]  # container path -> local path
    programs: dict[str, list[str]]
    workdir: Path
    engine: str
    extra: dict[str, Any] = field(default_factory=dict)

    def service(self, name: str) -> LocalService:
        return next(service for service in self.services if service.name == name)

    @property
    def job(self) -> LocalService:
        """The service that runs to completion (no port): the runner."""
        return next(service for service in self.services if service.port is None)

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "workdir": str(self.workdir),
            "ports": {name: list(pair) for name, pair in self.ports.items()},
            "paths": self.paths,
            "programs": self.programs,
            "services": [
                {
                    "name": s.name,
                    "argv": s.argv,
                    "env": s.env,
                    "compose_argv": s.compose_argv,
                    "compose_env": s.compose_env,
                    "port": s.port,
                    "url": s.url,
                    "probe": None if s.probe is None else {"kind": s.probe.kind, "path": s.probe.path},
                    "depends_on": s.depends_on,
                    "replaces": s.replaces,
                }
                for s in self.services
            ],
        }


class Translator:
    """The rules of the module docstring, as text substitutions on one service's words."""

    def __init__(self, ports: dict[str, tuple[int, int]], path_map: dict[str, str]) -> None:
        self.ports = ports
        self.paths = path_map
        names = "|".join(re.escape(name) for name in sorted(ports, key=len, reverse=True))
        self._host = re.compile(rf"(?<![\w.-])({names}):(\d+)\b") if names else None

    def text(self, value: str) -> str:
        if self._host is not None:

            def local(match: re.Match[str]) -> str:
                container, port = self.ports[match.group(1)]
                return f"127.0.0.1:{port}" if int(match.group(2)) == container else match.group(0)

            value = self._host.sub(local, value)
        value = value.replace("0.0.0.0", "127.0.0.1")
        for container_path, local_path in self.paths.items():
            if value == container_path or value.startswith(container_path + "/"):
                return local_path + value[len(container_path) :]
        return value

    def argv(self, words: list[str], own: tuple[int, int] | None) -> list[str]:
        out = []
        for index, word in enumerate(words):
            if own is not None and index and words[index - 1] in PORT_FLAGS and word == str(own[0]):
                out.append(str(own[1]))
            else:
                out.append(self.text(word))
        return out

    def env(self, variables: Mapping[str, str], own: tuple[int, int] | None) -> dict[str, str]:
        out = {}
        for key, value in variables.items():
            if own is not None and key in PORT_VARIABLES and value == str(own[0]):
                out[key] = str(own[1])
            else:
                out[key] = self.text(value)
        return out


def _probe(healthcheck: Mapping[str, Any] | None, container_port: int | None) -> Probe | None:
    test = " ".join(as_list((healthcheck or {}).get("test")))
    if "redis-cli" in test and test.rstrip().endswith("ping"):
        return Probe("redis")
    match = re.search(rf"http://127\.0\.0\.1:{container_port}(/[\w/.-]*)", test)
    return Probe("http", match.group(1)) if match else None


def _order(services: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Start order: each service after what it depends on (compose's order otherwise)."""
    done: list[str] = []

    def visit(name: str, seen: tuple[str, ...]) -> None:
        if name in done:
            return
        if name in seen:
            raise ValueError(f"depends_on cycle: {' -> '.join((*seen, name))}")
        for dependency in services[name].get("depends_on") or []:
            visit(dependency, (*seen, name))
        done.append(name)

    for name in services:
        visit(name, ())
    return done


def plan(
    workdir: Path,
    *,
    engine: str = "vllm",
    compose_file: Path = COMPOSE_FILE,
    environ: Mapping[str, str] | None = None,
    port_for: Callable[[str], int] | None = None,
    tokenizer_dir: Path | None = None,
) -> LocalPlan:
    """What ``up`` runs for ``compose_file``: free local ports, translated commands and environments."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    services: dict[str, dict[str, Any]] = load_compose(compose_file, environ)["services"]
    port_for = port_for or (lambda _name: free_port())
    ports: dict[str, tuple[int, int]] = {}
    for name, spec in services.items():
        exposed = as_list(spec.get("expose"))
        if len(exposed) > 1:
            raise ValueError(f"service {name} exposes several ports; one each is supported")
        if exposed:
            ports[name] = (int(exposed[0]), port_for(name))
    path_map = {"/app": str(REPO), "/opt/engine": str(paths.cache_dir()), "/data": str(workdir)}
    redis = shutil.which("redis-server") or "redis-server"
    programs = {"rollout-proxy": [sys.executable, "-m", "rollout_proxy"], "redis-server": [redis]}
    translate = Translator(ports, path_map)

    local: list[LocalService] = []
    for name in _order(services):
        spec = services[name]
        own = ports.get(name)
        compose_argv = as_list(spec.get("entrypoint")) + as_list(spec.get("command"))
        compose_env = {str(k): "" if v is None else str(v) for k, v in (spec.get("environment") or {}).items()}
        argv = translate.argv(compose_argv, own)
        env = translate.env(compose_env, own)
        replaces = ""
        if argv and argv[0] in programs:
            argv = programs[argv[0]] + argv[1:]
        image = str(spec.get("image", ""))
        if image.startswith("nginx"):
            replaces = "nginx"
            assert own is not None, "the balancer exposes its port"
            upstreams = [f"http://{translate.text(upstream)}" for upstream in nginx_upstreams()]
            argv = [sys.executable, "-m", "devtools.balancer", "--port", str(own[1])]
            argv += [word for upstream in upstreams for word in ("--upstream", upstream)]
        elif engine == "fake" and "vllm.entrypoints.openai.api_server" in compose_argv:
            replaces = "vllm"
            assert own is not None, "the engine exposes its port"
            argv = [sys.executable, "-m", "devtools.topology", "fake-engine", "--port", str(own[1])]
            argv += ["--tokenizer", str(tokenizer_dir or paths.model_dir("dense"))]
            for flag in ("--chat-template", "--served-model-name"):
                if flag in compose_argv:
                    argv += [flag, translate.text(compose_argv[compose_argv.index(flag) + 1])]
            env = {}
        local.append(
            LocalService(
                name=name,
                argv=argv,
                env=env,
                compose_argv=compose_argv,
                compose_env=compose_env,
                port=None if own is None else own[1],
                container_port=None if own is None else own[0],
                probe=_probe(spec.get("healthcheck"), None if own is None else own[0]),
                depends_on=list(spec.get("depends_on") or []),
                replaces=replaces,
            )
        )
    jobs = [service.name for service in local if service.port is None]
    if len(jobs) != 1:
        raise ValueError(f"expected one service without a port (the job), got {jobs}")
    return LocalPlan(local, ports, path_map, programs, workdir, engine)
