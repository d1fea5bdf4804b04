"""A Ray Serve request router backed by :class:`kvsched.router.Router`.

Ray Serve asks a request router, for each request, to rank the candidate replicas (``choose_replicas``); it sends
the request to the first rank with room (a replica at ``max_ongoing_requests`` is passed over) and reports when it
completed (``on_request_completed``). This router answers with every candidate, one per rank, in the order the
kvsched router prefers them, and records the request on the first of them (``Router.assign``) at once; under
Ray's rejection protocol (strict ``max_ongoing_requests``) Ray also confirms the replica (``on_request_routed``)
and a request that landed elsewhere is moved there. Ranking the same request again (Ray retries when no rank had
room) records it anew. Completion finishes it. Replicas that join or leave Ray's set join or leave the index.

What the index knows of each replica's cache: with ``kv_events=True`` (the default) the replicas' own KV cache
events, stores and evictions alike: each :class:`~kvsched.ray.LLMServer` publishes its scheduler's events to a log
of its own and the router pulls every replica's log before it ranks a request (:mod:`kvsched.ray.events`;
concurrent requests share one pull). The router hashes token prompts as the replicas do: give both the same
``block_size``, ``prefix_hash_algo`` and ``prefix_hash_seed`` (when neither gets a seed both use
:func:`~kvsched.ray.events.default_hash_seed` of the deployment). With ``kv_events=False`` (replicas that publish
no events) the router falls back to ``record_routed_prefixes=True``: it counts a routed prompt's blocks as cached
on its replica, as routers that guess from request history do, and does not see evictions. The load is the
router's own count of requests in flight on each replica (sent, not completed).

The prompt of a request is read from its first argument (``prompt_of``): a list of token ids, a dict or object
with ``prompt_token_ids`` (or the ``request_token_ids`` keyword Ray Serve LLM's ingress adds when it tokenizes);
failing those, a text prompt: a str, a ``prompt`` field, or OpenAI-style ``messages``
(Ray Serve LLM's requests). A text prompt is routed by its UTF-8 bytes, ``block_size`` bytes to a block: affinity
then follows text prefixes (what the router recorded), as Ray's ``PrefixCacheAffinityRouter`` does, since no
replica's block hash can be computed from text here. A ``session_id`` (in the request, or Ray's own request
session id) keeps a conversation on one replica with ``sticky_sessions=True``. A request with no prompt the router
can read is ranked as a one-token prompt (by load alone). The request's ``tenant`` (a field, or a key of its
``vllm_xargs`` / ``extra_args``, flat or in their ``"kvsched"`` mapping, where kvsched's vLLM scheduler reads it) and
``cache_salt`` reach the router: with ``isolate_tenant_cache=True`` (set it as the replicas have it) a prompt is
hashed with its tenant as the replicas hash it, so a request is never steered by another tenant's cached prefix.
``prompt_extractor`` (an import path ``"module:function"`` or a callable) replaces ``prompt_of``: it takes the
``PendingRequest`` and returns a :class:`RoutedPrompt`.

``request_router_kwargs`` are the fields of :class:`kvsched.router.RouterConfig`, with ``step_time`` given as a
preset name, a JSON file written by ``kvsched simulate --calibrate``, or a dict of coefficients (kwargs travel as
plain data), ``prompt_extractor`` and ``kv_events``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .._errors import SchedulerError
from ..router import Router, RouterConfig
from ..sim.steptime import StepTimeModel, load_step_time_model
from .events import KvEventSubscriber, default_hash_seed, log_name

__all__ = ["KvschedRequestRouter", "RoutedPrompt", "prompt_of"]

logger = logging.getLogger("kvsched")


@dataclass(frozen=True)
class RoutedPrompt:
    """What the router reads from a request: its prompt token ids (None if it found none; the UTF-8 bytes of a
    text prompt when ``from_text``), session id, tenant and cache salt (None: none given)."""

    token_ids: list[int] | None
    session_id: str | None
    from_text: bool = False
    tenant: str | None = None
    cache_salt: str | None = None


def _field(obj: Any, name: str) -> Any:
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def _text_of(obj: Any) -> str | None:
    if isinstance(obj, str):
        return obj
    prompt = _field(obj, "prompt")
    if isinstance(prompt, str):
        return prompt
    messages = _field(obj, "messages")
    if isinstance(messages, (list, tuple)) and messages:
        parts = []
        for m in messages:
            content = _field(m, "content")
            if isinstance(content, (list, tuple)):  # content parts: keep the text ones
                content = "".join(str(_field(c, "text") or "") for c in content)
            parts.append(f"{_field(m, 'role') or ''}:{content or ''}")
        return "\n".join(parts)
    return None


def _ints(xs: Any) -> list[int] | None:
    if isinstance(xs, (list, tuple)) and xs and all(isinstance(t, int) and not isinstance(t, bool) for t in xs):
        return list(xs)
    return None


def _tenant_of(arg: Any) -> Any:
    """The request's tenant: a ``tenant`` field, else kvsched's key in ``vllm_xargs`` or ``extra_args`` (flat or
    in the ``"kvsched"`` mapping). A value that is not a str is returned as is: the router refuses it."""
    tenant = _field(arg, "tenant")
    if tenant is not None:
        return tenant
    for name in ("vllm_xargs", "extra_args"):
        extra = _field(arg, name)
        if not isinstance(extra, dict):
            continue
        tenant = extra.get("tenant")
        nested = extra.get("kvsched")
        if tenant is None and isinstance(nested, dict):
            tenant = nested.get("tenant")
        if tenant is not None:
            return tenant
    return None


def prompt_of(pending_request: PendingRequest | None) -> RoutedPrompt:
    """The prompt and session id of a pending Serve request (see the module docstring)."""
    if pending_request is None:
        return RoutedPrompt(None, None)
    args = [*pending_request.args, *pending_request.kwargs.values()]
    arg = args[0] if args else None
    tokens = (
        _ints(pending_request.kwargs.get("request_token_ids"))  # Ray Serve LLM's ingress, when it tokenizes
        or _ints(arg)
        or _ints(_field(arg, "prompt_token_ids"))
        or _ints(_field(arg, "prompt"))
    )
    from_text = False
    if tokens is None:
        text = _text_of(arg)
        if text:
            tokens, from_text = list(text.encode("utf-8")), True
    fields = not isinstance(arg, (str, list, tuple))
    s = _field(arg, "session_id") if fields else None
    if not (isinstance(s, str) and s):
        s = getattr(pending_request.metadata, "session_id", "")
    tenant = _tenant_of(arg) if fields else None
    salt = _field(arg, "cache_salt") if fields else None
    return RoutedPrompt(
        tokens,
        s if isinstance(s, str) and s else None,
        from_text,
        tenant=tenant,
        cache_salt=salt if isinstance(salt, str) and salt else None,
    )


def _config(kwargs: dict[str, Any], default_seed: str | None) -> RouterConfig:
    fields = dict(kwargs)
    fields.pop("prompt_extractor", None)
    kv_events = fields.pop("kv_events", True)
    fields.setdefault("record_routed_prefixes", not kv_events)
    if kv_events and default_seed is not None:
        fields.setdefault("prefix_hash_seed", default_seed)
    step_time = fields.get("step_time")
    if isinstance(step_time, str):
        fields["step_time"] = load_step_time_model(step_time)
    elif isinstance(step_time, dict):
        fields["step_time"] = StepTimeModel.from_dict(step_time)
    return RouterConfig(**fields)


class KvschedRequestRouter(RequestRouter):  # type: ignore[misc,unused-ignore]
    """Ranks replicas with :class:`kvsched.router.Router` (see the module docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        deployment = getattr(self, "_deployment_id", None)
        seed = None if deployment is None else default_hash_seed(deployment.app_name, deployment.name)
        self.kv_router = Router(_config(kwargs, seed))
        self._kv_events = KvEventSubscriber(self.kv_router) if kwargs.get("kv_events", True) else None
        extractor = kwargs.get("prompt_extractor", prompt_of)
        if isinstance(extractor, str):
            module, _, name = extractor.partition(":")
            extractor = getattr(importlib.import_module(module), name)
        self._prompt_of: Callable[[PendingRequest | None], RoutedPrompt] = extractor
        self._known: set[str] = set()
        self._ids: dict[str, ReplicaID] = {}  # the known replicas' ids, by name
        self._where: dict[str, str] = {}  # request -> the replica it is recorded on

    def _router(self) -> Router:
        # Ray calls initialize_state right after building the router; a bare instance gets the defaults.
        if not hasattr(self, "kv_router"):
            self.initialize_state()
        return self.kv_router

    def _sync(self, replicas: dict[str, ReplicaID]) -> None:
        """Makes the router's replicas those of ``replicas`` (by name: the replica's unique id)."""
        router = self._router()
        for gone in sorted(self._known - set(replicas)):
            moved = router.remove_replica(gone)
            if self._kv_events is not None:
                self._kv_events.remove(gone)
            for req_id in moved:
                self._where.pop(req_id, None)
            if moved:
                logger.info("replica %s left with %d request(s) in flight", gone, len(moved))
        for new in sorted(set(replicas) - self._known):
            router.add_replica(new)
            if self._kv_events is not None:
                self._kv_events.add(new, log_name(replicas[new].to_full_id_str()))
        self._known = set(replicas)
        self._ids = dict(replicas)

    def _sync_adding(self, replicas: dict[str, ReplicaID]) -> None:
        self._sync({**self._ids, **replicas})

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._sync({r.replica_id.unique_id: r.replica_id for r in replicas})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._sync({k: v for k, v in self._ids.items() if k != replica_id.unique_id})

    async def pull_kv_events(self) -> None:
        """Applies the replicas' KV cache events published since the last pull (nothing with
        ``kv_events=False``). :meth:`choose_replicas` calls it before each ranking."""
        self._router()
        if self._kv_events is None:
            return
        try:
            await self._kv_events.pull()
        except Exception as exc:  # a routing decision never fails for want of fresh events
            logger.warning("kvsched router could not pull KV events: %s", exc)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        self._sync_adding({name: r.replica_id for name, r in by_name.items()})
        if not by_name:
            return []
        await self.pull_kv_events()
        by_name = {name: r for name, r in by_name.items() if name in self._known} or by_name  # (left meanwhile)
        self._sync_adding({name: r.replica_id for name, r in by_name.items()})
        prompt = self._prompt_of(pending_request)
        try:
            ranked = self._rank(prompt, sorted(by_name))
            if pending_request is not None:
                self._record(pending_request.metadata.internal_request_id, ranked[0], prompt)
        except SchedulerError as exc:
            logger.warning("kvsched router could not rank replicas (%s); using Ray's order", exc)
            ranked = list(by_name)
        return [[by_name[name]] for name in ranked if name in by_name]

    def _rank(self, prompt: RoutedPrompt, candidates: list[str]) -> list[str]:
        router = self._router()
        if prompt.token_ids is None:
            return router.rank(block_hashes=[], num_prompt_tokens=1, candidates=candidates)
        return router.rank(
            prompt.token_ids,
            session_id=prompt.session_id,
            candidates=candidates,
            tenant=prompt.tenant,
            cache_salt=prompt.cache_salt,
        )

    def _record(self, req_id: str, replica: str, prompt: RoutedPrompt) -> None:
        """Keeps ``req_id`` in flight on ``replica`` (moving it if it was recorded elsewhere)."""
        router = self._router()
        if self._where.get(req_id) == replica:
            return
        if req_id in self._where:
            router.finish(req_id)
            del self._where[req_id]
        if prompt.token_ids is None:
            router.assign(req_id, replica, block_hashes=[], num_prompt_tokens=1)
        else:
            router.assign(
                req_id,
                replica,
                prompt.token_ids,
                session_id=prompt.session_id,
                tenant=prompt.tenant,
                cache_salt=prompt.cache_salt,
            )
        self._where[req_id] = replica

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        req_id = pending_request.metadata.internal_request_id
        try:
            if replica_id.unique_id not in self._known:
                self._sync_adding({replica_id.unique_id: replica_id})
            self._record(req_id, replica_id.unique_id, self._prompt_of(pending_request))
        except SchedulerError as exc:
            logger.warning("kvsched router could not record request %s: %s", req_id, exc)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._where.pop(internal_request_id, None) is None:
            return
        with contextlib.suppress(SchedulerError):  # moved off a replica that left
            self._router().finish(internal_request_id)
