"""Async RL cookbook for language models: write a rollout function, the library does the rest."""

__version__ = "0.1.0"
