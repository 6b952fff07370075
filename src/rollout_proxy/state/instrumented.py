"""A ``StateStore`` that times each call (``store_seconds{op}``) and gives it a span in the request's trace.

It wraps whichever store the app opened, so the memory and Redis stores stay free of telemetry,
and forwards every attribute: each coroutine method of the store (whatever the protocol grows)
is timed under its own name; ``ping`` (readiness probes), ``close`` and anything that is not a
coroutine method (``request_slot``'s context manager, say) pass through as they are.
"""

from __future__ import annotations

import functools
import inspect
import time
from typing import Any

from rollout_proxy.metrics import Metrics
from rollout_proxy.state.store import StateStore
from rollout_proxy.tracing import span

UNTIMED = frozenset({"ping", "close"})


class InstrumentedStore:
    def __init__(self, inner: StateStore, metrics: Metrics) -> None:
        self.inner = inner
        self._metrics = metrics

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name in UNTIMED or name.startswith("_") or not inspect.iscoroutinefunction(attr):
            return attr
        metrics = self._metrics
        inner = self.inner

        @functools.wraps(attr)
        async def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                with span(f"store {name}", **{"db.operation.name": name}):
                    # looked up per call, so the wrapper stays transparent to a replaced method
                    return await getattr(inner, name)(*args, **kwargs)
            finally:
                metrics.observe("store_seconds", time.perf_counter() - started, op=name)

        setattr(self, name, timed)  # looked up once per method, not per call
        return timed
