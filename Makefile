# The README's commands. Everything is installed and cached by the scripts themselves.
.PHONY: demo test test-unit

demo:  ## the main job: set up, start vLLM and the proxy, run a demo rollout, stop
	./scripts/demo.sh

test:  ## every test, the real-vLLM integration suite included
	./scripts/test.sh

test-unit:  ## the fast tests only (fake engine, real Redis)
	./scripts/test.sh -m "not integration"
