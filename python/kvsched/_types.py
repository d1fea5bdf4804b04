"""Small enums shared by both scheduler implementations."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["FinishReason", "RequestStatus", "SchedulerStats", "TenantStats"]


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Values match the Rust core's codes."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    # waiting for its structured-output grammar (vLLM's name); numbered last so the other codes keep their values
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = 6
    # admitted with an asynchronous KV load from the connector, not schedulable until the load is reported over
    WAITING_FOR_REMOTE_KVS = 7
    # finished because its KV load failed (kv_load_failure_policy="fail")
    FINISHED_ERROR = 8
    # a streaming-input session whose input part stopped, waiting for its next part (vLLM's WAITING_FOR_STREAMING_REQ)
    WAITING_FOR_STREAMING_REQ = 9

    @property
    def is_finished(self) -> bool:
        return (
            RequestStatus.FINISHED_STOPPED <= self <= RequestStatus.FINISHED_ABORTED
            or self == RequestStatus.FINISHED_ERROR
        )


class FinishReason(enum.IntEnum):
    """Why a request finished (the codes in ``UpdateResult.finish_reasons``)."""

    STOP = 1  # EOS or a stop token id
    LENGTH = 2  # max_tokens or max_model_len
    ABORT = 3  # abort_requests()
    ERROR = 4  # the KV load failed (kv_load_failure_policy="fail")

    def __str__(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of a scheduler's counters, as ``stats()`` returns it (token counts for the prefix cache)."""

    num_running_reqs: int
    num_waiting_reqs: int  # waiting requests not deferred (vLLM's num_waiting_reqs)
    num_skipped_waiting_reqs: int  # skipped by an admission pass (or added blocked) and not admitted since
    kv_cache_usage: float
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_preempted_queries: int
    prefix_cache_preempted_hits: int
    num_preemptions: int
    num_finished_reqs: int
    step_id: int
    # preemption by swapping (docs/semantics.md, "Preemption modes"); 0 under recompute
    num_swapped_out_reqs: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_reqs: int = 0
    num_swapped_in_blocks: int = 0
    num_swap_fallbacks: int = 0  # victims to swap that were recomputed: the CPU pool was full
    num_recomputed_tokens: int = 0  # tokens lost to preemptions and computed again on resume
    num_free_cpu_blocks: int = 0
    cpu_kv_cache_usage: float = 0.0
    # KV connector: tokens asked of it at admissions beyond the local prefix hit, and tokens it supplied
    connector_prefix_cache_queries: int = 0
    connector_prefix_cache_hits: int = 0
    # encoder inputs (docs/semantics.md, "Encoder inputs"): the share of encoder_cache_size held by entries
    # (referenced or freeable), the entries, inputs and tokens scheduled for computation, inputs found cached
    encoder_cache_usage: float = 0.0
    num_encoder_cache_entries: int = 0
    num_encoder_inputs_computed: int = 0
    num_encoder_tokens_computed: int = 0
    encoder_cache_hits: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(frozen=True)
class TenantStats:
    """One tenant's share, as ``tenant_stats()`` reports it (see docs/semantics.md, "Fair share").

    ``counter`` is the virtual token counter: weighted service received (``fair_prefill_weight`` per prompt token
    computed for the first time plus ``fair_decode_weight`` per output token, each divided by the weight at the
    time), raised by lifts when the tenant became active again."""

    weight: float
    counter: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_waiting_reqs: int
    #: The tenant's running requests (``max_running_per_tenant`` / ``tenant_max_running`` bound it).
    num_running_reqs: int = 0
