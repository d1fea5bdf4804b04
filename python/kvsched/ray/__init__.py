"""kvsched on Ray Serve: a request router that asks :mod:`kvsched.router`, and a deployment of :class:`kvsched.LLM`.

- :class:`KvschedRequestRouter`: a ``ray.serve.request_router.RequestRouter`` to name in
  ``RequestRouterConfig(request_router_class=KvschedRequestRouter, request_router_kwargs={...})``. It ranks the
  candidate replicas of each request with a :class:`kvsched.router.Router` and tells it where each request went
  and when it finished.
- :class:`LLMServer`: a :class:`kvsched.LLM` behind an async ``__call__``, for ``serve.deployment``; it publishes
  its scheduler's KV cache events, which the request router pulls (:mod:`kvsched.ray.events`), so the router's
  index follows each replica's prefix cache, evictions included.
- ``python -m kvsched.ray.compare``: the shared-prefix comparison of ``docs/routing.md``.

Needs Ray Serve (``pip install 'kvsched[ray]'``); :class:`LLMServer` also needs the torch extra.
"""

from __future__ import annotations

try:
    import ray.serve.request_router  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without ray
    raise ImportError("kvsched.ray needs Ray Serve: pip install 'kvsched[ray]'") from exc

from .request_router import KvschedRequestRouter, RoutedPrompt, prompt_of
from .server import LLMServer

__all__ = ["KvschedRequestRouter", "LLMServer", "RoutedPrompt", "prompt_of"]
