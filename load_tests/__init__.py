"""Load tests: locust users of a rollout-proxy, and the fake engine as a process (``python -m load_tests``)."""
