"""Steady decoding cohorts: vLLM's per-step ``Request`` counters of many requests moved by one shared offset.

In steady decoding every running request gets the same bookkeeping each step (vLLM's ``_update_after_schedule``:
one more computed token, one more in-flight token, with asynchronous scheduling one more output placeholder;
``update_from_output``: one in-flight token and placeholder fewer). While the scheduler schedules exactly the same
requests one token each, it keeps them in a :class:`Cohort`: each member's class is :class:`CohortRequest`, a
subclass of vLLM's ``Request`` whose ``num_computed_tokens``, ``num_in_flight_tokens`` and
``num_output_placeholders`` read the value stored on the request plus the cohort's counts of the steps scheduled
and applied since the member joined. A step then costs one increment instead of a loop over the requests.

Every reader sees vLLM's value at any time. Any write to one of these fields (by the adapter, vLLM or a test)
first folds the member back into a plain ``Request`` with its current values, and marks the cohort broken, so
the scheduler stops using it; a request that leaves the scheduler is folded back too.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
from vllm.v1.request import Request

from kvsched._core import extend_lists_by_rows

__all__ = ["Cohort", "CohortRequest", "dissolve", "fold", "form"]

_KEY = "_kvsched_cohort"
_consume: Any = deque(maxlen=0).extend  # runs an iterator to its end


class Cohort:
    """The members (a list, in the order of the steps that scheduled them), the steps scheduled and applied
    since they joined, whether applying a step takes an output placeholder back (asynchronous scheduling), the
    fewest placeholders any member held when it joined, whether every member is still in it, the members'
    output and token lists (vLLM never replaces a request's lists, it changes them in place), and which members
    fill a block at which step (``fill_base``, ``fill_fast`` with their token lists, or their ids where the
    core keys blocks with vLLM's hash, in ``fill_fast_tokens``, ``fill_other``: set by the scheduler, see
    ``Scheduler._cohort_fills``)."""

    __slots__ = (
        "all_lists",
        "async_sched",
        "fill_base",
        "fill_fast",
        "fill_fast_tokens",
        "fill_other",
        "intact",
        "min_placeholders",
        "ones",
        "output_lists",
        "reqs",
        "scheduled",
        "updated",
    )

    def __init__(self, reqs: list[Request], async_sched: bool, min_placeholders: int) -> None:
        self.reqs = reqs
        self.async_sched = async_sched
        self.min_placeholders = min_placeholders
        self.scheduled = 0
        self.updated = 0
        self.intact = True
        self.output_lists = [r._output_token_ids for r in reqs]
        self.all_lists = [r._all_token_ids for r in reqs]
        # The core's counts of new tokens (int32, in member order) when each member took exactly one, as bytes.
        self.ones = np.ones(len(reqs), dtype=np.int32).tobytes()
        self.fill_base = 0
        self.fill_fast: list[list[Request]] = []
        self.fill_fast_tokens: list[list[Any]] = []  # per residue: request ids (core keys) or token lists
        self.fill_other: list[list[Request]] = []

    def append_rows(self, rows: list[list[int]]) -> None:
        """Appends each member's sampled tokens (``rows``, in member order) to its output and token lists: in one
        native call when ``rows`` is a list of lists (as vLLM's model runner returns them)."""
        if extend_lists_by_rows(self.output_lists, self.all_lists, rows):
            return
        _consume(map(list.extend, self.output_lists, rows))
        _consume(map(list.extend, self.all_lists, rows))

    def can_apply(self) -> bool:
        """Whether applying a one-token step of every member is the same for each: with asynchronous scheduling
        vLLM takes a placeholder back only from a request that holds one, so every member must hold one."""
        return not self.async_sched or self.min_placeholders + self.scheduled - self.updated >= 1


def fold(request: Any) -> None:
    """Turns a member back into a plain ``Request`` holding its current values; its cohort is broken."""
    d = request.__dict__
    cohort: Cohort = d.pop(_KEY)
    scheduled, updated = cohort.scheduled, cohort.updated
    d["num_computed_tokens"] += scheduled
    d["num_in_flight_tokens"] += scheduled - updated
    if cohort.async_sched:
        d["num_output_placeholders"] += scheduled - updated
    request.__class__ = Request
    cohort.intact = False


def dissolve(cohort: Cohort) -> None:
    """Folds every member still in the cohort back."""
    for request in cohort.reqs:
        if type(request) is CohortRequest and request.__dict__.get(_KEY) is cohort:
            fold(request)
    cohort.reqs = []
    cohort.intact = False


def form(reqs: list[Request], async_sched: bool) -> Cohort | None:
    """A cohort of ``reqs`` (their counters as they are now), or None when one of them is not a plain vLLM
    ``Request`` (a subclass keeps its own class)."""
    if any(type(r) is not Request for r in reqs) or not reqs:
        return None
    min_placeholders = min(r.num_output_placeholders for r in reqs) if async_sched else 0
    cohort = Cohort(reqs, async_sched, min_placeholders)
    for request in reqs:
        request.__dict__[_KEY] = cohort
        request.__class__ = CohortRequest
    return cohort


def _computed(self: Any) -> int:
    d = self.__dict__
    return d["num_computed_tokens"] + d[_KEY].scheduled  # type: ignore[no-any-return]


def _in_flight(self: Any) -> int:
    d = self.__dict__
    cohort = d[_KEY]
    return d["num_in_flight_tokens"] + cohort.scheduled - cohort.updated  # type: ignore[no-any-return]


def _placeholders(self: Any) -> int:
    d = self.__dict__
    cohort = d[_KEY]
    if cohort.async_sched:
        return d["num_output_placeholders"] + cohort.scheduled - cohort.updated  # type: ignore[no-any-return]
    return d["num_output_placeholders"]  # type: ignore[no-any-return]


def _setter(name: str) -> Any:
    def set_field(self: Any, value: Any) -> None:
        fold(self)
        setattr(self, name, value)

    return set_field


class CohortRequest(Request):  # type: ignore[misc]  # vLLM is untyped here
    """A vLLM ``Request`` in a :class:`Cohort` (the scheduler swaps the class in and out; never built)."""

    __slots__ = ()

    num_computed_tokens = property(_computed, _setter("num_computed_tokens"))
    num_in_flight_tokens = property(_in_flight, _setter("num_in_flight_tokens"))
    num_output_placeholders = property(_placeholders, _setter("num_output_placeholders"))
