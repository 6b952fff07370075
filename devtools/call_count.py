"""The Python calls a package's code makes, counted (``sys.setprofile``): work measured without a clock.

A call counts once, and so does each step of a generator (a walk over a list is as many steps as items); a
coroutine resumed does not (how often one waits depends on when the bytes arrive, not on the work). What
``tests/proxy/test_turn_work.py`` holds a turn to, and what ``bench.count_turn`` reports.

As a script, ``python devtools/call_count.py [PYTHON] -m MODULE ARGS`` runs MODULE counting the calls into its
package: SIGUSR1 starts the count, SIGUSR2 appends it to the file ``$COUNT_OUT`` names. Stdlib only, so it
counts another checkout's package (the one ``PYTHONPATH`` imports) the same way.
"""

from __future__ import annotations

import dis
import functools
import importlib.util
import inspect
import os
import runpy
import signal
import sys
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

_ASYNC = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


@functools.cache
def _entry(code: CodeType) -> int:
    """Where a call of ``code`` starts (its first RESUME): a coroutine resumed is further on."""
    return next(op.offset for op in dis.get_instructions(code) if op.opname == "RESUME")


class CallCounter:
    """Calls into the functions defined under ``package`` (a directory), while ``start``-ed, in this thread."""

    def __init__(self, package: Path) -> None:
        self.prefix = str(package)
        self.count = 0

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(self.prefix):
            return
        if not code.co_flags & _ASYNC or frame.f_lasti <= _entry(code):
            self.count += 1

    def start(self) -> None:
        self.count = 0
        sys.setprofile(self._profile)

    def stop(self) -> int:
        sys.setprofile(None)
        return self.count


def main(argv: list[str]) -> None:
    at = argv.index("-m")
    name, args = argv[at + 1], argv[at + 2 :]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise SystemExit(f"no module {name!r} to run")
    counter, out = CallCounter(Path(spec.origin).parent), Path(os.environ["COUNT_OUT"])

    def write(*_: object) -> None:
        count = counter.stop()
        with out.open("a") as file:
            file.write(f"{count}\n")

    signal.signal(signal.SIGUSR1, lambda *_: counter.start())
    signal.signal(signal.SIGUSR2, write)
    sys.argv = [name, *args]
    runpy.run_module(name, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
