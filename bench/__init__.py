"""The benchmarks users run, one module each, run from the repository root with the package installed:

    python -m bench.proxy_overhead     # direct vs rollout-proxy (memory, Redis) vs LiteLLM, side by side
    python -m bench.fleet_faults       # engines killed and restarted under load: failed turns, failover's p99
    python -m bench.streaming_ttft     # time to first token and per-chunk overhead, proxy vs the engine direct
    python -m bench.long_output        # a streamed turn's per-token work at 1k, 8k and 32k output tokens
    python -m bench.storage_footprint  # bytes per stored token and per open session, Redis and memory stores
    python -m bench.workers            # serve --workers 2 against one worker
    python -m bench.resent_input       # a Codex-shaped conversation's CPU per turn, turn 100 against turn 2
    python -m bench.images             # an image's CPU and latency per turn beside the same turns as text only
    python -m bench.memory_soak        # does a proxy give its memory back once sessions pass their TTL?
    python -m bench.policy_update      # sessions on other policies while a LoRA adapter is updated under load
    python -m bench.profile_turn       # where a turn's proxy CPU goes: py-spy's flame graph and top costs
    python -m bench.count_turn         # a turn's instructions or own Python calls, counted: early against late
    python -m bench.pages              # the docs' benchmark pages, from the JSON under docs/bench/

Each writes its JSON under ``--out`` (default ``out/bench/``); what they share is ``bench.harness``. Benchmarks,
not tests: timing goals live here, never in timed asserts (tests/bench/ runs each tiny and imports every module).
"""
