"""One request's scheduling state. Mirrors ``rust/kvsched-core/src/request.rs``.

The reference keeps requests as plain objects in a dict by id (the core keeps them in a slab of slots); the
scheduler's parts read and change their attributes directly.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from .._types import RequestStatus


class _Request:
    """One request's state. Plain attributes; the scheduler mutates them."""

    __slots__ = (
        "add_seq",
        "arrival_step",
        "arrival_time",
        "block_hashes",
        "block_ids",
        "cache_salt",
        "chunk_step",
        "cpu_blocks",
        "cross_attention_tokens",
        "deadline",
        "decode_ready_step",
        "deferred",
        "drafts",
        "drop_stale_output",
        "effective_priority",
        "encoder_held",
        "encoder_inputs",
        "eos_token_id",
        "grammar_ready",
        "group_block_ids",
        "group_num_cached",
        "ignore_eos",
        "inflight_prefill",
        "input_closed",
        "input_queue",
        "is_prefill_chunk",
        "kv_load_done",
        "kv_load_failed",
        "kv_skip_step",
        "last_sched_seq",
        "lora_name",
        "mamba_allocated",
        "mamba_appended",
        "mamba_checkpoint",
        "max_len_bound",
        "max_tokens",
        "min_tokens",
        "num_cached_blocks",
        "num_cached_tokens",
        "num_charged_prompt_tokens",
        "num_computed_tokens",
        "num_in_flight_tokens",
        "num_lost_tokens",
        "num_output_placeholders",
        "num_preemptions",
        "num_prompt_tokens",
        "num_stale_output_tokens",
        "num_swapped_tokens",
        "order_key",
        "parked",
        "partial_hits",
        "priority",
        "queue_seq",
        "replay_restores",
        "replay_start",
        "req_id",
        "requested_max_tokens",
        "resumable",
        "session_id",
        "shared_prefix_boundary",
        "sjf_residual",
        "skip_reading_prefix_cache",
        "status",
        "stop_token_ids",
        "tenant",
        "token_ids",
        "ttft_slo_s",
        "unit_hashes",
        "wait_seq",
        "wait_since",
    )
    # set from add_request's (validated) arguments:
    max_tokens: int  # effective: min(max_tokens, max_model_len - len(prompt))
    requested_max_tokens: int  # as given (the effective one if none): async's "last token in flight" test
    min_tokens: int
    eos_token_id: int | None
    ignore_eos: bool
    stop_token_ids: frozenset[int]
    priority: int
    arrival_time: float
    cache_salt: str | None
    lora_name: str | None
    tenant: str
    skip_reading_prefix_cache: bool  # no prefix-cache hits, not in the prefix-cache stats
    arrival_step: int  # schedule() calls before the request was added
    encoder_inputs: list[tuple[int, int, int]]  # (start, num_tokens, hash), sorted, inside the prompt
    effective_priority: int  # priority, or priority * priority_aging_steps + arrival_step (see queue.py)
    session_id: str | None  # the conversation it continues (session affinity, admission.py)
    ttft_slo_s: float | None  # its TTFT target (policy slo)
    order_key: int  # its tier: smaller first under every policy (0 when not given)
    deadline: float  # slo: arrival_time + (ttft_slo_s or default_ttft_slo_s), inf without a target

    def __init__(self, req_id: str, prompt: list[int], **params: Any) -> None:
        self.req_id = req_id
        self.token_ids = prompt  # prompt then outputs
        self.num_prompt_tokens = len(prompt)
        self.resumable = False  # a streaming-input session (stream.py)
        self.cross_attention_tokens = 0  # encoder output tokens its cross-attention group holds blocks for
        for name, value in params.items():
            setattr(self, name, value)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.drafts: list[int] = []
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        # With prefix hits inside a block (SchedulerConfig.partial_hit_unit): every full unit's hash.
        self.unit_hashes: list[bytes] = []
        self.num_cached_blocks = 0  # leading blocks of block_ids already entered into the cache map
        # With several KV cache groups: groups 1..'s tables (group 0's is block_ids) and cached-block counts.
        self.group_block_ids: list[list[int]] = []
        self.group_num_cached: list[int] = []
        # Align-mode Mamba groups (mamba_align), by group: the groups allocated since the last free, the entries
        # the last allocation appended.
        self.mamba_allocated: set[int] = set()
        self.mamba_appended: dict[int, int] = {}
        # ... and with prefill checkpoints, the checkpoint the last allocation reserved a block for, as (position,
        # table index) (vLLM's MambaManager._checkpoints).
        self.mamba_checkpoint: dict[int, tuple[int, int]] = {}
        # With prefix hits inside a block, by group: the block a hit (or, in a Mamba group, its own cached prompt
        # tail) ends inside, as (table index, block), until the next allocation copies it (vLLM's _partial_hit_reqs).
        self.partial_hits: dict[int, tuple[int, int]] = {}
        # Align-mode Mamba groups with prefix caching: the longest single-set hit of the last lookup when the
        # combined hit is shorter, in tokens (vLLM's shared_prefix_boundary); 0 otherwise.
        self.shared_prefix_boundary = 0
        # Bounded prefix replay: where the replay of the request's last prefix hit starts (vLLM's replay_start; 0 until
        # set), and whether its asynchronous KV load restores every replay group (asked at the load's admission).
        self.replay_start = 0
        self.replay_restores = False
        self.num_preemptions = 0
        self.num_cached_tokens = -1  # prefix-hit tokens at first admission
        self.queue_seq = -1  # identifies this request's live entry in the priority heap
        self.num_charged_prompt_tokens = 0  # prompt tokens charged to the tenant (recompute is free)
        # in-flight bookkeeping (vLLM's Request fields of the same names)
        self.num_output_placeholders = 0  # async: tokens in flight to be sampled
        self.num_in_flight_tokens = 0  # tokens of scheduled steps not yet applied
        self.num_stale_output_tokens = 0  # in-flight tokens from before a preemption
        self.drop_stale_output = False
        self.deferred = False  # skipped by an admission pass (or added blocked), not admitted since
        self.grammar_ready = False
        self.is_prefill_chunk = False  # its last scheduled step stopped short of its known tokens
        # preemption by swapping
        self.cpu_blocks: list[int] = []  # CPU blocks holding its KV while swapped out
        self.num_swapped_tokens = 0  # tokens whose KV they hold
        self.num_lost_tokens = 0  # computed at its last preemption and not yet recovered
        self.add_seq = 0  # order of add_request calls: blocked requests that become ready are queued in it
        self.parked = False  # in no queue, not running: blocked (grammar, KV load) or ready since the last step
        self.kv_load_done = False  # its asynchronous KV load was reported over
        self.kv_load_failed = False  # ... and failed: num_computed_tokens was cut back to the valid prefix
        self.kv_skip_step = -1  # invalid blocks rolled it back: its output of this step is dropped
        self.last_sched_seq = 0  # the last non-empty step that scheduled it (defer_block_free's fence)
        self.encoder_held = [False] * len(self.encoder_inputs)  # holds a reference to input i's cache entry
        # vLLM 0.33's in-flight prefill set: an async load, or an admission with prompt left, until a step leaves
        # nothing left (or a preemption); read with reserve_inflight_prefills
        self.inflight_prefill = False
        # the step that last scheduled tokens of it and its computed tokens before them (the in-flight reservation
        # reads the count before the step, vLLM's num_computed_tokens while it schedules); step -1: none
        self.chunk_step = (-1, 0)
        # decode_stagger: the first schedule() call (step id) in which it may be scheduled again after a step that
        # was not a prefill chunk (vLLM's next_decode_eligible_step; kept across preemption)
        self.decode_ready_step = 0
        self.sjf_residual = 0  # sjf: the residual it is queued by (prompt blocks beyond its prefix hit)
        self.wait_seq = 0  # aging: nonzero while in `waiting` (its entry in the aging FIFO)
        self.wait_since = 0  # aging: the first step it waits in
        # streaming input (stream.py): parts given while it ran (None: the input is over), finish_input called,
        # the most tokens it can reach with the parts given so far
        self.input_queue: deque[Any] = deque()
        self.input_closed = False
        self.max_len_bound = len(prompt) + self.max_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
