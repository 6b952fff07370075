"""rollout-proxy: a token-exact OpenAI-compatible proxy for RL rollouts."""

__version__ = "0.1.0"
