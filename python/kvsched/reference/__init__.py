"""A pure-Python reference scheduler: ``docs/semantics.md`` as executable documentation.

:class:`ReferenceScheduler` has the public API of :class:`kvsched.Scheduler` and the same semantics,
written for clarity rather than speed. The differential tests run both side by side and require identical
observable behaviour at every step, so every rule below has a line in ``docs/semantics.md``. Hash *values*
differ from the Rust core (only hash equality is part of the contract); everything else must match.

The modules mirror ``rust/kvsched-core/src`` file for file, under the same names, so a rule is changed in the
same-named place on both sides:

* ``request.py``: a request's state;
* ``output.py``: ``SchedulerOutput``, ``UpdateResult``, ``ModelInputs``;
* ``free_queue.py``: the free block queue (a doubly linked list in two index arrays);
* ``fair.py``: tenants, their virtual token counters, and the fair waiting queue;
* ``queue.py``: the waiting queues (fcfs, priority);
* ``hashing.py``: chained block hashes;
* ``encoder.py``: the encoder cache;
* ``events.py``: the prefix cache's block events (KV cache events);
* ``convert.py``: argument conversion (the binding's ``convert.rs``);
* ``state.py``: the scheduler's fields and their construction (the ``Scheduler`` struct of ``scheduler.rs``);
* ``block_pool.py``: reference counts, the free queue and the prefix-cache map;
* ``kv_cache_manager.py``: prefix-cache lookup, slot allocation, caching and freeing of a request's blocks;
* ``encoder_sched.py``: encoder inputs in the step loop;
* ``admission.py``: cache-aware admission;
* ``connector.py``: the KV connector's hooks and KV transfers;
* ``swap.py``: preemption by swapping to the CPU pool;
* ``victim.py``: the preemption victim;
* ``step.py``: ``schedule()``;
* ``update.py``: ``update_from_output()`` and drafts;
* ``model_inputs.py``: the runner's flat batch layout;
* ``introspect.py``: the running and waiting ids;
* ``scheduler.py``: intake, aborts, queries, stats, the invariant check, and :class:`ReferenceScheduler`.

Each behaviour module holds a mixin on top of ``state.py``'s ``_SchedulerState``; a module imports only the
modules listed above it, and ``scheduler.py`` composes the mixins.

Data structures (mirroring the Rust core):

* blocks: ``_ref_cnt[b]`` and ``_block_hash[b]`` per block id; block 0 is the null block and never used;
* ``_free``: the free block queue (O(1) pop, remove, append, prepend);
* ``_cached``: ``block_hash -> {block_id: None}`` (an insertion-ordered set; lookups take the first block);
* ``_running``: an ordered list; ``_waiting``: a deque (fcfs), a heap with lazy deletion (priority) or one deque
  per tenant (fair);
* ``_tenants``: name -> tenant (weight, virtual counter, service, waiting count), in registration order.

This package must not import ``kvsched._core``: it is the independent second implementation.
"""

from __future__ import annotations

from .._types import SchedulerStats
from .output import ModelInputs, SchedulerOutput, UpdateResult
from .scheduler import ReferenceScheduler

__all__ = ["ModelInputs", "ReferenceScheduler", "SchedulerOutput", "SchedulerStats", "UpdateResult"]
