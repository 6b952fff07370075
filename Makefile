# The README's commands. Everything is installed and cached by the scripts themselves.
.PHONY: demo lint test test-unit

demo:  ## the main job: set up, start vLLM and the proxy, run a demo rollout, stop
	./scripts/demo.sh

lint:  ## the static checks alone: ruff check, ruff format --check, mypy (test runs them first)
	./scripts/lint.sh

test:  ## lint, then every test, the real-vLLM integration suite included
	./scripts/test.sh

test-unit:  ## lint, then the fast tests only (fake engine, real Redis)
	./scripts/test.sh -m "not integration"
