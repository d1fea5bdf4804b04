"""``kvsched.vllm.Scheduler.kv_cache_manager``: a read-only view of the core's KV cache under vLLM's names.

vLLM's scheduler owns a ``KVCacheManager`` (``vllm/v1/core/kv_cache_manager.py``) that its engine core, its
tests and tools read: a request's blocks, the block pool's free count and usage, which blocks a prefix lookup
would hit, each block's reference count, the prefix-cache counters. In kvsched the core owns the blocks, so
this module answers those reads from the core, with the attribute names vLLM uses, one block table per KV cache
group (full attention or a sliding window) in vLLM's group order. Every read asks the core at that moment; nothing
is copied ahead.

What is not here is what changes the cache (``allocate_slots``, ``free``, ``cache_blocks``, ``reset_prefix_cache``,
``take_events``, ...): the core does that inside ``schedule()`` and ``update_from_output()``. Reading such a name,
or setting any attribute, raises ``AttributeError`` saying so. Block hashes are not shown: the core keys its
prefix cache by its own hashes of the tokens, not by vLLM's ``BlockHashWithGroupId``; ``get_cached_block`` answers
only whether a block with one of a request's vLLM hashes is cached (``_aux.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, overload

from vllm.v1.core.kv_cache_manager import KVCacheBlocks

if TYPE_CHECKING:
    from vllm.v1.metrics.stats import PrefixCacheStats
    from vllm.v1.request import Request

    from kvsched.config import SchedulerConfig
    from kvsched.scheduler import Scheduler as CoreScheduler

    from ._pins import BlockPins

__all__ = ["BlockPoolView", "BlockView", "KVCacheManagerView", "PinningBlockPoolView", "lora_key"]


def lora_key(lora_request: Any) -> str | None:
    """The adapter's identity in the core: vLLM keys prefix-cache blocks by the LoRA's name and path (and counts
    ``max_loras`` by its id, which names map to one to one), so the core gets both."""
    if lora_request is None:
        return None
    return f"{lora_request.lora_name}\x00{lora_request.lora_path}"


class Scheduler(Protocol):
    """What the view reads of the :class:`kvsched.vllm.Scheduler` it shows (structural, so this module does not
    import the scheduler's)."""

    requests: dict[str, Request]
    block_size: int
    max_model_len: int
    log_stats: bool
    kv_config: SchedulerConfig
    kv_cache_config: Any
    hash_block_size: int
    _prefix_cache_stats: PrefixCacheStats | None
    _aux: Any
    _pins: BlockPins | None

    @property
    def core(self) -> CoreScheduler: ...


# vLLM KVCacheManager/BlockPool/coordinator members that change the cache: named in the error a read raises.
_MUTATORS = frozenset(
    {
        "allocate_slots",
        "free",
        "cache_blocks",
        "reset_prefix_cache",
        "take_events",
        "make_prefix_cache_stats",
        "record_prefix_cache_stats",
        "remove_skipped_blocks",
        "pop_blocks_for_free",
        "evict_blocks",
        "free_blocks",
        "get_new_blocks",
        "touch",
        "truncate_computed_blocks",
        "take_new_block_ids",
        "record_blocks_for_zeroing",
        "take_kv_cache_block_copies",
        "take_boundary_state_offloads",
        "finalize_partial_tail_offloads",
        "new_step_starts",
        "get_computed_blocks_for_connector",
    }
)


class _ReadOnly:
    """Attributes are fixed at construction; vLLM's mutating members are named in the error a read raises."""

    __slots__ = ()

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(
            f"{type(self).__name__} is a read-only view of kvsched's KV cache: {name!r} cannot be set "
            "(kvsched's core allocates, caches and frees the blocks itself)"
        )

    def __delattr__(self, name: str) -> NoReturn:
        self.__setattr__(name, None)

    def __getattr__(self, name: str) -> NoReturn:
        if name in _MUTATORS:
            raise AttributeError(
                f"{type(self).__name__} is a read-only view of kvsched's KV cache: it has no {name!r} "
                "(kvsched's core allocates, caches and frees the blocks itself)"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class BlockView(_ReadOnly):
    """One KV block (vLLM's ``KVCacheBlock``): its id, whether it is the null block, and its current reference
    count, read from the core at each access; with a connector that binds the block pool, also its
    ``block_hash`` (vLLM's hash with group id, None when the block is not cached) and ``block_hash_num_tokens``."""

    __slots__ = ("_core", "_pins", "block_id")

    _core: Any
    _pins: BlockPins | None
    block_id: int

    def __init__(self, core: Any, block_id: int, pins: BlockPins | None = None) -> None:
        object.__setattr__(self, "_core", core)
        object.__setattr__(self, "_pins", pins)
        object.__setattr__(self, "block_id", block_id)

    @property
    def ref_cnt(self) -> int:
        if self._pins is not None:
            self._pins.flush()
        return int(self._core.get_block_ref_cnt(self.block_id))

    def _hash(self) -> tuple[Any, int] | None:
        pins = self._pins
        if pins is None:
            raise AttributeError(
                "BlockView shows block hashes only to KV connectors that bind the block pool (the core keys its "
                "prefix cache by its own hashes)"
            )
        return None if self.block_id == 0 else pins.block_hash(self.block_id)

    @property
    def block_hash(self) -> Any:
        found = self._hash()
        return None if found is None else found[0]

    @property
    def block_hash_num_tokens(self) -> int | None:
        found = self._hash()
        return None if found is None else found[1]

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlockView) and other._core is self._core and other.block_id == self.block_id

    def __hash__(self) -> int:
        return hash((id(self._core), self.block_id))

    def __repr__(self) -> str:
        return f"BlockView(block_id={self.block_id}, ref_cnt={self.ref_cnt})"


class _Blocks(Sequence[BlockView]):
    """Every block of the pool by id (vLLM's ``BlockPool.blocks``); block views are made on access."""

    __slots__ = ("_core", "_num_blocks", "_pins")

    def __init__(self, core: Any, num_blocks: int, pins: BlockPins | None = None) -> None:
        self._core = core
        self._num_blocks = num_blocks
        self._pins = pins

    def __len__(self) -> int:
        return self._num_blocks

    @overload
    def __getitem__(self, index: int) -> BlockView: ...
    @overload
    def __getitem__(self, index: slice) -> list[BlockView]: ...
    def __getitem__(self, index: int | slice) -> BlockView | list[BlockView]:
        if isinstance(index, slice):
            return [BlockView(self._core, i, self._pins) for i in range(*index.indices(self._num_blocks))]
        i = index + self._num_blocks if index < 0 else index
        if not 0 <= i < self._num_blocks:
            raise IndexError(f"block index {index} out of range for a pool of {self._num_blocks} blocks")
        return BlockView(self._core, i, self._pins)

    def __iter__(self) -> Iterator[BlockView]:
        core, pins = self._core, self._pins
        return (BlockView(core, i, pins) for i in range(self._num_blocks))


class _FreeBlockQueue(_ReadOnly):
    """vLLM's ``FreeKVCacheBlockQueue``: its count (free blocks, cached ones that can still be hit included) and
    ``iter_blocks_after(cursor)``."""

    __slots__ = ("_core", "_pins")

    _core: Any
    _pins: BlockPins | None

    def __init__(self, core: Any, pins: BlockPins | None = None) -> None:
        object.__setattr__(self, "_core", core)
        object.__setattr__(self, "_pins", pins)

    @property
    def num_free_blocks(self) -> int:
        if self._pins is not None:
            self._pins.flush()
        return int(self._core.num_free_blocks)

    def iter_blocks_after(self, cursor: BlockView | None) -> Iterator[BlockView]:
        """The free blocks in eviction order after ``cursor`` (a free block; None: from the head), as the queue
        stands when called."""
        if self._pins is not None:
            self._pins.flush()
        order: list[int] = self._core.free_block_ids().tolist()
        start = 0 if cursor is None else order.index(cursor.block_id) + 1
        core, pins = self._core, self._pins
        return (BlockView(core, b, pins) for b in order[start:])


class BlockPoolView(_ReadOnly):
    """vLLM's ``BlockPool``, read-only: ``num_gpu_blocks`` (the null block 0 included), ``hash_block_size``,
    ``get_num_free_blocks()``, ``get_usage()``, ``blocks``, ``null_block``, ``free_block_queue.num_free_blocks``,
    ``get_cached_block(block_hash, kv_cache_group_ids)``."""

    __slots__ = (
        "_cached",
        "_core",
        "blocks",
        "enable_caching",
        "free_block_queue",
        "hash_block_size",
        "null_block",
        "num_gpu_blocks",
    )

    _core: Any
    _cached: Callable[[Any], bool] | None
    num_gpu_blocks: int
    hash_block_size: int
    enable_caching: bool
    blocks: Sequence[BlockView]
    null_block: BlockView
    free_block_queue: _FreeBlockQueue

    def __init__(
        self,
        core: Any,
        num_blocks: int,
        enable_caching: bool,
        hash_block_size: int = 0,
        cached: Callable[[Any], bool] | None = None,
        pins: BlockPins | None = None,
    ) -> None:
        init = object.__setattr__
        init(self, "_core", core)
        init(self, "_cached", cached)
        init(self, "num_gpu_blocks", num_blocks)
        init(self, "hash_block_size", hash_block_size)
        init(self, "enable_caching", enable_caching)
        init(self, "blocks", _Blocks(core, num_blocks, pins))
        init(self, "null_block", BlockView(core, 0, pins))
        init(self, "free_block_queue", _FreeBlockQueue(core, pins))

    def get_cached_block(self, block_hash: Any, kv_cache_group_ids: Sequence[int]) -> list[BlockView] | None:
        """Whether a block with vLLM's hash ``block_hash`` (one of a request's ``block_hashes``) is in the prefix
        cache now: None if not, else one entry per group asked. Only that is answered: the entries are the
        pool's ``null_block``, not the cached blocks (the core keys its cache by its own hashes)."""
        if not self.enable_caching or self._cached is None or not self._cached(block_hash):
            return None
        return [self.null_block for _ in kv_cache_group_ids]

    def get_num_free_blocks(self) -> int:
        return int(self._core.num_free_blocks)

    def get_usage(self) -> float:
        return float(self._core.stats().kv_cache_usage)


class PinningBlockPoolView(BlockPoolView):
    """The block pool of a scheduler whose KV connector binds it (``bind_gpu_block_pool``): the read-only view,
    plus vLLM's ``touch`` and ``free_blocks`` as block pins in the core (``kvsched.vllm._pins``), block hashes on
    ``blocks``, ``get_cached_block`` answering with the cached block itself, and ``cached_block_hashes_by_block``
    (empty, as vLLM's with one hash block per block)."""

    __slots__ = ("_pins", "cached_block_hashes_by_block")

    _pins: BlockPins
    cached_block_hashes_by_block: Mapping[int, set[Any]]

    def __init__(self, core: Any, num_blocks: int, enable_caching: bool, hash_block_size: int, pins: BlockPins):
        from ._pins import NoSecondaryHashes

        super().__init__(core, num_blocks, enable_caching, hash_block_size, None, pins)
        object.__setattr__(self, "_pins", pins)
        object.__setattr__(self, "cached_block_hashes_by_block", NoSecondaryHashes())

    def touch(self, blocks: Iterable[Any]) -> None:
        """A reference on each block (null blocks skipped): it is not evicted or reused until given back."""
        from ._pins import block_ids

        self._pins.pin(block_ids(blocks))

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        """Gives back one reference of each block (null blocks skipped), first evicted first."""
        from ._pins import block_ids

        self._pins.unpin(block_ids(ordered_blocks))

    def get_cached_block(self, block_hash: Any, kv_cache_group_ids: Sequence[int]) -> list[BlockView] | None:
        """The block cached under vLLM's hash ``block_hash`` (a request's block hash, as in its ``block_hashes``)
        in each KV cache group asked, or None if one of them has none (as vLLM's)."""
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        if not self.enable_caching:
            return None
        if self._pins.in_local_hit(block_hash):
            # A connector's lookup asks for the request's local hit from inside the core's call (kvsched.vllm._pins).
            return [self.null_block for _ in kv_cache_group_ids]
        found: list[BlockView] = []
        for group in kv_cache_group_ids:
            block = self._pins.cached_block_id(make_block_hash_with_group_id(block_hash, group))
            if block is None:
                return None
            found.append(BlockView(self._core, block, self._pins))
        return found

    def get_num_free_blocks(self) -> int:
        self._pins.flush()
        return int(self._core.num_free_blocks)


class _ReqToBlocks(Mapping[str, list[BlockView]]):
    """Request id -> its blocks, for the requests holding blocks now (vLLM's ``req_to_blocks``); live. A sliding
    window's null blocks are the pool's one ``null_block`` object, as in vLLM."""

    __slots__ = ("_group", "_null_block", "_sched")

    def __init__(self, sched: Scheduler, null_block: BlockView, group: int) -> None:
        self._sched = sched
        self._null_block = null_block
        self._group = group

    def _block_ids(self, req_id: str) -> list[int]:
        if req_id not in self._sched.requests:
            return []
        ids: list[int] = self._sched.core.get_block_ids(req_id, self._group).tolist()
        return ids

    def __getitem__(self, req_id: str) -> list[BlockView]:
        ids = self._block_ids(req_id)
        if not ids:
            raise KeyError(req_id)
        core, null = self._sched.core, self._null_block
        return [null if b == 0 else BlockView(core, b) for b in ids]

    def __contains__(self, req_id: object) -> bool:
        return isinstance(req_id, str) and bool(self._block_ids(req_id))

    def __iter__(self) -> Iterator[str]:
        return iter([r for r in list(self._sched.requests) if self._block_ids(r)])

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _NumCachedBlock(Mapping[str, int]):
    """Request id -> how many of its leading blocks are in the prefix cache (vLLM's ``num_cached_block``), for
    every request holding blocks (vLLM adds a holder's entry once it hits or caches a block and reads the map
    with ``.get(req_id, 0)``); empty without prefix caching, as in vLLM."""

    __slots__ = ("_holding", "_sched")

    def __init__(self, sched: Scheduler, holding: _ReqToBlocks) -> None:
        self._sched = sched
        self._holding = holding

    def __getitem__(self, req_id: str) -> int:
        if not self._sched.kv_config.enable_prefix_caching or req_id not in self._holding:
            raise KeyError(req_id)
        return int(self._sched.core.get_num_cached_blocks(req_id))

    def __iter__(self) -> Iterator[str]:
        if not self._sched.kv_config.enable_prefix_caching:
            return iter(())
        return iter(self._holding)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _SingleTypeManager(_ReadOnly):
    """vLLM's ``SingleTypeKVCacheManager`` of one KV cache group (full attention, a sliding window, cross
    attention or Mamba); ``block_size`` is the group's own."""

    __slots__ = (
        "_null_block",
        "block_pool",
        "block_size",
        "kv_cache_group_id",
        "kv_cache_spec",
        "num_cached_block",
        "req_to_blocks",
    )

    block_size: int
    kv_cache_spec: Any
    kv_cache_group_id: int
    block_pool: BlockPoolView
    _null_block: BlockView
    req_to_blocks: Mapping[str, list[BlockView]]
    num_cached_block: Mapping[str, int]

    def __init__(self, sched: Scheduler, kv_cache_spec: Any, block_pool: BlockPoolView, group: int) -> None:
        init = object.__setattr__
        init(self, "block_size", int(kv_cache_spec.block_size))
        init(self, "kv_cache_spec", kv_cache_spec)
        init(self, "kv_cache_group_id", group)
        init(self, "block_pool", block_pool)
        init(self, "_null_block", block_pool.null_block)
        holding = _ReqToBlocks(sched, block_pool.null_block, group)
        init(self, "req_to_blocks", holding)
        init(self, "num_cached_block", _NumCachedBlock(sched, holding))


class _CrossAttentionManager(_SingleTypeManager):
    """vLLM's ``CrossAttentionManager`` of a cross-attention group (encoder-decoder models): the encoder output's
    blocks of each request. vLLM's coordinator and tests tell the group kind by ``isinstance`` against that class,
    so this view answers such a check as vLLM's manager would (its ``__class__``); its type stays the view's."""

    __slots__ = ()

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        from vllm.v1.core.single_type_kv_cache_manager import CrossAttentionManager

        cls: type = CrossAttentionManager
        return cls


class _MambaManager(_SingleTypeManager):
    """vLLM's ``MambaManager`` of a Mamba group (``mamba_cache_mode`` "none"): each request's state blocks. It
    answers ``isinstance`` checks against vLLM's class as ``_CrossAttentionManager`` does."""

    __slots__ = ()

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        from vllm.v1.core.single_type_kv_cache_manager import MambaManager

        cls: type = MambaManager
        return cls


def _manager(sched: Scheduler, spec: Any, pool: BlockPoolView, group: int) -> _SingleTypeManager:
    from vllm.v1.kv_cache_interface import CrossAttentionSpec, MambaSpec

    cls: type[_SingleTypeManager] = _SingleTypeManager
    if type(spec) is CrossAttentionSpec:
        cls = _CrossAttentionManager
    elif type(spec) is MambaSpec:
        cls = _MambaManager
    return cls(sched, spec, pool, group)


class _Coordinator(_ReadOnly):
    """vLLM's ``KVCacheCoordinator``: ``single_type_managers`` (one per KV cache group), ``block_pool``."""

    __slots__ = ("block_pool", "kv_cache_config", "num_single_type_manager", "single_type_managers")

    kv_cache_config: Any
    block_pool: BlockPoolView
    single_type_managers: tuple[_SingleTypeManager, ...]
    num_single_type_manager: int

    def __init__(self, kv_cache_config: Any, managers: tuple[_SingleTypeManager, ...]) -> None:
        init = object.__setattr__
        init(self, "kv_cache_config", kv_cache_config)
        init(self, "block_pool", managers[0].block_pool)
        init(self, "single_type_managers", managers)
        init(self, "num_single_type_manager", len(managers))


class KVCacheManagerView(_ReadOnly):
    """vLLM's ``KVCacheManager``, read-only, over a :class:`kvsched.vllm.Scheduler`'s core (its
    ``kv_cache_manager`` attribute). See the module docstring for what it answers."""

    __slots__ = (
        "_sched",
        "block_pool",
        "coordinator",
        "empty_kv_cache_blocks",
        "enable_caching",
        "kv_cache_config",
        "log_stats",
        "max_model_len",
        "num_kv_cache_groups",
    )

    _sched: Scheduler
    kv_cache_config: Any
    max_model_len: int
    enable_caching: bool
    log_stats: bool
    num_kv_cache_groups: int
    block_pool: BlockPoolView
    coordinator: _Coordinator
    empty_kv_cache_blocks: KVCacheBlocks

    def __init__(self, sched: Scheduler) -> None:
        init = object.__setattr__
        config = sched.kv_config
        pool: BlockPoolView
        if sched._pins is not None:
            pool = PinningBlockPoolView(
                sched.core, config.num_blocks, config.enable_prefix_caching, sched.hash_block_size, sched._pins
            )
        else:
            pool = BlockPoolView(
                sched.core,
                config.num_blocks,
                config.enable_prefix_caching,
                sched.hash_block_size,
                sched._aux.cached,
            )
        groups = list(sched.kv_cache_config.kv_cache_groups)
        managers = tuple(_manager(sched, group.kv_cache_spec, pool, g) for g, group in enumerate(groups))
        init(self, "_sched", sched)
        init(self, "kv_cache_config", sched.kv_cache_config)
        init(self, "max_model_len", sched.max_model_len)
        init(self, "enable_caching", config.enable_prefix_caching)
        init(self, "log_stats", sched.log_stats)
        init(self, "num_kv_cache_groups", len(groups))
        init(self, "block_pool", pool)
        init(self, "coordinator", _Coordinator(sched.kv_cache_config, managers))
        init(self, "empty_kv_cache_blocks", KVCacheBlocks(tuple(() for _ in groups)))

    @property
    def usage(self) -> float:
        """Share of the usable blocks held by requests (0.0-1.0)."""
        return self.block_pool.get_usage()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix-cache counters since the last ``make_stats()`` (None unless stats are logged)."""
        return self._sched._prefix_cache_stats

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's blocks, one tuple entry per KV cache group (none for a request that holds none or is
        unknown, as in vLLM); a sliding window's null blocks are the pool's one ``null_block``."""
        core, null = self._sched.core, self.block_pool.null_block
        return KVCacheBlocks(
            tuple([null if b == 0 else BlockView(core, b) for b in ids] for ids in self.get_block_ids(request_id))
        )

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table of every KV cache group, in vLLM's group order."""
        core = self._sched.core
        if request_id not in self._sched.requests:
            return tuple([] for _ in range(self.num_kv_cache_groups))
        return tuple(core.get_block_ids(request_id, g).tolist() for g in range(self.num_kv_cache_groups))

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        """The request's blocks (of every group) that cover its first ``num_computed_tokens`` tokens."""
        sizes = self._sched.kv_config.kv_cache_group_block_sizes
        if sizes is not None:  # groups of different block sizes: each group's blocks of its own size
            return tuple(
                ids[: -(-num_computed_tokens // size)]
                for ids, size in zip(self.get_block_ids(request_id), sizes, strict=True)
            )
        num_blocks = -(-num_computed_tokens // self._sched.block_size)
        return tuple(ids[:num_blocks] for ids in self.get_block_ids(request_id))

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """The blocks a prefix lookup for ``request`` would hit now and the tokens they cover (vLLM's
        ``get_computed_blocks``; the third value, a hybrid-model boundary, is always 0). At most
        ``max_cache_hit_length`` tokens (default: all but the last), and no further than the request's own block
        hashes reach, as in vLLM. One list of blocks per KV cache group, all of the hit's length (a window's
        blocks that left it are the ``null_block``). Changes nothing."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        # (the core's first group's blocks: smaller than vLLM's scheduler block when the groups' sizes differ)
        block_size = self._sched.kv_config.kv_block_size
        limit = request.num_tokens - 1 if max_cache_hit_length is None else max_cache_hit_length
        limit = min(limit, len(request.block_hashes) * self._sched.hash_block_size)
        if limit <= 0:
            return self.empty_kv_cache_blocks, 0, 0
        core, null = self._sched.core, self.block_pool.null_block
        tokens = list(request.all_token_ids)
        salt, lora = request.cache_salt, lora_key(request.lora_request)
        groups = [
            core.get_cached_block_ids(tokens, cache_salt=salt, lora_name=lora, max_hit_tokens=limit, group=g).tolist()
            for g in range(self.num_kv_cache_groups)
        ]
        blocks = tuple([null if b == 0 else BlockView(core, b) for b in ids] for ids in groups)
        return KVCacheBlocks(blocks), len(groups[0]) * block_size, 0

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Always 0 per group, as vLLM's (cascade attention is gone)."""
        return [0] * self.num_kv_cache_groups
