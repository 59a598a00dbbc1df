"""The OpenAI-compatible HTTP API of the api process (jax-free)."""
