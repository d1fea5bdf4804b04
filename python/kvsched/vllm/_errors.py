"""The adapter's own exception type, in a module of its own so that every adapter module can raise it."""

from __future__ import annotations

from kvsched._errors import InvalidConfigError

__all__ = ["UnsupportedFeatureError"]


class UnsupportedFeatureError(InvalidConfigError, NotImplementedError):
    """A vLLM feature that ``kvsched.vllm.Scheduler`` does not support (yet)."""
