# The README's commands. Everything is installed and cached by the scripts themselves.
.PHONY: demo lint test test-unit train-demo

demo:  ## the main job: set up, start vLLM and the proxy, run a demo rollout, stop
	./scripts/demo.sh

train-demo:  ## the demo job with the reference GRPO trainer between its steps (docs/training.md): learns, checks every token
	./scripts/demo.sh --train

lint:  ## the static checks alone: ruff check, ruff format --check, mypy (test runs them first)
	./scripts/lint.sh

test:  ## lint, then every test, the real-vLLM integration suite included
	./scripts/test.sh

test-unit:  ## lint, then the fast tests only (fake engine, real Redis)
	./scripts/test.sh -m "not integration"
