"""The topology of docker/compose.yaml without Docker: the same services as local processes.

Redis, the vLLM CPU engine (or ``--engine fake``: the fake vLLM engine, for a fast run),
two ``rollout-proxy serve`` replicas on the Redis store, the round-robin balancer in front of
them, then the runner on the demo job through the balancer. Commands and environment come
from compose.yaml (``compose_plan`` says how they are carried over); each service waits for
what it depends on to be healthy. It prints where everything is, what the replicas served
and the job's summary, then stops everything it started (on success, failure, Ctrl-C or
SIGTERM; ``down`` stops what a killed run left behind).

    python -m devtools.topology up [--engine vllm|fake] [--workdir DIR] [--keep] [--json-out F]
    python -m devtools.topology plan [--engine vllm|fake]     # what `up` would run (JSON)
    python -m devtools.topology down --workdir DIR            # stop a killed run's leftovers
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

from devtools.compose_plan import REPO, LocalPlan, LocalService, plan

STATE_FILE = "topology.json"
START_TIMEOUT = {"engine": 900.0}  # vLLM on CPU: ~1 min warm, more on a loaded machine
DEFAULT_START_TIMEOUT = 120.0
STOP_GRACE = 20.0
STAND_INS = {"nginx": "the Python balancer in place of nginx", "vllm": "the fake engine in place of vLLM"}


def log(message: str) -> None:
    print(f"[topology] {message}", file=sys.stderr, flush=True)


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this service if the topology process dies (even by SIGKILL)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (tells a pid from a recycled one), None if gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _group_alive(pgid: int) -> list[int]:
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                alive.append(int(entry))
    return alive


def stop_group(pid: int, started: int | None, grace: float = STOP_GRACE) -> bool:
    """SIGTERM the process group led by ``pid`` (if it is still the process we started), then SIGKILL.

    True if anything was running. Each service leads its own group, so its children go too."""
    if started is not None and _start_time(pid) not in (None, started):
        return False  # the pid was recycled: not ours
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        if not _group_alive(pid):
            return sig != signal.SIGTERM
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + wait
        while _group_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    return True


def inherited_environment() -> dict[str, str]:
    """This process's environment less its ``ROLLOUT_PROXY_*`` settings (the cache dir aside): a container
    does not inherit the shell's, so a service gets exactly compose's."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_PROXY_") or k == "ROLLOUT_PROXY_CACHE"}


def probe(service: LocalService, timeout: float = 1.0) -> bool:
    """Whether the service answers its healthcheck now."""
    if service.probe is None or service.port is None:
        return True
    if service.probe.kind == "redis":
        try:
            with socket.create_connection(("127.0.0.1", service.port), timeout=timeout) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False
    try:
        with urllib.request.urlopen(f"{service.url}{service.probe.path}", timeout=timeout) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False


def http_json(url: str, token: str, timeout: float = 10.0) -> Any:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


class Topology:
    """Runs a ``LocalPlan``'s services; ``with Topology(plan) as t: t.up(); t.run_job()`` stops them all."""

    def __init__(self, local: LocalPlan) -> None:
        self.plan = local
        self.workdir = local.workdir
        self.logs = self.workdir / "logs"
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.job_exit: int | None = None

    # -- processes --------------------------------------------------------------------------

    def _spawn(self, service: LocalService) -> subprocess.Popen[bytes]:
        self.logs.mkdir(parents=True, exist_ok=True)
        log_path = self.logs / f"{service.name}.log"
        with log_path.open("ab") as out:
            out.write(("$ " + " ".join(service.argv) + "\n").encode())
            out.flush()
            process = subprocess.Popen(
                service.argv,
                cwd=REPO,  # the images' /app
                env={**inherited_environment(), **service.env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # only prctl runs between fork and exec
            )
        self.processes[service.name] = process
        self._save_state()
        return process

    def _save_state(self) -> None:
        state = {name: {"pid": p.pid, "started": _start_time(p.pid)} for name, p in self.processes.items()}
        tmp = self.workdir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.workdir / STATE_FILE)

    def start(self, service: LocalService) -> None:
        """Start ``service`` and wait until its healthcheck passes (its log's tail if it exits or times out)."""
        for dependency in service.depends_on:
            if dependency not in self.processes:
                raise RuntimeError(f"{service.name} depends on {dependency}, which is not running")
        instead = f" ({STAND_INS[service.replaces]})" if service.replaces else ""
        log(f"starting {service.name}{instead}: {service.url}")
        process = self._spawn(service)
        started = time.monotonic()
        deadline = started + START_TIMEOUT.get(service.name, DEFAULT_START_TIMEOUT)
        while not probe(service):
            if process.poll() is not None or time.monotonic() > deadline:
                why = f"exited with {process.returncode}" if process.returncode is not None else "is not healthy"
                raise RuntimeError(f"{service.name} {why}; log tail:\n{self.log_tail(service.name)}")
            time.sleep(0.25)
        log(f"{service.name} healthy in {time.monotonic() - started:.1f}s")

    def up(self) -> None:
        """Every service but the job, in dependency order, each healthy before the next."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        for service in self.plan.services:
            if service is not self.plan.job:
                self.start(service)

    def run_job(self, timeout: float | None = None, extra_args: Sequence[str] = ()) -> int:
        """Run the job (the runner) to its end, with ``extra_args`` after compose's; its exit status."""
        job = self.plan.job
        if extra_args:
            job = dataclasses.replace(job, argv=[*job.argv, *extra_args])
        log(f"running {job.name}: {' '.join(job.argv[3:])}")
        process = self._spawn(job)
        try:
            self.job_exit = process.wait(timeout=timeout)
        finally:
            if process.poll() is None:
                stop_group(process.pid, None)
            del self.processes[job.name]
            self._save_state()
        log(f"{job.name} exited with {self.job_exit}")
        return self.job_exit

    def kill(self, name: str) -> None:
        """Stop one service now (a fault, in tests); the others keep running."""
        process = self.processes.pop(name)
        stop_group(process.pid, None, grace=0.0)
        process.wait(timeout=10)
        self._save_state()

    def stop(self) -> None:
        """Stop every service still running, the last started first; again, it does nothing."""
        for name in reversed(list(self.processes)):
            process = self.processes.pop(name)
            if stop_group(process.pid, None):
                log(f"stopped {name} (pid {process.pid})")
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        (self.workdir / STATE_FILE).unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def log_tail(self, name: str, lines: int = 30) -> str:
        try:
            return "\n".join((self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    # -- what happened ----------------------------------------------------------------------

    @property
    def admin_key(self) -> str:
        for service in self.plan.services:
            key = service.env.get("ROLLOUT_PROXY_ADMIN_KEY")
            if key:
                return key
        return ""

    def replicas(self) -> list[LocalService]:
        return [s for s in self.plan.services if s.argv[1:3] == ["-m", "rollout_proxy"] and "serve" in s.argv]

    def balancer(self) -> LocalService:
        return next(s for s in self.plan.services if s.replaces == "nginx")

    def report(self) -> dict[str, Any]:
        """Where everything is, what each replica served, the feed through the balancer, the job's summary."""
        out: dict[str, Any] = {
            "workdir": str(self.workdir),
            "engine": self.plan.engine,
            "balancer": self.balancer().url,
            "admin_key": self.admin_key,
            "services": {
                s.name: {
                    "url": s.url,
                    "pid": self.processes[s.name].pid if s.name in self.processes else None,
                    "log": str(self.logs / f"{s.name}.log"),
                    "instead_of": s.replaces or None,
                }
                for s in self.plan.services
            },
            "job_exit": self.job_exit,
        }
        counters: dict[str, Any] = {}
        for replica in self.replicas():
            try:
                counters[replica.name] = http_json(f"{replica.url}/v1/admin/counters", self.admin_key)
            except (urllib.error.URLError, OSError, ValueError) as exc:
                counters[replica.name] = {"error": str(exc)}
        out["replicas"] = counters
        try:
            feed = http_json(f"{self.balancer().url}/v1/feed?limit=1000", self.admin_key)
            out["feed_groups"] = len(feed["entries"])
        except (urllib.error.URLError, OSError, ValueError) as exc:
            out["feed_groups"] = None
            out["feed_error"] = str(exc)
        summary = self.workdir / "out" / "summary.json"
        out["summary"] = json.loads(summary.read_text()) if summary.exists() else None
        return out


def render(report: dict[str, Any]) -> str:
    lines = [f"topology ({report['engine']} engine), work dir {report['workdir']}"]
    for name, service in report["services"].items():
        where = service["url"] or "(the job)"
        instead = f"  [{STAND_INS[service['instead_of']]}]" if service["instead_of"] else ""
        lines.append(f"  {name:<9} {where:<28} log {service['log']}{instead}")
    lines.append(f"  plugins and trainers use {report['balancer']} (admin key {report['admin_key']})")
    for name, counters in report["replicas"].items():
        if "error" in counters:
            lines.append(f"  {name}: counters unavailable: {counters['error']}")
            continue
        turns, drift = counters.get("turns_total", 0), counters.get("prompt_drift_total", 0)
        lines.append(f"  {name}: {turns:g} turns served, prompt drift {drift:g}")
    lines.append(f"  feed (through the balancer): {report['feed_groups']} group(s)")
    lines.append(f"  job exit status: {report['job_exit']}")
    return "\n".join(lines)


# -- the fake engine as a process ---------------------------------------------------------------


def weather_policy(engine: Any) -> Any:
    """The demo's tool-calling policy for the fake engine: call the weather tool, then state its answer."""
    import re

    def policy(prompt_ids: list[int]) -> str:
        last = engine.decode(prompt_ids).split("<|im_start|>")[-2]
        response = re.search(r"<tool_response>\n(.*?)\n</tool_response>", last, re.DOTALL)
        if response:
            try:
                weather = json.loads(response.group(1))
                return f"It is {weather['condition']} in {weather['location']}, {weather['temperature']} degrees."
            except (ValueError, KeyError, TypeError):
                return "The weather service did not answer."
        place = last.removesuffix("<|im_end|>\n").rstrip("?？!！. ").split()[-1] if last.strip() else "Paris"
        call = json.dumps({"name": "get_current_weather", "arguments": {"location": place}}, ensure_ascii=False)
        return f"<tool_call>\n{call}\n</tool_call>"

    return policy


async def serve_fake_engine(port: int, tokenizer: Path, chat_template: str | None, served_model_name: str) -> None:
    """The fake vLLM engine on ``port`` until SIGTERM/SIGINT (real tokenizer and template, scripted policy)."""
    import asyncio

    from devtools.fake_engine import FakeEngine
    from rollout_proxy.embedded import serve_app

    engine = FakeEngine(
        tokenizer,
        chat_template=chat_template,
        model_name=served_model_name,
    )
    engine.policy = weather_policy(engine)
    runner, url = await serve_app(engine.app(), "127.0.0.1", port)
    print(f"fake vLLM engine on {url} (tokenizer {tokenizer})", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


# -- command line -------------------------------------------------------------------------------


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def up(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rollout-topology-")).resolve()
    if args.engine == "vllm":
        from devtools import engine_env

        log("checking the engine venv and the checkpoints (first run: a few minutes)")
        engine_env.setup()
    local = plan(workdir, engine=args.engine)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)
    with Topology(local) as topology:
        try:
            topology.up()
            code = topology.run_job(timeout=args.job_timeout)
            report = topology.report()
            print(render(report))
            if report["summary"]:
                print("  job summary: " + json.dumps({k: report["summary"].get(k) for k in SUMMARY_KEYS}))
            if args.json_out:
                Path(args.json_out).write_text(json.dumps(report, indent=2, default=str))
            if code != 0:
                log(f"the job failed; its log's tail:\n{topology.log_tail(local.job.name)}")
            if args.keep:
                log("--keep: services stay up until Ctrl-C")
                while True:
                    time.sleep(3600)
            return code
        except KeyboardInterrupt:
            log("interrupted")
            return 130


SUMMARY_KEYS = ("samples_done", "samples_dropped", "groups_published", "trajectories", "turns", "tokens", "drift")


def down(args: argparse.Namespace) -> int:
    """Stop what a ``up`` of ``--workdir`` left running (it keeps a state file while it runs)."""
    state_path = Path(args.workdir) / STATE_FILE
    if not state_path.exists():
        log(f"nothing to stop: no {state_path}")
        return 0
    for name, info in json.loads(state_path.read_text()).items():
        if stop_group(int(info["pid"]), info.get("started")):
            log(f"stopped {name} (pid {info['pid']})")
    state_path.unlink(missing_ok=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.topology", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up_parser = commands.add_parser("up", help="start the topology, run the job, print where everything is, stop")
    up_parser.add_argument("--engine", choices=("vllm", "fake"), default="vllm", help="vllm (default) or fake")
    up_parser.add_argument("--workdir", help="logs, runner output and state (default: a new temp dir)")
    up_parser.add_argument("--keep", action="store_true", help="keep the services up after the job, until Ctrl-C")
    up_parser.add_argument("--json-out", help="also write the report as JSON to this file")
    up_parser.add_argument("--job-timeout", type=float, default=1800.0, help="seconds the job may run (1800)")
    plan_parser = commands.add_parser("plan", help="print what `up` would run, as JSON")
    plan_parser.add_argument("--engine", choices=("vllm", "fake"), default="vllm")
    plan_parser.add_argument("--workdir", default="WORKDIR")
    down_parser = commands.add_parser("down", help="stop what a killed `up` left running")
    down_parser.add_argument("--workdir", required=True)
    fake = commands.add_parser("fake-engine", help="serve the fake vLLM engine (the plan's --engine fake)")
    fake.add_argument("--port", type=int, required=True)
    fake.add_argument("--tokenizer", type=Path, required=True)
    fake.add_argument("--chat-template", type=Path)
    fake.add_argument("--served-model-name", default="smollm2")
    args = parser.parse_args(argv)
    if args.command == "up":
        return up(args)
    if args.command == "plan":
        print(json.dumps(plan(Path(args.workdir), engine=args.engine).to_json(), indent=2))
        return 0
    if args.command == "down":
        return down(args)
    import asyncio

    template = args.chat_template.read_text() if args.chat_template else None
    asyncio.run(serve_fake_engine(args.port, args.tokenizer, template, args.served_model_name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
