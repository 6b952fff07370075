"""Developer tooling: provision and run a real vLLM (CPU) engine for integration tests.

Stdlib-only at import time: it runs from the project venv, which has no torch. The heavy
parts live in a separate engine venv under the cache dir (see `paths`).
"""
