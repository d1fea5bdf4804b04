"""kvsched.vllm.Scheduler's contract with vLLM 0.33's engine core: construction, refusals, pause, reset, aborts.

Needs vLLM (``pip install '.[vllm]'``); skipped otherwise. Where a behaviour is vLLM's, the test runs
vLLM's own scheduler on the same calls and compares (``tests/vllm_driver.py``).
"""

from __future__ import annotations

import inspect
import itertools
import os
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm", reason="vLLM is optional: pip install '.[vllm]'")

import kvsched.vllm
from kvsched.vllm import RULES, UnsupportedFeatureError
from kvsched.vllm.testing import make_request, make_scheduler, make_vllm_config
from vllm.v1.core.sched.interface import PauseState, SchedulerInterface
from vllm.v1.engine import FinishReason
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm_driver import compare, runner_output, step_pair

pytestmark = pytest.mark.vllm


def _pair(**fields: object) -> tuple[object, object]:
    cfg = make_vllm_config(**fields)  # type: ignore[arg-type]
    return make_scheduler("vllm", cfg), make_scheduler("kvsched", cfg)


def _add(scheds: tuple[object, ...], rid: str, prompt: list[int], **kw: object) -> None:
    for s in scheds:
        s.add_request(make_request(rid, prompt, **kw))  # type: ignore[attr-defined]


def _step(scheds: tuple[object, ...], token: int = 9) -> list[object]:
    """One synchronous engine step on each scheduler; returns the scheduler outputs after comparing them."""
    return step_pair(scheds, token)[0]


def test_implements_the_whole_interface_with_engine_core_keywords() -> None:
    abstract = {name for name, v in vars(SchedulerInterface).items() if getattr(v, "__isabstractmethod__", False)}
    assert abstract, "vLLM's SchedulerInterface should declare abstract members"
    missing = {name for name in abstract if getattr(kvsched.vllm.Scheduler, name, None) is None}
    assert not missing
    assert not getattr(kvsched.vllm.Scheduler, "__abstractmethods__", frozenset())
    ours = inspect.signature(kvsched.vllm.Scheduler.__init__).parameters
    for name in (
        "vllm_config",
        "kv_cache_config",
        "structured_output_manager",
        "block_size",
        "hash_block_size",
        "mm_registry",
        "include_finished_set",
        "log_stats",
    ):
        assert name in ours
    # vLLM's test helper does not pass hash_block_size: it must have a default.
    assert ours["hash_block_size"].default is None
    s = make_scheduler("kvsched", make_vllm_config())
    assert s.connector is None and s.ec_connector is None
    assert s.get_kv_connector() is None


def test_ec_connector_is_vllms_own_scheduler_role_connector() -> None:
    """vLLM builds its scheduler's encoder-cache connector with ECConnectorFactory, role SCHEDULER; kvsched.vllm
    does the same and exposes it where vLLM's engine core reads it (``ec_connector``, ``get_ec_connector()``); one
    set on a built scheduler (vLLM's tests set mocks) is the one the core asks from the next step."""
    from kvsched.vllm.testing import RandomECConnector
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    s = make_scheduler("kvsched", make_vllm_config(ec_connector_seed=1))
    assert isinstance(s.ec_connector, RandomECConnector)
    assert s.ec_connector.role == ECConnectorRole.SCHEDULER
    assert s.get_ec_connector() is s.ec_connector
    assert s.core.ec_connector is not None
    s.ec_connector = None
    assert s.core.ec_connector is None and s.get_ec_connector() is None


def test_kv_connector_is_vllms_own_scheduler_role_connector() -> None:
    """vLLM builds its scheduler's connector with KVConnectorFactory, role SCHEDULER; kvsched.vllm does the same
    and exposes it where vLLM's engine core reads it (``connector``, ``get_kv_connector()``)."""
    from kvsched.vllm.testing import RandomKVConnector
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    s = make_scheduler("kvsched", make_vllm_config(kv_connector_seed=1))
    assert isinstance(s.connector, RandomKVConnector)
    assert s.connector.role == KVConnectorRole.SCHEDULER
    assert s.get_kv_connector() is s.connector
    assert s.core.config.park_kv_loads is False and s.core.config.reserve_inflight_prefills is True


def test_kv_connectors_are_bound_to_the_kv_cache_view_as_vllm_binds_its_manager() -> None:
    """vLLM's scheduler calls ``bind_kv_cache_manager`` on its connector once it is built; kvsched.vllm binds the
    read-only ``kv_cache_manager`` view the same way, and vLLM's ``MultiConnector`` passes it on to each child
    (whose base-class binding reads the view's ``block_pool``)."""
    s = make_scheduler("kvsched", make_vllm_config(kv_connector_seed=1))
    assert s.connector._kv_cache_manager is s.kv_cache_manager
    m = make_scheduler("kvsched", make_vllm_config(kv_connector_seed=1, kv_connector_multi=True))
    assert type(m.connector).__name__ == "MultiConnector"
    children = m.connector.sub_connectors
    assert [c.passive for c in children] == [True, False]
    assert all(c._kv_cache_manager is m.kv_cache_manager for c in children)
    assert m.kv_cache_manager.block_pool.get_num_free_blocks() == m.core.num_free_blocks


def _pool_binding_connector(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A child config for a connector that overrides ``bind_gpu_block_pool`` (as vLLM's CPU-offload, Mooncake
    store and UMBP connectors do), made importable from this module for vLLM's connector factory."""
    import sys

    from kvsched.vllm.testing import RandomKVConnector

    class PoolBindingConnector(RandomKVConnector):  # type: ignore[misc]
        def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
            self.pool = gpu_block_pool

    monkeypatch.setattr(sys.modules[__name__], "PoolBindingConnector", PoolBindingConnector, raising=False)
    return {
        "kv_connector": "PoolBindingConnector",
        "kv_connector_module_path": __name__,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"seed": 1},
    }


def test_kv_connectors_that_use_vllms_block_pool_are_refused_inside_a_multi_connector_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connector that overrides ``bind_gpu_block_pool``/``bind_kv_cache_manager`` is refused at construction,
    by name, alone or as a child of a ``MultiConnector`` at any depth (the path to it is named); a
    ``MultiConnector`` whose children all bind the base way is accepted (the previous test), and one that overrides
    the binding itself is refused."""
    import sys

    from kvsched.vllm import testing
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    pool = _pool_binding_connector(monkeypatch)
    plain = {**pool, "kv_connector": "RandomKVConnector", "kv_connector_module_path": testing.__name__}

    def multi(*children: dict[str, Any], name: str = "MultiConnector", **kw: Any) -> dict[str, Any]:
        return {"kv_connector": name, "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": list(children)},
                **kw}  # fmt: skip

    def build(ktc: dict[str, Any]) -> Any:
        cfg = make_vllm_config(kv_connector_seed=1)
        cfg.kv_transfer_config = KVTransferConfig(**ktc)
        return make_scheduler("kvsched", cfg)

    with pytest.raises(UnsupportedFeatureError, match=r"\(PoolBindingConnector overrides bind_gpu_block_pool\)"):
        build(pool)
    with pytest.raises(UnsupportedFeatureError, match="MultiConnector > PoolBindingConnector overrides"):
        build(multi(plain, pool))
    with pytest.raises(UnsupportedFeatureError, match="MultiConnector > MultiConnector > PoolBindingConnector"):
        build(multi(plain, multi(plain, pool)))
    assert build(multi(plain, multi(plain, plain))).connector.sub_connectors[1].sub_connectors[0]._kv_cache_manager

    class BindingMulti(MultiConnector):  # type: ignore[misc]
        def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
            self.manager = kv_cache_manager

    monkeypatch.setattr(sys.modules[__name__], "BindingMulti", BindingMulti, raising=False)
    with pytest.raises(UnsupportedFeatureError, match=r"\(BindingMulti overrides bind_kv_cache_manager\)"):
        build(multi(plain, name="BindingMulti", kv_connector_module_path=__name__))


_V1 = "vllm.distributed.kv_transfer.kv_connector.v1"


@pytest.mark.parametrize(
    ("module", "name", "missing"),
    [(f"{_V1}.hisparse.connector", "HiSparseConnector", "HiSparse host block pool")],
)
def test_vllms_other_block_pool_connectors_are_refused_saying_what_is_missing(
    module: str, name: str, missing: str
) -> None:
    """vLLM's connectors that bind the block pool other than SimpleCPUOffloadConnector, MooncakeStoreConnector and
    UMBPStoreConnector (HiSparse: it cannot be built here, without a HiSparse host pool) are refused by name, with
    what kvsched.vllm lacks for each; a subclass is refused the same way."""
    import importlib

    from kvsched.vllm._config import check_kv_connector

    cls = getattr(importlib.import_module(module), name)
    sub = type(f"My{name}", (cls,), {})
    for klass in (cls, sub):
        conn = object.__new__(klass)  # their constructors need what is missing here
        with pytest.raises(UnsupportedFeatureError, match=rf"\({klass.__name__} overrides bind_\w+: .*{missing}"):
            check_kv_connector(make_vllm_config(), conn)


_MOONCAKE = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}


def test_mooncake_store_connector_gets_a_pinning_pool() -> None:
    """vLLM's MooncakeStoreConnector binds the block pool: kvsched.vllm gives it the pinning pool view, alone or
    under a MultiConnector. (Its lookup client, a ZMQ client of the lookup server on a worker, is the
    differential driver's stand-in here.)"""
    from kvsched.vllm._kv_view import PinningBlockPoolView
    from vllm_driver import MooncakeStandIn

    with MooncakeStandIn(0).in_place():
        s = make_scheduler("kvsched", make_vllm_config(block_size=4, num_blocks=32, kv_transfer=_MOONCAKE))
        multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"connectors": [_MOONCAKE]}}  # fmt: skip
        m = make_scheduler("kvsched", make_vllm_config(block_size=4, num_blocks=32, kv_transfer=multi))
    assert isinstance(s.kv_cache_manager.block_pool, PinningBlockPoolView)
    assert s.connector.connector_scheduler._gpu_block_pool is s.kv_cache_manager.block_pool
    assert isinstance(m.kv_cache_manager.block_pool, PinningBlockPoolView)
    assert m.connector.sub_connectors[0].connector_scheduler._gpu_block_pool is m.kv_cache_manager.block_pool


def test_mooncake_store_connector_subclasses_are_accepted_only_binding_as_it_does() -> None:
    """A subclass of MooncakeStoreConnector that binds the pool as it does is accepted; one that overrides the
    binding is refused by name, saying it is not verified."""
    from kvsched.vllm._config import check_kv_connector
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import MooncakeStoreConnector

    plain = type("MyStore", (MooncakeStoreConnector,), {})
    odd = type("OddStore", (MooncakeStoreConnector,), {"bind_gpu_block_pool": lambda self, pool: None})
    for klass in (MooncakeStoreConnector, plain):
        assert check_kv_connector(make_vllm_config(), object.__new__(klass)) is True  # binds the pool
    with pytest.raises(UnsupportedFeatureError, match=r"\(OddStore overrides bind_gpu_block_pool: .*not verified"):
        check_kv_connector(make_vllm_config(), object.__new__(odd))


def test_mooncake_store_connector_with_windows_and_several_groups() -> None:
    """With a sliding window, alone or beside full attention in several KV cache groups, or with align-mode Mamba
    groups (their states come through the boundary hand-offs), MooncakeStoreConnector gets the pinning pool."""
    from kvsched.vllm._kv_view import PinningBlockPoolView
    from vllm_driver import MooncakeStandIn

    cfg = make_vllm_config(block_size=4, num_blocks=64, kv_transfer=_MOONCAKE)
    for groups in [(8,), (None, 8), (None, 3, None, 8)]:
        with MooncakeStandIn(0).in_place():
            s = make_scheduler("kvsched", cfg, kv_cache_groups=groups)
        assert isinstance(s.kv_cache_manager.block_pool, PinningBlockPoolView)
        assert s.connector.connector_scheduler._gpu_block_pool is s.kv_cache_manager.block_pool
    mamba = make_vllm_config(block_size=8, num_blocks=40, max_model_len=64, max_num_batched_tokens=64,
                             max_num_seqs=4, mamba_cache_mode="align", kv_transfer=_MOONCAKE)  # fmt: skip
    with MooncakeStandIn(0).in_place():
        s = make_scheduler("kvsched", mamba, kv_cache_groups=("mamba", None))
    assert s.connector.connector_scheduler._gpu_block_pool is s.kv_cache_manager.block_pool


def _umbp_config(namespace: str = "test", multi: bool = False, **kw: Any) -> Any:
    """A vLLM config with vLLM 0.33's UMBPStoreConnector (by its module: it is not in vLLM's connector registry),
    alone or (``multi``) as the child of a ``MultiConnector``; skips on a vLLM release without it."""
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.umbp")
    from vllm_driver import UMBP_MODULE

    ktc = {"kv_connector": "UMBPStoreConnector", "kv_connector_module_path": UMBP_MODULE, "kv_role": "kv_both",
           "kv_connector_extra_config": {"key_namespace": namespace}}  # fmt: skip
    if multi:
        ktc = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"connectors": [ktc]}}  # fmt: skip
    return make_vllm_config(**{"block_size": 4, "num_blocks": 64, **kw}, kv_transfer=ktc)


def test_umbp_store_connector_takes_its_namespace_from_the_workers_handshake() -> None:
    """With ``key_namespace`` "auto" UMBPStoreConnector looks nothing up until vLLM's engine core hands it the
    namespace its workers report (``get_kv_connector().set_xfer_handshake_metadata_pp_aware``), which reaches it
    through kvsched.vllm's scheduler as through vLLM's."""
    cfg = _umbp_config("auto")
    from vllm.distributed.kv_transfer.kv_connector.v1.umbp.data import UMBPHandshakeMetadata
    from vllm_driver import UMBPStandIn

    with UMBPStandIn(0).in_place():
        s = make_scheduler("kvsched", cfg)
    cs = s.connector.connector_scheduler
    assert cs.runtime is None and cs.codec is None
    s.get_kv_connector().set_xfer_handshake_metadata_pp_aware({(0, 0): UMBPHandshakeMetadata("from-workers")})
    assert cs.runtime is not None and cs.codec.namespace.value == "from-workers"


def test_umbp_store_connector_gets_a_pinning_pool_and_its_local_lookup() -> None:
    """vLLM 0.33's UMBPStoreConnector binds the block pool and the KV cache manager: kvsched.vllm gives it the
    pinning pool view (alone or under a MultiConnector), and its local prefix-cache lookup (through the view's
    coordinator) finds a block a finished request left cached, under vLLM's hash of that block, as vLLM's pool
    does. (Its runtime is the differential driver's stand-in, registered with vLLM's UMBPRuntimeFactory.)"""
    from kvsched.vllm._kv_view import PinningBlockPoolView
    from vllm_driver import UMBPStandIn

    cfg = _umbp_config()
    with UMBPStandIn(0).in_place():
        scheds = [make_scheduler(kind, cfg) for kind in ("vllm", "kvsched")]
    s = scheds[1]
    assert isinstance(s.kv_cache_manager.block_pool, PinningBlockPoolView)
    cs = s.connector.connector_scheduler
    assert cs._gpu_block_pool is s.kv_cache_manager.block_pool
    cfg_multi = _umbp_config(multi=True)
    with UMBPStandIn(0).in_place():
        m = make_scheduler("kvsched", cfg_multi)
    assert isinstance(m.kv_cache_manager.block_pool, PinningBlockPoolView)
    assert m.connector.sub_connectors[0].connector_scheduler._gpu_block_pool is m.kv_cache_manager.block_pool
    hashes = []
    for sched in scheds:
        req = make_request("r", list(range(3, 12)), max_tokens=1, block_size=4)
        sched.add_request(req)
        so = sched.schedule()
        sched.update_from_output(so, runner_output(["r"], [[5]]))
        hashes.append(req.block_hashes[:2])
    assert hashes[0] == hashes[1] and len(hashes[1]) == 2
    for sched in scheds:  # the two full blocks stay cached once the request finished
        lookup = sched.connector.connector_scheduler._local_cache_lookup
        assert [lookup(0, h) for h in hashes[1]] == [True, True]
        assert lookup(0, b"not a block hash") is False


def test_umbp_store_connector_subclasses_are_accepted_only_binding_as_it_does() -> None:
    """A subclass of UMBPStoreConnector that binds the pool and the KV cache manager as it does is accepted; one
    that overrides either binding is refused by name, saying it is not verified."""
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.umbp")
    from kvsched.vllm._config import check_kv_connector
    from vllm.distributed.kv_transfer.kv_connector.v1.umbp.connector import UMBPStoreConnector

    plain = type("MyUMBP", (UMBPStoreConnector,), {})
    for klass in (UMBPStoreConnector, plain):
        assert check_kv_connector(make_vllm_config(), object.__new__(klass)) is True  # binds the pool
    for method in ("bind_gpu_block_pool", "bind_kv_cache_manager"):
        odd = type("OddUMBP", (UMBPStoreConnector,), {method: lambda self, x: None})
        with pytest.raises(UnsupportedFeatureError, match=rf"\(OddUMBP overrides {method}: .*not verified"):
            check_kv_connector(make_vllm_config(), object.__new__(odd))


def test_umbp_store_connector_looks_up_its_local_hit_inside_the_cores_lookup() -> None:
    """With a sliding window beside full attention UMBPStoreConnector asks its local prefix-cache lookup from
    inside its own prefix lookup (to merge the local hit with the store's), which runs inside the core's
    ``schedule()``: the pinning pool answers for the request's local hit, so a request that finds its prompt's
    first blocks cached and the rest in the store loads the rest, under kvsched.vllm as under vLLM's scheduler.
    With align-mode Mamba groups it gets the pinning pool too."""
    from vllm_driver import UMBPStandIn, _umbp_metadata

    cfg = _umbp_config()
    prompt = list(range(3, 3 + 21))
    seen = []
    for impl in ("vllm", "kvsched"):
        standin = UMBPStandIn(0)
        with standin.in_place():
            s = make_scheduler(impl, cfg, kv_cache_groups=(None, 8))
        cs = s.connector.connector_scheduler
        first = make_request("a", prompt[:13], max_tokens=1, block_size=4)
        s.add_request(first)
        so = s.schedule()
        s.update_from_output(so, runner_output(["a"], [[5]]))  # three full blocks stay cached
        second = make_request("b", prompt, max_tokens=1, block_size=4)
        # The store holds every block of the prompt in both groups.
        standin.keys.update(dict.fromkeys(cs.codec.key(h, g) for g in (0, 1) for h in second.block_hashes))
        asked: list[tuple[int, bool]] = []
        local = cs._local_cache_lookup
        cs._local_cache_lookup = lambda g, h, local=local, asked=asked: asked.append((g, local(g, h))) or asked[-1][1]
        s.add_request(second)
        so = s.schedule()
        meta = _umbp_metadata(so.kv_connector_metadata)
        seen.append((asked, second.status, second.num_computed_tokens, meta))
    assert seen[0] == seen[1]
    # Each group's three blocks of the local hit asked, all cached; the request waits for the rest.
    assert seen[1][:3] == ([(0, True)] * 3 + [(1, True)] * 3, RequestStatus.WAITING_FOR_REMOTE_KVS, 20)
    mamba = _umbp_config(block_size=8, num_blocks=40, max_model_len=64, max_num_batched_tokens=64,
                         max_num_seqs=4, mamba_cache_mode="align")  # fmt: skip
    with UMBPStandIn(0).in_place():
        s = make_scheduler("kvsched", mamba, kv_cache_groups=("mamba", None))
    assert s.connector.connector_scheduler._gpu_block_pool is s.kv_cache_manager.block_pool


def test_simple_cpu_offload_connector_gets_a_pinning_pool() -> None:
    """vLLM's SimpleCPUOffloadConnector binds the block pool: kvsched.vllm gives it the pinning pool view (touch,
    free_blocks, block hashes), alone or under a MultiConnector; its lazy offload walks the free block queue
    (``iter_blocks_after``). Other schedulers keep the read-only pool."""
    from kvsched.vllm._kv_view import PinningBlockPoolView
    from vllm.config import KVTransferConfig

    s = make_scheduler("kvsched", make_vllm_config(block_size=4, num_blocks=32, cpu_offload_blocks=16))
    pool = s.kv_cache_manager.block_pool
    assert isinstance(pool, PinningBlockPoolView)
    assert s.connector.scheduler_manager._gpu_block_pool is pool
    plain = make_scheduler("kvsched", make_vllm_config())
    assert not isinstance(plain.kv_cache_manager.block_pool, PinningBlockPoolView)
    offload = {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"cpu_bytes_to_use": 16 * 32}}  # fmt: skip
    cfg = make_vllm_config(block_size=4, num_blocks=32, cpu_offload_blocks=16)
    cfg.kv_transfer_config = KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config={"connectors": [offload]}
    )
    m = make_scheduler("kvsched", cfg)
    assert m.connector.sub_connectors[0].scheduler_manager._gpu_block_pool is m.kv_cache_manager.block_pool
    lazy = make_scheduler(
        "kvsched", make_vllm_config(block_size=4, num_blocks=32, cpu_offload_blocks=16, cpu_offload_lazy=True)
    )
    assert lazy.connector.scheduler_manager._lazy_mode
    queue = lazy.kv_cache_manager.block_pool.free_block_queue
    order = [b.block_id for b in queue.iter_blocks_after(None)]
    assert order == lazy.core.free_block_ids().tolist() and len(order) == 31
    assert [b.block_id for b in queue.iter_blocks_after(lazy.kv_cache_manager.block_pool.blocks[order[4]])] == order[5:]


def test_pinning_pool_touch_and_free_blocks_match_vllms_block_pool() -> None:
    """touch / free_blocks on the pool as vLLM's BlockPool does them, on both schedulers: reference counts, block
    hashes and the blocks the next request gets (the free order) stay identical; a pin outlives its request.

    The null block is where the releases differ: vLLM 0.33's touch skips it, 0.32's adds one to its ref_cnt (a
    count 0.32's pool calls not maintained: its free_blocks takes one off, its own frees of a window's null
    blocks drive it below 0, and nothing reads it, every check of a count 0 testing ``is_null`` as well). The
    view's null block stays at 0 on both, the count the core keeps for it; every other block is compared."""
    from kvsched.vllm.testing import make_request

    scheds = _pair(block_size=4, num_blocks=16, max_model_len=64, cpu_offload_blocks=8)
    _add(scheds, "a", list(range(100, 113)), max_tokens=1, block_size=4)  # 13 tokens: 3 full blocks, a partial one
    step_pair(scheds)  # a finishes: its blocks are freed
    pools = [s.kv_cache_manager.block_pool for s in scheds]
    vllm_null_after_touch = 1 if RULES.version == "0.32" else 0

    def state() -> list[list[tuple[int, Any]]]:
        return [[(b.ref_cnt, b.block_hash) for b in p.blocks if not b.is_null] for p in pools]

    def null_ref_cnts() -> list[int]:
        return [p.null_block.ref_cnt for p in pools]

    assert any(h is not None for _, h in state()[0])  # a's blocks are cached under vLLM's hashes
    # get_cached_block takes a request's block hash (vLLM adds the group id): a's three full blocks, per group.
    hashes = make_request("probe", list(range(100, 113)), block_size=4).block_hashes
    assert len(hashes) == 3
    for h in hashes:
        found = [[b.block_id for b in p.get_cached_block(h, [0])] for p in pools]
        assert found[0] == found[1] and found[0][0] != 0
        assert [p.get_cached_block(h, [0, 1]) for p in pools] == [None, None]  # no group 1 here
        assert [p.get_cached_block(h, []) for p in pools] == [[], []]
    _add(scheds, "b", list(range(100, 117)), max_tokens=3, block_size=4)
    step_pair(scheds)
    held = list(scheds[0].kv_cache_manager.get_block_ids("b")[0])
    assert held == list(scheds[1].kv_cache_manager.get_block_ids("b")[0])
    for p in pools:
        p.touch([p.blocks[b] for b in held[:3]] + [p.null_block])
    compare("after touch", *state())
    assert null_ref_cnts() == [vllm_null_after_touch, 0]
    step_pair(scheds)
    step_pair(scheds)  # b finishes; its first three blocks stay held
    compare("after the finish", *state())
    # Held by the pins (and by the connector's own store of them, which no worker reports over here).
    assert all(pools[1].blocks[b].ref_cnt >= 1 for b in held[:3])
    for p in pools:
        p.free_blocks([p.blocks[held[2]], p.blocks[held[0]]])
    compare("after free_blocks", *state())
    for s in scheds:
        s.add_request(make_request("c", list(range(500, 540)), max_tokens=1, block_size=4))
    step_pair(scheds)  # the free order decides c's blocks
    compare("blocks of c", *state())
    for p in pools:
        p.free_blocks([p.blocks[held[1]]])
    compare("all given back", *state())
    assert null_ref_cnts() == [vllm_null_after_touch, 0]
    assert pools[0].blocks[0] is pools[0].null_block and pools[1].blocks[0].is_null
    assert scheds[1].core.num_free_blocks == pools[0].get_num_free_blocks()
    scheds[1].core.check_invariants()


def test_simple_cpu_offload_with_a_sliding_window_group_offloads_and_reloads_as_vllm() -> None:
    """A gpt-oss-like model (a full-attention group and a sliding window of 8 tokens) with vLLM's
    SimpleCPUOffloadConnector on both schedulers, its worker reporting every load and store in the step's own
    output: a request's blocks of both groups are stored to the CPU pool (the window's blocks that left it from
    the GPU prefix cache, by the group's hash), the GPU prefix cache is reset, and a request with the same prompt
    loads them back. Every step's outputs, every GPU block's reference count and block hash (with its group), and
    the connector's state are compared with vLLM's scheduler."""
    from vllm.v1.core.kv_cache_utils import get_group_id
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

    cfg = make_vllm_config(block_size=4, num_blocks=40, max_model_len=64, cpu_offload_blocks=48)
    groups = (None, 8)
    scheds = tuple(make_scheduler(impl, cfg, kv_cache_groups=groups) for impl in ("vllm", "kvsched"))
    pools = [s.kv_cache_manager.block_pool for s in scheds]
    managers = [s.connector.scheduler_manager for s in scheds]
    seen = {"stored_window": 0, "recovered": 0, "loaded": 0}

    def pool_state(p: Any) -> list[tuple[int, Any, Any]]:
        # (vLLM 0.32 counts references of its null block, a count it calls not maintained: left out there.)
        blocks = p.blocks[1:] if RULES.version == "0.32" else p.blocks
        return [(b.ref_cnt, b.block_hash, b.block_hash_num_tokens) for b in blocks]

    def step() -> list[Any]:
        outs = [s.schedule() for s in scheds]
        compare("SchedulerOutput", outs[0], outs[1])
        meta = outs[0].kv_connector_metadata
        for bid in meta.store_gpu_blocks:
            block = pools[0].blocks[bid]
            if groups[get_group_id(block.block_hash)] is not None:
                seen["stored_window"] += 1
                seen["recovered"] += block.ref_cnt == 1  # no request holds it: it had left the window
        seen["loaded"] += len(meta.load_gpu_blocks)
        results = []
        for s, so in zip(scheds, outs, strict=True):
            m = so.kv_connector_metadata
            done = KVConnectorOutput(
                finished_recving=set(m.load_event_to_reqs.get(m.load_event, ())) or None,
                kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(
                    completed_store_events={m.store_event: 1} if m.store_event >= 0 else {}
                ),
            )
            ids = list(so.num_scheduled_tokens)
            sampled = [[] if s.requests[r].is_prefill_chunk else [9] for r in ids]
            results.append(s.update_from_output(so, runner_output(ids, sampled, kv_connector_output=done)))
        compare("EngineCoreOutputs", results[0], results[1])
        compare("GPU blocks", pool_state(pools[0]), pool_state(pools[1]))
        compare("offload loads", sorted(managers[0]._reqs_to_load), sorted(managers[1]._reqs_to_load))
        compare("CPU free blocks", *[m.cpu_block_pool.get_num_free_blocks() for m in managers])
        scheds[1].core.check_invariants()
        return outs

    prompt = list(range(100, 130))  # 7 full blocks and 2 tokens
    _add(scheds, "a", prompt, max_tokens=6, block_size=4)
    while any(s.has_requests() for s in scheds) or any(m.has_pending_stores() for m in managers):
        step()
    assert seen["stored_window"] > 0 and seen["recovered"] > 0, seen
    assert [s.reset_prefix_cache() for s in scheds] == [True, True]
    compare("after the reset", pool_state(pools[0]), pool_state(pools[1]))
    assert all(b.block_hash is None for b in pools[1].blocks)
    _add(scheds, "b", [*prompt, 7, 8, 9], max_tokens=2, block_size=4)
    first = step()[0]
    assert first.kv_connector_metadata.load_event >= 0 and seen["loaded"] > 0, seen
    assert scheds[0].requests["b"].status == scheds[1].requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    while any(s.has_requests() for s in scheds):
        step()
    assert scheds[1].core.num_free_blocks == pools[0].get_num_free_blocks()


def test_simple_cpu_offload_layouts_with_groups_build_as_under_vllm() -> None:
    """SimpleCPUOffloadConnector with KV cache groups: without a full-attention group vLLM's connector fails its
    own construction under either scheduler (the same AssertionError); with align-mode Mamba groups and prefix
    caching it gets the pinning pool (its Mamba states come through the boundary hand-offs), and without prefix
    caching it turns itself off, under either scheduler."""
    from kvsched.vllm._kv_view import PinningBlockPoolView

    cfg = make_vllm_config(block_size=4, num_blocks=40, max_model_len=64, cpu_offload_blocks=48)
    for groups in [(8,), (8, 3)]:
        for impl in ("vllm", "kvsched"):
            with pytest.raises(AssertionError):
                make_scheduler(impl, cfg, kv_cache_groups=groups)
    mamba = make_vllm_config(block_size=8, num_blocks=40, max_model_len=64, max_num_batched_tokens=64,
                             max_num_seqs=4, enable_prefix_caching=True, mamba_cache_mode="align",
                             cpu_offload_blocks=48)  # fmt: skip
    for impl in ("vllm", "kvsched"):
        assert make_scheduler(impl, mamba, kv_cache_groups=("mamba", None)).connector.scheduler_manager is not None
    built = make_scheduler("kvsched", mamba, kv_cache_groups=("mamba", None))
    assert isinstance(built.kv_cache_manager.block_pool, PinningBlockPoolView)
    assert built.connector.scheduler_manager._gpu_block_pool is built.kv_cache_manager.block_pool
    off = make_vllm_config(block_size=8, num_blocks=40, max_model_len=64, max_num_batched_tokens=64,
                           max_num_seqs=4, enable_prefix_caching=False, mamba_cache_mode="align",
                           cpu_offload_blocks=48)  # fmt: skip
    assert make_scheduler("kvsched", off, kv_cache_groups=("mamba", None)).connector.scheduler_manager is None


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer", "kv_both"])
def test_kv_connector_roles_with_async_scheduling_take_vllms_gates(kv_role: str) -> None:
    """vLLM 0.33 with several batches in flight defers block frees for consumer roles and drops a preempted
    request's in-flight output for connectors that require KV delivery (producer roles); the adapter sets the
    core's defer_block_free and drop_preempted_output to the same gates, and vLLM's tests may set the first on a
    built scheduler."""
    s = make_scheduler("kvsched", make_vllm_config(kv_connector_seed=1, async_scheduling=True, kv_role=kv_role))
    consumer = kv_role != "kv_producer"
    producer = kv_role != "kv_consumer"
    assert s.requires_kv_delivery is producer
    assert s.core.config.drop_preempted_output is producer
    assert s.defer_block_free is consumer and s.core.config.defer_block_free is consumer
    s.defer_block_free = not consumer
    assert s.core.config.defer_block_free is (not consumer)
    sync = make_scheduler("kvsched", make_vllm_config(kv_connector_seed=1, kv_role=kv_role))
    assert sync.defer_block_free is False and sync.requires_kv_delivery is producer


def test_async_kv_load_waits_in_place_and_delayed_free_holds_blocks() -> None:
    """vLLM 0.33: an async load leaves the request WAITING_FOR_REMOTE_KVS holding its blocks; once the workers
    report it over it is admitted for the rest of its prompt; a delayed free keeps a finished request (and its
    blocks) until finished_sending."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import RequestStatus

    class Fixed:
        def __init__(self) -> None:
            self.finished: list[str] = []

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            return 32, True

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            pass

        def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any]]:
            self.finished.append(request.request_id)
            return True, {"sent": len(block_ids)}

    s = make_scheduler("kvsched", make_vllm_config(kv_connector_seed=1, num_blocks=32, max_model_len=256))
    fixed = Fixed()
    for hook in ("get_num_new_matched_tokens", "update_state_after_alloc", "request_finished"):
        setattr(s.connector, hook, getattr(fixed, hook))
    req = make_request("r0", list(range(3, 51)), max_tokens=1)
    s.add_request(req)
    free = s.core.num_free_blocks
    out = s.schedule()
    assert out.num_scheduled_tokens == {}
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and req.num_computed_tokens == 32
    assert s.core.num_free_blocks == free - 2 and s.kv_holding_waiting == [req]

    def mro(ids: list[str], kvo: Any) -> Any:
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            kv_connector_output=kvo,
        )

    s.update_from_output(out, mro([], KVConnectorOutput(finished_recving={"r0"})))
    assert s.finished_recving_kv_req_ids == {"r0"}
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r0": 16}
    eco = s.update_from_output(out, mro(["r0"], None))
    (output,) = eco[0].outputs
    assert output.finish_reason is not None and output.kv_transfer_params == {"sent": 3}
    assert fixed.finished == ["r0"] and s.has_finished_requests() and "r0" in s.requests
    held = s.core.num_free_blocks
    out = s.schedule()
    s.update_from_output(out, mro([], KVConnectorOutput(finished_sending={"r0"})))
    assert "r0" not in s.requests and not s.has_finished_requests()
    assert s.core.num_free_blocks > held and s.core.num_held_kv_requests == 0


def test_draft_slots_and_a_token_budget_apart_from_the_inputs_follow_vllm() -> None:
    """Parallel drafting takes k - 1 query slots per scheduled request from max_num_batched_tokens, and
    max_num_scheduled_tokens caps the tokens: kvsched's core gets both and schedules as vLLM does."""
    pair = _pair(
        max_num_seqs=8,
        max_num_batched_tokens=40,
        max_num_scheduled_tokens=30,
        num_speculative_tokens=4,
        parallel_drafting=True,
    )
    vllm_sched, ours = pair
    assert ours.core.config.draft_slots == 3 and ours.core.config.max_num_scheduled_tokens == 30  # type: ignore[attr-defined]
    assert ours.max_num_scheduled_tokens == vllm_sched.max_num_scheduled_tokens == 30  # type: ignore[attr-defined]
    for k in range(4):
        _add(pair, f"r{k}", [100 * k + j for j in range(1, 13)])
    outs = _step(pair)
    # 12 (+3 slots), 12 (+3), then 6 tokens left of the 30 (40 - 30 inputs used leaves 10 - 3 = 7)
    assert dict(outs[1].num_scheduled_tokens) == {"r0": 12, "r1": 12, "r2": 6}  # type: ignore[attr-defined]
    for _ in range(6):
        _step(pair)


def test_context_parallelism_maps_to_the_cores_world_sizes() -> None:
    """vLLM's engine gives the scheduler its block size times the DCP size: the core gets the per-rank block size
    and dcp_world_size (its block unit is then vLLM's), and pcp_world_size (vLLM's KV cache manager leaves PCP out
    of the unit)."""
    for dcp, pcp in [(2, 1), (4, 1), (1, 2), (2, 2), (3, 1), (6, 3)]:
        cfg = make_vllm_config(
            block_size=4, num_blocks=32, decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp
        )
        vllm_sched, ours = (make_scheduler(impl, cfg) for impl in ("vllm", "kvsched"))
        kv = ours.kv_config
        assert (kv.block_size, kv.dcp_world_size, kv.pcp_world_size) == (4, dcp, pcp)
        assert kv.kv_block_size == ours.block_size == vllm_sched.block_size == 4 * dcp


def test_what_context_parallelism_does_not_support_is_refused_by_name() -> None:
    """Sliding windows or several KV cache groups under context parallelism, and a spec DCP does not shard are
    refused at construction, by name; KV connectors and KV cache events run with it."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    cfg = make_vllm_config(block_size=4, decode_context_parallel_size=2)
    with pytest.raises(UnsupportedFeatureError, match="context parallelism with sliding-window attention"):
        make_scheduler("kvsched", cfg, sliding_window=8)
    cfg = make_vllm_config(block_size=4, prefill_context_parallel_size=2)
    with pytest.raises(UnsupportedFeatureError, match="context parallelism with sliding-window attention or several"):
        make_scheduler("kvsched", cfg, kv_cache_groups=(None, None))
    cfg = make_vllm_config(block_size=4, kv_connector_seed=1, decode_context_parallel_size=2)
    assert make_scheduler("kvsched", cfg).kv_config.dcp_world_size == 2
    # KV cache events run with context parallelism (vLLM's events then name blocks of block_size * DCP tokens).
    cfg = make_vllm_config(block_size=4, kv_events=True, decode_context_parallel_size=2)
    assert make_scheduler("kvsched", cfg).kv_config.enable_kv_cache_events
    vcfg = make_vllm_config(block_size=16, decode_context_parallel_size=2)
    kw = _attention_kw(block_size=8)
    with pytest.raises(UnsupportedFeatureError, match="does not shard"):
        _build_with_groups(vcfg, FullAttentionSpec(**kw, dcp_sharded=False))


def test_unsupported_scheduler_settings_are_refused() -> None:
    cfg = make_vllm_config(block_size=8192)
    with pytest.raises(UnsupportedFeatureError, match="block sizes above 4096 tokens per rank"):
        make_scheduler("kvsched", cfg)
    # An error is also a ValueError and a NotImplementedError, so either kind of handler catches it.
    assert issubclass(UnsupportedFeatureError, ValueError)
    assert issubclass(UnsupportedFeatureError, NotImplementedError)


def test_unsupported_request_features_fail_that_request_and_leave_no_trace() -> None:
    """A request kvsched.vllm cannot serve never raises from add_request (vLLM's engine core would die): it
    finishes with FINISHED_ERROR at the next update, and its id can then be used again."""
    from vllm.sampling_params import RepetitionDetectionParams

    s = make_scheduler("kvsched", make_vllm_config())
    req = make_request("r0", [1, 2, 3, 4], resumable=True)
    req.sampling_params.repetition_detection = RepetitionDetectionParams(max_pattern_size=4, min_count=3)
    s.add_request(req)
    assert s.has_request("r0") and s.get_num_unfinished_requests() == 1
    # The next input of that streaming-input session: the refusal answers for the id.
    s.add_request(make_request("r0", [5, 6], resumable=True))
    so = s.schedule()
    assert so.total_num_scheduled_tokens == 0
    eco = s.update_from_output(so, _mro(so, 9))
    (out,) = [o for e in eco.values() for o in e.outputs]
    assert out.request_id == "r0" and out.finish_reason == FinishReason.ERROR
    if RULES.output_error:
        assert "repetition detection" in out.error.message and out.error.code == "validation_error"
    assert req.status == RequestStatus.FINISHED_ERROR
    assert not s.has_request("r0") and s.get_num_unfinished_requests() == 0 and s.requests == {}
    s.add_request(make_request("r0", [1, 2, 3, 4]))
    assert s.has_request("r0")


def test_prompt_logprobs_requests_skip_the_prefix_cache_as_in_vllm() -> None:
    """A request with prompt logprobs never reads the prefix cache (vLLM's skip_reading_prefix_cache): it computes
    its whole prompt although the blocks are cached, and the prefix-cache stats leave it out."""
    pair = _pair(num_blocks=64, max_model_len=256, block_size=16)
    prompt = list(range(100, 150))
    _add(pair, "warm", prompt, max_tokens=1)
    _step(pair)
    _add(pair, "logprobs", prompt, max_tokens=2, prompt_logprobs=1)
    _add(pair, "plain", prompt, max_tokens=2)
    out = _step(pair)[-1]  # _step compares every output, the stats included
    assert out.num_scheduled_tokens == {"logprobs": 50, "plain": 2}  # type: ignore[attr-defined]


def test_finish_requests_ignores_unknown_ids_and_none_finishes_everything() -> None:
    pair = _pair(num_blocks=64, max_model_len=256)
    for i in range(4):
        _add(pair, f"r{i}", list(range(10 + i, 40 + i)), max_tokens=5)
    _step(pair)
    for s in pair:
        done = s.finish_requests(["r1", "nope"], RequestStatus.FINISHED_ABORTED)  # type: ignore[attr-defined]
        assert [r.request_id for r in done] == ["r1"]
    _step(pair)
    a, b = (s.finish_requests(None, RequestStatus.FINISHED_ABORTED) for s in pair)  # type: ignore[attr-defined]
    assert sorted(r.request_id for r in a) == sorted(r.request_id for r in b) == ["r0", "r2", "r3"]
    out = _step(pair)
    assert out[1].finished_req_ids == {"r0", "r2", "r3"}  # type: ignore[attr-defined]
    assert pair[1].core.num_free_blocks == 63  # type: ignore[attr-defined]


def test_pause_states_match_vllm() -> None:
    pair = _pair(num_blocks=64, max_model_len=256)
    _add(pair, "r0", list(range(10, 50)), max_tokens=20)
    _step(pair)
    for s in pair:
        s.set_pause_state(PauseState.PAUSED_NEW)  # type: ignore[attr-defined]
    _add(pair, "r1", list(range(60, 90)), max_tokens=20)
    out = _step(pair)
    assert list(out[1].num_scheduled_tokens) == ["r0"]  # type: ignore[attr-defined]
    assert pair[1].get_num_unfinished_requests() == pair[0].get_num_unfinished_requests() == 1  # type: ignore[attr-defined]
    for s in pair:
        s.set_pause_state(PauseState.PAUSED_ALL)  # type: ignore[attr-defined]
    out = _step(pair)
    assert out[1].total_num_scheduled_tokens == 0  # type: ignore[attr-defined]
    assert pair[1].get_num_unfinished_requests() == 0  # type: ignore[attr-defined]
    for s in pair:
        s.set_pause_state(PauseState.UNPAUSED)  # type: ignore[attr-defined]
    out = _step(pair)
    assert list(out[1].num_scheduled_tokens) == ["r0", "r1"]  # type: ignore[attr-defined]
    assert pair[1].pause_state == PauseState.UNPAUSED  # type: ignore[attr-defined]


def test_reset_prefix_cache_with_running_requests_matches_vllm() -> None:
    pair = _pair(num_blocks=64, max_model_len=256)
    for i in range(3):
        _add(pair, f"r{i}", [*list(range(10, 50)), i], max_tokens=20)
    _step(pair)
    assert [s.reset_prefix_cache() for s in pair] == [False, False]  # type: ignore[attr-defined]
    assert [s.reset_prefix_cache(reset_running_requests=True) for s in pair] == [True, True]  # type: ignore[attr-defined]
    for rid in ("r0", "r1", "r2"):
        compare(rid, pair[0].requests[rid].status, pair[1].requests[rid].status)  # type: ignore[attr-defined]
    for _ in range(3):
        _step(pair)


def test_wrapping_preempt_request_observes_the_same_preemptions_as_vllms_in_the_same_order() -> None:
    """vLLM's tests wrap ``_preempt_request`` on an instance to watch preemptions: kvsched calls it once per
    preemption its core made (and per request ``reset_prefix_cache`` preempts), in vLLM's order, while the request
    still shows its state before the preemption. Called by hand on a running request, the core preempts it."""
    pair = _pair(num_blocks=12, max_model_len=256)
    seen: list[list[tuple[str, object, int, bool]]] = [[], []]
    for s, log in zip(pair, seen, strict=True):
        orig = s._preempt_request  # type: ignore[attr-defined]

        def watch(request: Any, timestamp: float, _orig: Any = orig, _log: Any = log, **kw: Any) -> None:
            _log.append(
                (request.request_id, request.status, request.num_computed_tokens, bool(kw.get("drop_stale_output")))
            )
            _orig(request, timestamp, **kw)

        s._preempt_request = watch  # type: ignore[attr-defined]
    for i in range(4):
        _add(pair, f"r{i}", [*list(range(10, 40)), i], max_tokens=40)
    for _ in range(30):
        _step(pair)
    assert seen[0], "the workload did not preempt"
    assert seen[1] == seen[0]
    n = len(seen[0])
    assert [s.reset_prefix_cache(reset_running_requests=True) for s in pair] == [True, True]  # type: ignore[attr-defined]
    assert len(seen[0]) > n and seen[1] == seen[0]
    _step(pair)
    # Called by hand, as vLLM's tests call it (after taking the request out of `running`): the request is
    # preempted now, in both, and the steps after stay identical.
    victim_id = pair[0].running[0].request_id  # type: ignore[attr-defined]
    for s in pair:
        victim = s.requests[victim_id]  # type: ignore[attr-defined]
        s.running.remove(victim)  # type: ignore[attr-defined]
        s._preempt_request(victim, 0.0)  # type: ignore[attr-defined]
        compare(victim_id, victim.status, RequestStatus.PREEMPTED)
    for _ in range(3):
        _step(pair)
    _add(pair, "late", list(range(60, 70)), max_tokens=5)  # waiting: it cannot be preempted
    with pytest.raises(kvsched.InvalidRequestError, match="not running"):
        pair[1]._preempt_request(pair[1].requests["late"], 0.0)  # type: ignore[attr-defined]
    for _ in range(3):
        _step(pair)


class _FakeGrammar:
    """Stands for a compiled grammar: the scheduler only needs to know it exists (token acceptance is stubbed)."""

    def is_terminated(self) -> bool:
        return False


def test_requests_wait_for_their_grammar_as_in_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33 _handle_blocked_waiting_request: a request whose grammar is still compiling is skipped by
    admission (others pass it) and keeps its place; once the grammar exists it is admitted and its status turns
    WAITING only when admission reaches it."""
    from vllm.sampling_params import StructuredOutputsParams

    pair = _pair(num_blocks=64, max_model_len=256, max_num_batched_tokens=64)
    for s in pair:
        monkeypatch.setattr(s.structured_output_manager, "accept_tokens", lambda r, t: True)  # type: ignore[attr-defined]
    reqs = []
    for s in pair:
        req = make_request("g", list(range(10, 30)), max_tokens=4)
        req.sampling_params.structured_outputs = StructuredOutputsParams(regex="[ab]+")
        from vllm.v1.structured_output.request import StructuredOutputRequest

        req.structured_output_request = StructuredOutputRequest.from_sampling_params(req.sampling_params)
        req.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        s.add_request(req)  # type: ignore[attr-defined]
        reqs.append(req)
    _add(pair, "plain", list(range(50, 70)), max_tokens=4)
    out = _step(pair)
    assert list(out[1].num_scheduled_tokens) == ["plain"]  # type: ignore[attr-defined]
    compare("stats", pair[0].make_stats(), pair[1].make_stats())  # type: ignore[attr-defined]
    compare("status", reqs[0].status, reqs[1].status)
    for req in reqs:
        req.structured_output_request.grammar = _FakeGrammar()
    out = _step(pair)
    assert "g" in out[1].num_scheduled_tokens  # type: ignore[attr-defined]
    assert out[1].has_structured_output_requests is out[0].has_structured_output_requests  # type: ignore[attr-defined]
    compare("status", reqs[0].status, reqs[1].status)
    for _ in range(6):
        _step(pair)
    assert not pair[1].has_request("g")  # type: ignore[attr-defined]


def test_preemption_recomputes_as_in_vllm() -> None:
    """vLLM's engine has no swap path (its runner never copies KV to a CPU pool): the adapter's core always
    recomputes, whatever kvsched's own default becomes."""
    s = make_scheduler("kvsched", make_vllm_config())
    config = s._core.config
    assert (config.preemption_mode, config.num_cpu_blocks) == ("recompute", 0)


def test_speculative_decoding_drafters_that_need_more_than_k_drafts_are_refused_by_name() -> None:
    # n-gram with k drafts per step is supported: the core gets k and no lookahead slots.
    s = make_scheduler("kvsched", make_vllm_config(num_speculative_tokens=3))
    assert (s.kv_config.num_speculative_tokens, s.kv_config.num_lookahead_tokens) == (3, 0)
    assert s.kv_config.draft_slots == 0
    # Parallel drafting takes k - 1 query slots per scheduled request from the input budget: the core's
    # draft_slots.
    cfg = make_vllm_config(num_speculative_tokens=4)
    object.__setattr__(cfg.speculative_config, "parallel_drafting", True)
    assert cfg.speculative_config.max_num_new_slots_for_drafting == 3
    assert make_scheduler("kvsched", cfg).kv_config.draft_slots == 3
    # Dynamic speculation lengths: refused.
    cfg = make_vllm_config(num_speculative_tokens=4)
    object.__setattr__(cfg.speculative_config, "num_speculative_tokens_per_batch_size", [(1, 8, 2)])
    with pytest.raises(UnsupportedFeatureError, match="dynamic speculation lengths"):
        make_scheduler("kvsched", cfg)


def test_drafts_reach_the_core_and_ride_the_next_step() -> None:
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    s = make_scheduler("kvsched", make_vllm_config(num_speculative_tokens=2))
    s.add_request(make_request("r0", [5, 6, 7, 8, 9], max_tokens=10))
    out = s.schedule()

    def runner_output(tokens: list[int]) -> ModelRunnerOutput:
        return ModelRunnerOutput(req_ids=["r0"], req_id_to_index={"r0": 0}, sampled_token_ids=[tokens])

    s.update_from_output(out, runner_output([11]))
    s.update_draft_token_ids(DraftTokenIds(["r0", "gone"], [[12, -1], [1]]))  # unknown ids are skipped
    assert s.requests["r0"].spec_token_ids == [12, -1]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r0": 3}
    assert out.scheduled_spec_decode_tokens == {"r0": [12, -1]}
    s.update_from_output(out, runner_output([12, 13]))  # the first draft accepted, the padding rejected
    assert s.requests["r0"].num_computed_tokens == 7 == s.core.get_num_computed_tokens("r0")


def _grammar_request(rid: str, prompt: list[int], max_tokens: int) -> object:
    """A structured-output request whose grammar is still compiling (as vLLM's engine core adds it)."""
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output.request import StructuredOutputRequest

    req = make_request(rid, prompt, max_tokens=max_tokens)
    req.sampling_params.structured_outputs = StructuredOutputsParams(regex="[ab]+")
    req.structured_output_request = StructuredOutputRequest.from_sampling_params(req.sampling_params)
    req.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    return req


def test_a_grammar_wait_keeps_its_place_in_waiting_as_in_vllm_033(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.33 keeps a grammar-blocked request in `waiting`: "g", added after "c" and never reached while the
    slots are full, stays behind "c" once its grammar is ready, so a freed slot goes to "c". (kvsched's parking
    rule, park_grammar_waits=True, would put "g" at the front and admit it first: tests/test_grammar_wait.py.)"""
    pair = _pair(num_blocks=64, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=2)
    for s in pair:
        monkeypatch.setattr(s.structured_output_manager, "accept_tokens", lambda r, t: True)  # type: ignore[attr-defined]
    _add(pair, "a", list(range(10, 18)), max_tokens=2)
    _add(pair, "b", list(range(20, 28)), max_tokens=8)
    _add(pair, "c", list(range(30, 38)), max_tokens=8)
    reqs = [_grammar_request("g", list(range(40, 48)), max_tokens=8) for _ in pair]
    for s, req in zip(pair, reqs, strict=True):
        s.add_request(req)  # type: ignore[attr-defined]
    out = _step(pair)
    assert sorted(out[1].num_scheduled_tokens) == ["a", "b"]  # type: ignore[attr-defined]
    compare("stats", pair[0].make_stats(), pair[1].make_stats())  # type: ignore[attr-defined]
    for req in reqs:
        req.structured_output_request.grammar = _FakeGrammar()  # type: ignore[attr-defined]
    admitted = []
    for _ in range(4):
        out = _step(pair)
        compare("stats", pair[0].make_stats(), pair[1].make_stats())  # type: ignore[attr-defined]
        admitted += [r for r in out[1].scheduled_new_reqs]  # type: ignore[attr-defined]
    assert [r.req_id for r in admitted][:1] == ["c"]
    compare("status", reqs[0].status, reqs[1].status)  # type: ignore[attr-defined]


@pytest.mark.parametrize("root", ["vllm", "other"])
def test_decode_block_hashes_come_from_the_core_and_equal_vllms(monkeypatch: pytest.MonkeyPatch, root: str) -> None:
    """A block that fills while decoding gets vLLM's SHA-256 hash from kvsched's core: the hash the core keyed
    the block with, chained from vLLM's NONE_HASH, for a request without extra keys; the core's SHA-256 of vLLM's
    encoding for a salted request. Blocks with a LoRA adapter and other hash functions go through vLLM's hasher.
    Each way the request's ``block_hashes`` equal those vLLM's scheduler leaves, also when the core's root is not
    vLLM's NONE_HASH (``root`` "other": the core's hashes then differ and the adapter computes vLLM's)."""
    import kvsched.vllm._config as config_module
    import kvsched.vllm.scheduler as adapter
    from vllm.utils.hashing import sha256, sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher

    calls: list[object] = []
    real = adapter.vllm_sha256_block_hashes

    def counted(*args: object) -> object:
        calls.append(args)
        return real(*args)  # type: ignore[arg-type]

    from_core: list[str] = []
    real_from_core = adapter.Scheduler._hashes_from_core

    def counted_from_core(self: Any, reqs: list[Any], req_ids: list[str]) -> None:
        from_core.extend(req_ids)
        real_from_core(self, reqs, req_ids)

    monkeypatch.setattr(adapter, "vllm_sha256_block_hashes", counted)
    monkeypatch.setattr(adapter.Scheduler, "_hashes_from_core", counted_from_core)
    if root == "other":
        monkeypatch.setattr(config_module, "vllm_none_hash", lambda: bytes(32))
    pair = _pair(block_size=4, num_blocks=64, max_loras=1)
    assert pair[1].core.config.prefix_hash_algo == "sha256_pickle"  # type: ignore[attr-defined]
    _add(pair, "plain", [1, 2, 3, 4, 5, 6], max_tokens=12, block_size=4)
    _add(pair, "salted", [5, 6], cache_salt="s", max_tokens=12, block_size=4)  # block 0 fills while decoding
    _add(pair, "lora", [7, 8, 9, 10, 11], lora_name="l", max_tokens=12, block_size=4)
    # Another hash function (an engine uses one for all its requests; this prompt shares no block with the others).
    cbor = get_request_block_hasher(4, sha256_cbor)
    for s in pair:
        request = make_request("cbor", [21, 22, 23, 24, 25], max_tokens=12, block_size=4)
        request._block_hasher = cbor
        s.add_request(request)  # type: ignore[attr-defined]
    requests = [dict(s.requests) for s in pair]  # type: ignore[attr-defined]
    for _ in range(8):
        _step(pair)
    assert set(from_core) == {"plain"}  # its decode blocks
    assert calls  # the salted request's (and with another root the plain request's) decode blocks
    plain = requests[0]["plain"].block_hashes
    assert any(args[0] in plain for args in calls) == (root == "other")  # type: ignore[index]
    for rid in ("plain", "salted", "lora", "cbor"):
        hashes = [r[rid].block_hashes for r in requests]
        assert len(hashes[0]) >= 2
        assert hashes[1] == hashes[0], rid
    assert adapter._is_vllm_sha256_hasher(get_request_block_hasher(4, sha256), 4)
    assert not adapter._is_vllm_sha256_hasher(get_request_block_hasher(8, sha256), 4)
    if RULES.version != "0.32":  # look-ahead hashes (vLLM 0.33)
        assert not adapter._is_vllm_sha256_hasher(get_request_block_hasher(4, sha256, 1), 4)
    assert not adapter._is_vllm_sha256_hasher(cbor, 4)
    assert not adapter._is_vllm_sha256_hasher(len, 4)


def _mro(so: Any, token: int) -> ModelRunnerOutput:
    """One sampled ``token`` for every request of the step (the prompts here fit in one step)."""
    ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[token] for _ in ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def test_outputs_of_two_clients_keep_vllms_order_and_the_stats_go_to_the_first() -> None:
    """vLLM's outputs dict is ordered by when each client's first output of the step was produced, and the
    scheduler stats ride on its first entry. Client 0's request is first in the batch, so its entry comes first,
    although client 1's request (an entry the adapter handles on its slow path) is applied in between."""
    cfg = make_vllm_config(block_size=4, num_blocks=64, max_model_len=64)
    pair = (make_scheduler("vllm", cfg), make_scheduler("kvsched", cfg))
    for s in pair:
        s.add_request(make_request("c0", [10, 11], max_tokens=8, block_size=4))  # type: ignore[attr-defined]
        s.add_request(make_request("c1", [5, 6, 7], max_tokens=8, client_index=1, block_size=4))  # type: ignore[attr-defined]
        s.add_request(make_request("c0-short", [8, 9], max_tokens=2, block_size=4))  # type: ignore[attr-defined]
    orders = []
    for _ in range(3):
        outs = [s.schedule() for s in pair]  # type: ignore[attr-defined]
        compare("SchedulerOutput", outs[0], outs[1])
        results = [s.update_from_output(so, _mro(so, 9)) for s, so in zip(pair, outs, strict=True)]  # type: ignore[attr-defined]
        compare("EngineCoreOutputs", results[0], results[1])
        assert list(results[1]) == list(results[0])
        assert next(iter(results[1].values())).scheduler_stats is not None
        orders.append(list(results[1]))
    assert orders == [[0, 1]] * 3


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_whose_requests_were_all_aborted_returns_no_outputs_without_stats(async_scheduling: bool) -> None:
    """The model ran steps whose requests were all aborted meanwhile (a client disconnected), and a step that
    scheduled nothing: with stats off, vLLM returns an empty dict for each, and so does kvsched (no empty entry
    for client 0)."""
    cfg = make_vllm_config(block_size=4, num_blocks=64, max_model_len=64, async_scheduling=async_scheduling)
    pair = (make_scheduler("vllm", cfg, log_stats=False), make_scheduler("kvsched", cfg, log_stats=False))
    for s in pair:
        s.add_request(make_request("r0", [5, 6, 7], max_tokens=8, block_size=4))  # type: ignore[attr-defined]
    first = [s.schedule() for s in pair]  # type: ignore[attr-defined]
    second = [s.schedule() for s in pair] if async_scheduling else first  # type: ignore[attr-defined]
    for s in pair:
        s.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)  # type: ignore[attr-defined]
    empty = [s.schedule() for s in pair]  # type: ignore[attr-defined]
    steps = [first, second, empty] if async_scheduling else [first, empty]
    for outs in steps:
        results = [s.update_from_output(so, _mro(so, 9)) for s, so in zip(pair, outs, strict=True)]  # type: ignore[attr-defined]
        compare("EngineCoreOutputs", results[0], results[1])
        assert results[1] == {}


def _build_with_groups(vcfg: Any, *specs: Any, block_size: int = 16, hash_block_size: int = 16) -> Any:
    """kvsched.vllm.Scheduler on a KV cache config of one group per spec (scheduler and hash block size 16)."""
    from kvsched.vllm import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    return Scheduler(
        vllm_config=vcfg,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vcfg),
        block_size=block_size,
        hash_block_size=hash_block_size,
    )


def _attention_kw(block_size: int = 16, head_size: int = 1) -> dict[str, Any]:
    import torch

    return {"block_size": block_size, "num_kv_heads": 1, "head_size": head_size, "dtype": torch.float32}


def test_a_sliding_window_group_runs_and_what_it_does_not_support_is_refused_by_name() -> None:
    """One SlidingWindowSpec group runs on the core's sliding_window; a chunked-local spec alone (without a
    full-attention group) is refused at construction, by name; KV cache events and a KV connector run with it."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, SlidingWindowSpec

    kw = _attention_kw()
    window = SlidingWindowSpec(sliding_window=64, **kw)
    build = _build_with_groups
    sched = build(make_vllm_config(block_size=16, num_blocks=64), window)
    assert sched.kv_config.sliding_window == 64 and sched.kv_config.kv_cache_groups is None
    with pytest.raises(UnsupportedFeatureError, match="chunked-local KV cache groups without a full-attention group"):
        build(make_vllm_config(block_size=16), ChunkedLocalAttentionSpec(attention_chunk_size=32, **kw))
    # A KV connector with a window, in every role: the core hands it the window's tables (kv_connector_groups).
    for role in ("kv_producer", "kv_consumer", "kv_both"):
        cfg = make_vllm_config(block_size=16, kv_connector_seed=1, kv_role=role)
        assert build(cfg, window).kv_config.kv_connector_groups
    assert build(make_vllm_config(block_size=16, kv_events=True), window).kv_config.enable_kv_cache_events


def test_multi_head_latent_attention_specs_map_to_full_attention_and_windows() -> None:
    """MLA models (DeepSeek, Kimi): an MLAAttentionSpec group is full attention to the core (alone: no groups),
    SlidingWindowMLASpec groups are windows (with bounded_replay, windows rebuilt by prefix replay); a hidden-state
    cache spec stays refused by name, and an MLA window beside a plain one of the same size (specs that differ)
    too."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        HiddenStateCacheSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    kw = _attention_kw()
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    vcfg = make_vllm_config(block_size=16, num_blocks=64)
    sched = _build_with_groups(vcfg, mla)
    assert sched.kv_config.kv_cache_groups is None and sched.kv_config.sliding_window is None
    swa = SlidingWindowMLASpec(sliding_window=64, **kw)
    sched = _build_with_groups(vcfg, mla, swa, FullAttentionSpec(**kw))
    assert sched.kv_config.kv_cache_groups == (None, 64, None)
    replayed = SlidingWindowMLASpec(sliding_window=64, bounded_replay=True, **kw)
    sched = _build_with_groups(vcfg, mla, swa, replayed)
    assert sched.kv_config.kv_cache_groups == (None, 64, 64) and sched.kv_config.prefix_replay_groups == (2,)
    assert sched.prefix_replay_tokens == 64 and sched.prefix_replay_group_ids == (2,)
    with pytest.raises(UnsupportedFeatureError, match="HiddenStateCacheSpec"):
        _build_with_groups(vcfg, mla, HiddenStateCacheSpec(**kw))
    with pytest.raises(UnsupportedFeatureError, match="same window but different specs"):
        _build_with_groups(vcfg, mla, swa, SlidingWindowSpec(sliding_window=64, **kw))


def test_bounded_replay_layouts_the_core_does_not_implement_are_refused_by_name() -> None:
    """DeepSeek V4.1's windows rebuilt by bounded prefix replay: refused by name without another attention group
    (vLLM needs one that takes part in prefix caching), with windows of two sizes (vLLM asserts one) and beside
    Mamba groups; beside groups of another block size it runs, and first among the groups with blocks smaller than
    the hashed groups' (DeepSeek V4.1's own layout: the primary group is the first group that is not replayed)."""
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec, SlidingWindowMLASpec

    kw = _attention_kw()
    mla = MLAAttentionSpec(**kw)
    vcfg = make_vllm_config(block_size=16, num_blocks=64)

    def replayed(window: int, **extra: Any) -> Any:
        return SlidingWindowMLASpec(sliding_window=window, bounded_replay=True, **{**kw, **extra})

    with pytest.raises(UnsupportedFeatureError, match="without an attention KV cache group that is not replayed"):
        _build_with_groups(vcfg, replayed(64), replayed(64))
    with pytest.raises(UnsupportedFeatureError, match="bounded-replay windows of different sizes"):
        _build_with_groups(vcfg, mla, replayed(64), replayed(32))
    mamba = MambaSpec(block_size=16, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align")
    with pytest.raises(UnsupportedFeatureError, match="beside Mamba or cross-attention groups"):
        _build_with_groups(make_vllm_config(block_size=16, mamba_cache_mode="align"), mla, replayed(64), mamba)
    # Beside groups of another block size (the scheduler block their least common multiple): it runs.
    sched = _build_with_groups(vcfg, mla, replayed(64, block_size=32), block_size=32)
    assert sched.kv_config.kv_cache_group_block_sizes == (16, 32) and sched.kv_config.prefix_replay_groups == (1,)
    # First, with blocks of 8 tokens (the hash block the full-attention group's 16, as vLLM leaves the replayed
    # window out of it), and of 12 (not dividing the block: the scheduler block 48).
    sched = _build_with_groups(vcfg, replayed(64, block_size=8), mla)
    assert sched.kv_config.kv_cache_group_block_sizes == (8, 16) and sched.kv_config.prefix_replay_groups == (0,)
    assert sched.kv_config.block_size == 16 and sched.kv_config.hash_block_size is None
    sched = _build_with_groups(vcfg, replayed(64, block_size=12), mla, block_size=48)
    assert sched.kv_config.kv_cache_group_block_sizes == (12, 16) and sched.kv_config.block_size == 16
    # With an EAGLE/MTP drafter's prefix-cache rules, whatever the replayed blocks' size.
    eagle = make_vllm_config(block_size=16, num_speculative_tokens=2, speculative_method="eagle", eagle_block_drop=True)
    for size, scheduler_block in ((8, 16), (12, 48)):
        sched = _build_with_groups(eagle, replayed(64, block_size=size), mla, block_size=scheduler_block)
        assert sched.kv_config.kv_cache_group_block_sizes == (size, 16)
        assert sched.kv_config.drop_trailing_hit_block or sched.kv_config.hash_lookahead_tokens > 0
    # A multi-module MTP drafter's prefill lookahead runs whether the replayed blocks divide the others' or not.
    mtp = make_vllm_config(block_size=16, num_speculative_tokens=3, speculative_method="eagle", eagle_block_drop=True,
                           multi_module_mtp=True)  # fmt: skip
    sched = _build_with_groups(mtp, replayed(64, block_size=8), mla)
    assert sched.kv_config.prefill_lookahead_tokens == 3
    plain_mtp = make_vllm_config(block_size=16, num_speculative_tokens=3, speculative_method="eagle",
                                 multi_module_mtp=True)  # fmt: skip
    sched = _build_with_groups(plain_mtp, mla, replayed(64, block_size=32), block_size=32)
    assert sched.kv_config.prefill_lookahead_tokens == 3 and sched.kv_config.kv_cache_group_block_sizes == (16, 32)


def test_several_kv_cache_groups_map_to_the_cores_groups_in_vllms_order() -> None:
    """Full-attention, sliding-window and chunked-local groups of one block size become the core's
    kv_cache_groups, one entry per vLLM group in vLLM's order (None for full attention, the window, or
    "chunked:<attention_chunk_size>")."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

    kw = _attention_kw()
    full, w64 = FullAttentionSpec(**kw), SlidingWindowSpec(sliding_window=64, **kw)
    w32 = SlidingWindowSpec(sliding_window=32, **kw)
    vcfg = make_vllm_config(block_size=16, num_blocks=64)
    sched = _build_with_groups(vcfg, w64, full, w32, w64)
    assert sched.kv_config.kv_cache_groups == (64, None, 32, 64)
    assert sched.kv_config.sliding_window is None
    assert sched.kv_cache_manager.num_kv_cache_groups == 4
    local = ChunkedLocalAttentionSpec(attention_chunk_size=8192, **kw)
    sched = _build_with_groups(vcfg, local, full, local)
    assert sched.kv_config.kv_cache_groups == ("chunked:8192", None, "chunked:8192")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_several_kv_cache_groups_give_the_runner_one_block_list_per_group(async_scheduling: bool) -> None:
    """NewRequestData.block_ids, CachedRequestData.new_block_ids and a resumed request's blocks carry one list per
    group, as vLLM's scheduler gives them (a window group's blocks that left the window are null blocks)."""
    cfg = make_vllm_config(block_size=4, num_blocks=12, max_model_len=64, async_scheduling=async_scheduling)
    pair = [make_scheduler(impl, cfg, kv_cache_groups=(None, 4)) for impl in ("vllm", "kvsched")]
    for s in pair:
        s.add_request(make_request("r0", list(range(3, 13)), max_tokens=12, block_size=4))
        s.add_request(make_request("r1", list(range(20, 27)), max_tokens=12, block_size=4))
    seen_new = seen_cached = seen_resumed = False
    in_flight: list[list[Any]] = []
    for _ in range(30):
        outs = [s.schedule() for s in pair]
        compare("SchedulerOutput", outs[0], outs[1])
        so = outs[1]
        for new in so.scheduled_new_reqs:
            assert len(new.block_ids) == 2
            seen_new = True
        cached = so.scheduled_cached_reqs
        for rid, blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if blocks is not None:
                assert len(blocks) == 2 and len(blocks[0]) == len(blocks[1])
                seen_cached = True
                seen_resumed = seen_resumed or rid in cached.resumed_req_ids
        in_flight.append(outs)
        if len(in_flight) > int(async_scheduling):
            done = in_flight.pop(0)
            results = [s.update_from_output(o, _mro(o, 9)) for s, o in zip(pair, done, strict=True)]
            compare("EngineCoreOutputs", results[0], results[1])
    assert seen_new and seen_cached and seen_resumed


def test_kv_cache_groups_of_different_block_sizes_run_and_what_they_do_not_support_is_refused_by_name() -> None:
    """Full-attention and sliding-window groups whose block sizes are multiples of the smallest run on the core's
    kv_cache_group_block_sizes (the core's block the smallest, vLLM's hash block), in any order; refused by name:
    a smallest block that does not divide the others', chunked-local (or cross-attention, Mamba) groups among
    them and another prefix match unit. KV cache events, KV connectors, EAGLE's prefix-cache rules and a
    multi-module MTP drafter's prefill lookahead run."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

    full, full32 = FullAttentionSpec(**_attention_kw()), FullAttentionSpec(**_attention_kw(32))
    window, window32 = (SlidingWindowSpec(sliding_window=64, **_attention_kw(b)) for b in (16, 32))
    window48 = SlidingWindowSpec(sliding_window=20, **_attention_kw(48))

    def build(vcfg: Any, *specs: Any, block_size: int = 32, hash_block_size: int = 16) -> Any:
        return _build_with_groups(vcfg, *specs, block_size=block_size, hash_block_size=hash_block_size)

    sched = build(make_vllm_config(block_size=16), full, window32)
    assert sched.kv_config.kv_cache_group_block_sizes == (16, 32) and sched.kv_config.block_size == 16
    sched = build(make_vllm_config(block_size=16), window, full32, window48, block_size=96)
    assert sched.kv_config.kv_cache_group_block_sizes == (16, 32, 48)
    # The larger blocks first (MiMo-V2: vLLM raised its full-attention layers' block size, their pages being the
    # smaller): the core's primary group is the window, of the smallest blocks.
    sched = build(make_vllm_config(block_size=16), full32, window)
    assert sched.kv_config.kv_cache_group_block_sizes == (32, 16) and sched.kv_config.block_size == 16
    assert sched.kv_config.primary_group == 1
    with pytest.raises(UnsupportedFeatureError, match="smallest block size does not divide every other cached group"):
        build(make_vllm_config(block_size=16), full32, window48, block_size=96, hash_block_size=16)
    chunked = ChunkedLocalAttentionSpec(attention_chunk_size=64, **_attention_kw(32))
    with pytest.raises(UnsupportedFeatureError, match="different block sizes with chunked-local, cross-attention"):
        build(make_vllm_config(block_size=16), full, chunked)
    with pytest.raises(UnsupportedFeatureError, match="prefix match unit other than the smallest block"):
        build(make_vllm_config(block_size=16), full, window32, hash_block_size=8)
    # KV connectors run in every role (each group's tables, and each block's cache key, at its own size)
    for role in ("kv_producer", "kv_consumer", "kv_both"):
        sched = build(make_vllm_config(block_size=16, kv_connector_seed=1, kv_role=role), full, window32)
        assert sched.kv_config.kv_connector_groups and sched.kv_config.kv_cache_group_block_sizes == (16, 32)
    # KV cache events run (the core records each group's runs at its own block size and the prompt-tail entries)
    sched = build(make_vllm_config(block_size=16, kv_events=True), window, full32)
    assert sched.kv_config.enable_kv_cache_events and sched.kv_config.kv_cache_group_block_sizes == (16, 32)
    # EAGLE/MTP drafters' prefix-cache rules run (the trailing-block drop, look-ahead hashes: each group caches
    # the blocks of its own size they allow), and so does a multi-module MTP drafter's prefill lookahead (its
    # reprefillable tail kept out of the cache as vLLM's hybrid coordinator keeps it: with the drop only).
    eagle = make_vllm_config(block_size=16, num_speculative_tokens=2, speculative_method="eagle", eagle_block_drop=True)
    sched = build(eagle, full32, window)
    assert sched.kv_config.kv_cache_group_block_sizes == (32, 16)
    assert sched.kv_config.drop_trailing_hit_block or sched.kv_config.hash_lookahead_tokens > 0
    mtp = make_vllm_config(block_size=16, num_speculative_tokens=3, speculative_method="eagle", multi_module_mtp=True)
    sched = build(mtp, full, window32)
    assert sched.kv_config.kv_cache_group_block_sizes == (16, 32) and sched.kv_config.prefill_lookahead_tokens == 3


def test_what_several_kv_cache_groups_do_not_support_is_refused_by_name() -> None:
    """Several groups with a KV connector and a chunked-local group, a victim rule other than the default,
    different block sizes, chunked-local groups without a full-attention group, or two windows (or chunked-local
    groups) of the same size with different specs (vLLM looks their prefix hits up apart) are refused at
    construction, by name."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

    kw = _attention_kw()
    full, window = FullAttentionSpec(**kw), SlidingWindowSpec(sliding_window=64, **kw)
    build = _build_with_groups
    # A KV connector in every role runs with full-attention and window groups, not with a chunked-local one.
    chunked = ChunkedLocalAttentionSpec(attention_chunk_size=32, **kw)
    for role in ("kv_producer", "kv_consumer", "kv_both"):
        cfg = make_vllm_config(block_size=16, kv_connector_seed=1, kv_role=role)
        assert build(cfg, full, window).kv_config.kv_connector_groups
        with pytest.raises(UnsupportedFeatureError, match="KV connectors with chunked-local or cross-attention"):
            build(make_vllm_config(block_size=16, kv_connector_seed=1, kv_role=role), full, chunked)
    # KV cache events run with several groups.
    assert build(make_vllm_config(block_size=16, kv_events=True), full, window).kv_config.enable_kv_cache_events
    vcfg = make_vllm_config(block_size=16)
    vcfg.additional_config = {"kvsched": {"preemption_victim": "lcf"}}
    with pytest.raises(UnsupportedFeatureError, match="preemption victim rule other than the default"):
        build(vcfg, full, window)
    # Groups of different block sizes need vLLM's scheduler block (their least common multiple).
    with pytest.raises(UnsupportedFeatureError, match="KV cache groups of different block sizes"):
        build(make_vllm_config(block_size=16), full, SlidingWindowSpec(sliding_window=64, **_attention_kw(32)))
    local = ChunkedLocalAttentionSpec(attention_chunk_size=32, **kw)
    with pytest.raises(UnsupportedFeatureError, match="chunked-local KV cache groups without a full-attention group"):
        build(make_vllm_config(block_size=16), local, window)
    other_local = ChunkedLocalAttentionSpec(attention_chunk_size=32, **_attention_kw(head_size=2))
    with pytest.raises(UnsupportedFeatureError, match="same chunk size but different specs"):
        build(make_vllm_config(block_size=16), full, local, other_local)
    other = SlidingWindowSpec(sliding_window=64, **_attention_kw(head_size=2))
    with pytest.raises(UnsupportedFeatureError, match="same window but different specs"):
        build(make_vllm_config(block_size=16), full, window, other)


@pytest.mark.parametrize(
    ("layout", "drop"),
    [
        (dict(kv_cache_groups=(None, 8)), True),
        (dict(kv_cache_groups=(6, None, 13)), True),
        (dict(sliding_window=8), True),
        (dict(kv_cache_groups=(None, 8)), False),
        (dict(kv_cache_groups=(None, "chunked:8")), False),
    ],
)
@pytest.mark.parametrize("retention", [None, 0])
def test_eagle_prefix_cache_rules_over_windows_and_groups_schedule_as_vllms_scheduler(
    layout: dict[str, Any], drop: bool, retention: int | None
) -> None:
    """An EAGLE drafter with vLLM's default prefix-cache rules on a hybrid or sliding-window model: the trailing-
    block drop (vLLM 0.33 without look-ahead hashes, vLLM 0.32 always) or look-ahead hashes (vLLM 0.33): requests
    that share prefixes hit the cache, a tight pool evicts; the same outputs as vLLM's scheduler step by step. With
    the windows' blocks retained densely and sparsely (vLLM's engine default 0: the drop's longer runs, one block
    further; on vLLM 0.32 with several groups nothing one block below a shared-prefix junction)."""
    if not drop and RULES.version == "0.32":
        pytest.skip("vLLM 0.32 has no look-ahead hashes")
    cfg = make_vllm_config(block_size=4, num_blocks=36, max_model_len=96, max_num_batched_tokens=32, max_num_seqs=6,
                           num_speculative_tokens=2, speculative_method="eagle", eagle_block_drop=True,
                           lookahead_block_hashes=not drop or RULES.version == "0.32")  # fmt: skip
    lookahead = int(getattr(cfg, "num_hash_lookahead_tokens", 0) or 0)
    assert lookahead == (0 if drop else 1)
    pair = [
        make_scheduler(impl, cfg, prefix_cache_retention_interval=retention, **layout) for impl in ("vllm", "kvsched")
    ]
    assert pair[1].kv_config.drop_trailing_hit_block is drop
    assert pair[1].kv_config.drop_junction_below is RULES.drop_junction_below
    assert _shared_prefix_waves(pair, max_tokens=6, hash_lookahead_tokens=lookahead) > 0


def _shared_prefix_waves(pair: list[Any], max_tokens: int, hash_lookahead_tokens: int = 0) -> int:
    """Four waves of five requests sharing prefixes of one token list (13 to 36 tokens, two tokens of their own
    after it; block size 4), each wave run to the end side by side; returns the admissions with a prefix hit."""
    base = [(7 * i) % 50 + 1 for i in range(40)]
    hits = 0
    for wave in range(4):
        for s in pair:
            for k in range(5):
                n = 13 + 5 * k + wave
                s.add_request(make_request(f"w{wave}r{k}", [*base[:n], 100 + k, 200 + wave], max_tokens=max_tokens + k,
                                           block_size=4, hash_lookahead_tokens=hash_lookahead_tokens))  # fmt: skip
        for _ in range(80):
            outs, _ = step_pair(pair)
            hits += sum(new.num_computed_tokens > 0 for new in outs[1].scheduled_new_reqs)
            if not pair[0].requests:
                break
        assert not pair[0].requests and not pair[1].requests
    return hits


def test_eagle_rules_vllm_does_not_have_over_groups_are_refused_by_name() -> None:
    """The trailing-block drop with a chunked-local group (vLLM's manager has none) or in the drafter's groups
    only (``is_eagle_group`` on some lookup sets) is refused at construction, by name."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

    kw = _attention_kw()
    full, window = FullAttentionSpec(**kw), SlidingWindowSpec(sliding_window=64, **kw)
    local = ChunkedLocalAttentionSpec(attention_chunk_size=32, **kw)
    cfg = make_vllm_config(block_size=16, num_speculative_tokens=2, speculative_method="eagle", eagle_block_drop=True,
                           lookahead_block_hashes=RULES.version == "0.32")  # fmt: skip
    with pytest.raises(UnsupportedFeatureError, match="trailing-block drop with chunked-local attention"):
        _build_with_groups(cfg, full, local)
    assert _build_with_groups(cfg, full, window).kv_config.drop_trailing_hit_block
    from kvsched.vllm import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    groups = [KVCacheGroupSpec(["layer0"], full), KVCacheGroupSpec(["layer1"], window)]
    groups[0].is_eagle_group = True
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    outputs = StructuredOutputManager(cfg)
    with pytest.raises(UnsupportedFeatureError, match="drafter's KV cache groups only"):
        Scheduler(vllm_config=cfg, kv_cache_config=kv_cache_config, structured_output_manager=outputs, block_size=16,
                  hash_block_size=16)  # fmt: skip


def _encoder_decoder_pair(num_blocks: int, budget: int) -> list[Any]:
    """vLLM's scheduler and kvsched's, each with a full-attention and a cross-attention group, turned into
    encoder-decoder schedulers on the built object as vLLM's tests do."""
    from vllm.v1.core.encoder_cache_manager import EncoderDecoderCacheManager

    cfg = make_vllm_config(block_size=4, num_blocks=num_blocks, max_model_len=64, enable_prefix_caching=False)
    pair = [make_scheduler(impl, cfg, kv_cache_groups=(None, "cross")) for impl in ("vllm", "kvsched")]
    for s in pair:
        s.is_encoder_decoder = True
        s.max_num_encoder_input_tokens = budget
        s.encoder_cache_manager = EncoderDecoderCacheManager(cache_size=budget)
    return pair


def test_cross_attention_groups_schedule_as_vllms_encoder_decoder_scheduler() -> None:
    """A CrossAttentionSpec group becomes the core's cross-attention group: each request's encoder output takes
    ceil(tokens / block size) blocks at its admission (again after a preemption), NewRequestData carries that
    table, scheduled_encoder_inputs and free_encoder_mm_hashes follow vLLM's EncoderDecoderCacheManager; the
    same outputs as vLLM's scheduler step by step, with preemptions in a tight pool."""
    from vllm.v1.core.single_type_kv_cache_manager import CrossAttentionManager

    pair = _encoder_decoder_pair(num_blocks=16, budget=4096)
    specs = [(6, 9, "a"), (5, 0, ""), (7, 14, "c"), (3, 4, "d")]
    for s in pair:
        for k, (n, enc, ident) in enumerate(specs):
            images = [(0, enc, f"enc-{ident}")] if enc else []
            s.add_request(make_request(f"r{k}", list(range(10 * k, 10 * k + n)), max_tokens=14, block_size=4,
                                       images=images))  # fmt: skip
    cross = [[m for m in s.kv_cache_manager.coordinator.single_type_managers] for s in pair]
    assert [isinstance(m, CrossAttentionManager) for m in cross[1]] == [False, True]
    seen = {"cross_blocks": False, "freed": False, "preempted": False, "resumed_cross": False}
    for _ in range(40):
        outs, _ = step_pair(pair)
        so = outs[1]
        for new in so.scheduled_new_reqs:
            seen["cross_blocks"] |= bool(new.block_ids[1])
        seen["freed"] |= bool(so.free_encoder_mm_hashes)
        seen["preempted"] |= bool(so.preempted_req_ids)
        cached = so.scheduled_cached_reqs
        for rid, blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if rid in cached.resumed_req_ids and blocks is not None:
                seen["resumed_cross"] |= bool(blocks[1])
        for s in pair:
            for r in s.requests:
                assert len(cross[0][1].req_to_blocks.get(r, [])) == len(cross[1][1].req_to_blocks.get(r, []))
        if not pair[0].requests:
            break
    assert all(seen.values()), seen
    assert not pair[1].requests


def test_an_encoder_decoder_model_schedules_with_vllms_encoder_budget_and_slots(monkeypatch: Any) -> None:
    """A model whose config says is_encoder_decoder (here a tiny multimodal model told so) is built as vLLM's
    engine builds its scheduler: the core's encoder_decoder mode with vLLM's encoder compute budget and an
    EncoderDecoderCacheManager's slot count; model runner V2 and a model without a cross-attention group stay
    refused by name."""
    from vllm.config import ModelConfig

    monkeypatch.setattr(ModelConfig, "is_encoder_decoder", property(lambda self: True))
    cfg = make_vllm_config(block_size=4, num_blocks=64, max_model_len=64, enable_prefix_caching=False, multimodal=True)
    pair = [make_scheduler(impl, cfg, kv_cache_groups=(None, "cross")) for impl in ("vllm", "kvsched")]
    ref, kv = pair
    assert kv.is_encoder_decoder and kv.core.config.encoder_decoder
    assert kv.max_num_encoder_input_tokens == ref.max_num_encoder_input_tokens > 0
    assert kv.core.encoder_decoder_free_slots == ref.encoder_cache_manager.num_free_slots
    with pytest.raises(UnsupportedFeatureError, match="without a cross-attention KV cache group"):
        make_scheduler("kvsched", cfg)
    with pytest.raises(UnsupportedFeatureError, match="encoder-decoder models on model runner V2"):
        make_scheduler("kvsched", cfg, kv_cache_groups=(None, "cross"), use_v2_model_runner=True)


def test_compressor_rings_run_and_what_they_do_not_support_is_refused_by_name() -> None:
    """CircularBufferSpec groups map to the core's ring groups (first or later, with prefix caching on), compressed
    full attention runs as full attention, vLLM's zeroing for several precisions is passed on, and KV connectors run
    beside rings in every role, beside attention groups of different block sizes too (the ring's entry there the
    first attention group's size); refused by name: rings with DCP and a ring size that does not divide the
    attention block."""
    import torch
    from vllm.v1.kv_cache_interface import CircularBufferSpec, FullAttentionSpec, SlidingWindowSpec

    def ring(rows: int = 8) -> Any:
        return CircularBufferSpec(block_size=rows, num_kv_heads=1, head_size=1, head_size_v=0, dtype=torch.float32)

    compressed = FullAttentionSpec(tokens_per_state=4, **_attention_kw())
    window = SlidingWindowSpec(sliding_window=64, **_attention_kw())
    sched = _build_with_groups(make_vllm_config(block_size=16), ring(), compressed, window)
    assert sched.kv_config.kv_cache_groups == ("ring", None, 64)
    assert sched.kv_config.enable_prefix_caching and not sched.kv_config.zero_new_blocks
    bf16 = {**_attention_kw(), "dtype": torch.bfloat16}
    sched = _build_with_groups(make_vllm_config(block_size=16), FullAttentionSpec(**bf16), ring())
    assert sched.kv_config.kv_cache_groups == (None, "ring") and sched.kv_config.zero_new_blocks
    for role in ("kv_producer", "kv_consumer", "kv_both"):
        vcfg = make_vllm_config(block_size=16, kv_connector_seed=1, kv_role=role)
        sched = _build_with_groups(vcfg, FullAttentionSpec(**_attention_kw()), ring())
        assert sched.kv_config.kv_connector_groups and sched.kv_config.kv_cache_groups == (None, "ring")
    # With drafts, vLLM reserves a decode step's blocks for an asynchronous load at each group's block size, a
    # ring's rows included (the core's ring_block_size); rings of different sizes are refused there.
    drafts = make_vllm_config(block_size=16, kv_connector_seed=1, num_speculative_tokens=2)
    sched = _build_with_groups(drafts, FullAttentionSpec(**_attention_kw()), ring(2))
    assert sched.kv_config.kv_cache_groups == (None, "ring") and sched.kv_config.ring_block_size == 2
    with pytest.raises(UnsupportedFeatureError, match="speculative decoding beside compressor rings of different"):
        _build_with_groups(drafts, ring(2), FullAttentionSpec(**_attention_kw()), ring(4))
    dcp = make_vllm_config(block_size=16, decode_context_parallel_size=2)
    with pytest.raises(UnsupportedFeatureError, match=r"compressor ring groups .* with decode context parallelism"):
        _build_with_groups(dcp, FullAttentionSpec(**_attention_kw(8)), ring(), block_size=16)
    with pytest.raises(UnsupportedFeatureError, match="ring groups whose block size does not divide"):
        _build_with_groups(
            make_vllm_config(block_size=16), FullAttentionSpec(**_attention_kw()), ring(32), block_size=32
        )
    sched = _build_with_groups(
        make_vllm_config(block_size=16),
        FullAttentionSpec(**_attention_kw()),
        SlidingWindowSpec(sliding_window=64, **_attention_kw(32)),
        ring(),
        block_size=32,
    )
    assert sched.kv_config.kv_cache_groups == (None, 64, "ring")
    assert sched.kv_config.kv_cache_group_block_sizes == (16, 32, 16)


def test_what_cross_attention_groups_do_not_support_is_refused_by_name() -> None:
    """Prefix caching with a cross-attention group, a cross-attention group 0, encoder-decoder scheduling without
    a cross-attention group, and a request whose encoder input exceeds the encoder budget are refused."""
    from vllm.v1.kv_cache_interface import CrossAttentionSpec, FullAttentionSpec

    kw = _attention_kw()
    full, cross = FullAttentionSpec(**kw), CrossAttentionSpec(**kw)
    with pytest.raises(UnsupportedFeatureError, match="prefix caching with a cross-attention KV cache group"):
        _build_with_groups(make_vllm_config(block_size=16), full, cross)
    with pytest.raises(UnsupportedFeatureError, match="cross-attention KV cache group first"):
        _build_with_groups(make_vllm_config(block_size=16, enable_prefix_caching=False), cross, full)
    plain = make_scheduler("kvsched", make_vllm_config(block_size=4, num_blocks=16), kv_cache_groups=(None, 8))
    with pytest.raises(UnsupportedFeatureError, match="only with a cross-attention KV cache group"):
        plain.is_encoder_decoder = True
    pair = _encoder_decoder_pair(num_blocks=16, budget=8)
    kv = pair[1]
    kv.add_request(make_request("big", [1, 2, 3], max_tokens=4, block_size=4, images=[(0, 9, "enc")]))
    out = kv.schedule()
    assert not out.scheduled_new_reqs
    (result,) = kv.update_from_output(out, _mro(out, 9)).values()
    assert result.outputs[0].finish_reason == FinishReason.ERROR


def _mamba_spec(block_size: int, mode: str = "none", num_speculative_blocks: int = 0) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=block_size,
        shapes=((1,),),
        dtypes=(torch.float32,),
        mamba_cache_mode=mode,
        num_speculative_blocks=num_speculative_blocks,
    )


def _build_mamba(vcfg: Any, *specs: Any, block_size: int | None = None, eagle_groups: tuple[int, ...] = ()) -> Any:
    """kvsched's scheduler over these groups, with the scheduler block size vLLM's engine gives it (the least
    common multiple of the groups' block sizes) unless ``block_size`` is given; ``eagle_groups``: the groups
    marked as the drafter's (``is_eagle_group``)."""
    import math

    from kvsched.vllm import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]
    for i in eagle_groups:
        groups[i].is_eagle_group = True
    size = block_size or math.lcm(*(int(spec.block_size) for spec in specs))
    return Scheduler(
        vllm_config=vcfg,
        kv_cache_config=KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups),
        structured_output_manager=StructuredOutputManager(vcfg),
        block_size=size,
        hash_block_size=size,
    )


def test_mamba_groups_map_to_the_cores_mamba_groups() -> None:
    """MambaSpec groups in mode "none" (vLLM's mode without prefix caching: a block of max_model_len tokens)
    become the core's Mamba groups in vLLM's order; the attention groups' block size is the core's, the Mamba
    spec's speculative blocks its mamba_speculative_blocks; kv_cache_manager's managers answer isinstance checks
    against vLLM's MambaManager; an EAGLE drafter keeps vLLM's default prefix-cache rules."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    kw = _attention_kw()
    vcfg = make_vllm_config(block_size=16, num_blocks=64, max_model_len=96, enable_prefix_caching=False)
    mamba = _mamba_spec(96, num_speculative_blocks=2)
    sched = _build_mamba(vcfg, mamba, FullAttentionSpec(**kw), mamba, SlidingWindowSpec(sliding_window=32, **kw))
    assert sched.kv_config.kv_cache_groups == ("mamba", None, "mamba", 32)
    assert sched.kv_config.block_size == 16 and sched.block_size == 96
    assert sched.kv_config.mamba_speculative_blocks == 2
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    assert [isinstance(m, MambaManager) for m in managers] == [True, False, True, False]
    assert [m.block_size for m in managers] == [96, 16, 96, 16]
    # An EAGLE/MTP drafter keeps vLLM's default rules: without prefix caching the trailing-block drop has no hit
    # to act on.
    eagle = make_vllm_config(block_size=16, num_blocks=64, max_model_len=96, enable_prefix_caching=False,
                             num_speculative_tokens=2, speculative_method="eagle", eagle_block_drop=True)  # fmt: skip
    sched = _build_mamba(eagle, mamba, FullAttentionSpec(**kw))
    assert sched.kv_config.drop_trailing_hit_block is False and sched.kv_config.hash_lookahead_tokens == 0


def test_mamba_groups_schedule_as_vllms_scheduler() -> None:
    """Mamba groups first (Qwen3-Next's layer order) with n-gram drafts: each request's state blocks (1 + 2
    speculative) at its admission and again after a preemption, the attention blocks each step allocates in
    new_block_ids_to_zero (vLLM zeroes them for a model with Mamba layers); the same outputs as vLLM's scheduler
    step by step in a tight pool."""
    cfg = make_vllm_config(block_size=4, num_blocks=22, max_model_len=64, enable_prefix_caching=False,
                           num_speculative_tokens=2)  # fmt: skip
    pair = [make_scheduler(impl, cfg, kv_cache_groups=("mamba", "mamba", None)) for impl in ("vllm", "kvsched")]
    for s in pair:
        for k, n in enumerate([9, 5, 13, 3]):
            s.add_request(make_request(f"r{k}", list(range(10 * k, 10 * k + n)), max_tokens=16, block_size=64))
    seen = {"state_blocks": False, "zeroed": False, "preempted": False, "resumed_state": False}
    for _ in range(60):
        outs, _ = step_pair(pair)
        so = outs[1]
        for new in so.scheduled_new_reqs:
            seen["state_blocks"] |= len(new.block_ids[0]) == len(new.block_ids[1]) == 3
        seen["zeroed"] |= bool(so.new_block_ids_to_zero)
        seen["preempted"] |= bool(so.preempted_req_ids)
        cached = so.scheduled_cached_reqs
        for rid, blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if rid in cached.resumed_req_ids and blocks is not None:
                seen["resumed_state"] |= len(blocks[0]) == 3
        if not pair[0].requests:
            break
    assert all(seen.values()), seen
    assert not pair[1].requests


def test_align_mode_mamba_groups_schedule_as_vllms_scheduler() -> None:
    """MambaSpec groups in mode "align" with prefix caching off (as vLLM's tests build the scheduler) set the
    core's mamba_align: block-sized state tables with null blocks between the states, speculative blocks moved
    forward, block-aligned prefill chunks, a running request's new Mamba entries when the attention group (its
    blocks allocated ahead for the drafter's lookahead slot) gets none; the same outputs as vLLM's scheduler step
    by step in a tight pool."""
    cfg = make_vllm_config(block_size=4, num_blocks=30, max_model_len=64, max_num_batched_tokens=64,
                           max_num_seqs=8, enable_prefix_caching=False, mamba_cache_mode="align",
                           num_speculative_tokens=1, speculative_method="eagle")  # fmt: skip
    pair = [make_scheduler(impl, cfg, kv_cache_groups=("mamba", None)) for impl in ("vllm", "kvsched")]
    assert pair[1].kv_config.mamba_align and pair[1].kv_config.mamba_speculative_blocks == 1
    for s in pair:
        for k, n in enumerate([10, 21, 6, 13]):
            s.add_request(make_request(f"r{k}", list(range(10 * k, 10 * k + n)), max_tokens=12, block_size=4))
    seen = {"nulls": False, "mamba_only": False, "cut": False, "preempted": False}
    for _ in range(80):
        outs, _ = step_pair(pair)
        so = outs[1]
        cached = so.scheduled_cached_reqs
        for blocks in cached.new_block_ids:
            seen["mamba_only"] |= blocks is not None and bool(blocks[0]) and not blocks[1]
        for new in so.scheduled_new_reqs:  # cut at the last block boundary before the prompt's last token
            end = new.num_computed_tokens + so.num_scheduled_tokens[new.req_id]
            seen["cut"] |= end < len(new.prompt_token_ids) and end % 4 == 0
        seen["preempted"] |= bool(so.preempted_req_ids)
        for rid in pair[1].requests:
            seen["nulls"] |= 0 in pair[1].kv_cache_manager.get_block_ids(rid)[0]
        if not pair[0].requests:
            break
    assert all(seen.values()), seen
    assert not pair[1].requests


def test_mamba_prefix_caching_with_a_finer_prefix_match_unit_copies_as_vllm() -> None:
    """Mode-"align" Mamba groups with prefix caching and a hash block below the block (``--prefix-match-unit``):
    vLLM's scheduler lands hits inside a block and copies the shared tail blocks (``kv_cache_block_copies``);
    kvsched.vllm does the same (the same hit, copies and block tables), and refuses by name a window group beside
    them."""
    cfg = make_vllm_config(block_size=8, num_blocks=40, max_model_len=64, max_num_batched_tokens=64,
                           max_num_seqs=4, enable_prefix_caching=True, mamba_cache_mode="align")  # fmt: skip
    scheds = [
        make_scheduler(impl, cfg, kv_cache_groups=("mamba", None), hash_block_size=4) for impl in ("vllm", "kvsched")
    ]
    assert scheds[0].kv_cache_manager.coordinator.enable_partial_hash_hits
    # The same 20 tokens twice, the second time with another tail: the first prompt's tail at 20 tokens (inside the
    # third block of 8) serves the second request's hit.
    prompt = list(range(100, 120))
    results = []
    for sched in scheds:
        sched.add_request(make_request("r0", [*prompt, 1, 2], max_tokens=2, block_size=4))
        hits, copies, tables = [], [0, 0], []
        for step in range(12):
            if step == 6:
                sched.add_request(make_request("r1", [*prompt, 3, 4, 5], max_tokens=2, block_size=4))
            so = sched.schedule()
            hits += [r.num_computed_tokens for r in so.scheduled_new_reqs if r.req_id == "r1"]
            copies[step >= 6] += len(so.kv_cache_block_copies or ())
            tables += [(r.req_id, r.block_ids) for r in so.scheduled_new_reqs]
            ids = list(so.num_scheduled_tokens)
            sampled = [[] if sched.requests[r].is_prefill_chunk else [9] for r in ids]
            sched.update_from_output(so, runner_output(ids, sampled))
        results.append((hits, copies, tables))
    # r0's state keyed at its tail, copied out before its next step; r1's shared attention block and state.
    assert results[0][:2] == ([20], [1, 2]), results[0]
    assert results[1] == results[0]
    # What it does not run with: refused by name.
    with pytest.raises(UnsupportedFeatureError, match="beside sliding-window"):
        make_scheduler("kvsched", cfg, hash_block_size=4, kv_cache_groups=("mamba", 6, None))


def test_kv_connectors_run_with_mamba_groups_and_what_they_do_not_support_is_refused_by_name() -> None:
    """A KV connector in every role (kv_producer, kv_consumer, kv_both) runs with Mamba groups in mode "none" and
    in mode "align", with prefix caching or without (the core hands it every group's blocks, and with prefix
    caching the cached Mamba states); roles that load KV with mode-"none" Mamba blocks longer than max_model_len
    are refused at construction, by name."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    kw = _attention_kw(4)
    for mode, caching in (("none", False), ("align", False), ("align", True)):
        mamba = _mamba_spec(64 if mode == "none" else 4, mode)

        def cfg(role: str, mode: str = mode, caching: bool = caching) -> Any:
            return make_vllm_config(block_size=4, num_blocks=64, max_model_len=64, enable_prefix_caching=caching,
                                    mamba_cache_mode=mode, kv_connector_seed=1, kv_role=role)  # fmt: skip

        size = 4 if mode == "align" else None
        for role in ("kv_producer", "kv_consumer", "kv_both"):
            sched = _build_mamba(cfg(role), mamba, FullAttentionSpec(**kw), block_size=size)
            assert sched.kv_config.kv_connector_groups and sched.kv_config.mamba_align == (mode == "align")
            assert sched.kv_config.enable_prefix_caching == caching
    # Mode "none" with a state block longer than max_model_len: a producer runs, the roles that load KV are refused.
    longer = _mamba_spec(128, "none")
    none_cfg = {"block_size": 4, "num_blocks": 64, "max_model_len": 64, "enable_prefix_caching": False,
                "mamba_cache_mode": "none", "kv_connector_seed": 1}  # fmt: skip
    _build_mamba(make_vllm_config(**none_cfg, kv_role="kv_producer"), longer, FullAttentionSpec(**kw))
    for role in ("kv_consumer", "kv_both"):
        with pytest.raises(UnsupportedFeatureError, match="KV connectors that load KV with Mamba blocks longer than"):
            _build_mamba(make_vllm_config(**none_cfg, kv_role=role), longer, FullAttentionSpec(**kw))


def test_a_connector_that_completes_divergent_local_hits_gets_vllms_per_group_hit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connector whose supports_divergent_local_hybrid_hits is true (vLLM's NIXL and MoRI-IO; a MultiConnector when
    every child's is) turns the core's divergent_local_hits on. With Mamba prefix caching a new request whose
    full-attention hit runs deeper than the Mamba group's is asked about with the full-attention hit; with external
    tokens it keeps that hit (the connector restores the state), without it gets the hit both groups agree on, and
    the prefill stats count that one, as vLLM's scheduler does."""
    from kvsched.vllm.testing import RandomKVConnector
    from vllm_driver import DIVERGED_HITS, _count_diverged_hits

    for multi in (False, True):
        cfg = make_vllm_config(kv_connector_seed=1, kv_connector_multi=multi, kv_connector_divergent_hits=True)
        assert make_scheduler("kvsched", cfg).core.config.divergent_local_hits
    assert not make_scheduler("kvsched", make_vllm_config(kv_connector_seed=1)).core.config.divergent_local_hits
    # External tokens by request: 8 past a diverged hit for "b", none for "c".
    script = {"b": 8}

    def matched(self: Any, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self.calls.append(("matched", request.request_id, num_computed_tokens))
        return script.get(request.request_id, 0), False

    monkeypatch.setattr(RandomKVConnector, "get_num_new_matched_tokens", matched)
    cfg = make_vllm_config(block_size=4, num_blocks=64, max_model_len=64, enable_prefix_caching=True,
                           mamba_cache_mode="align", kv_connector_seed=1, kv_role="kv_consumer",
                           kv_connector_divergent_hits=True)  # fmt: skip
    pair = tuple(make_scheduler(impl, cfg, kv_cache_groups=(None, "mamba")) for impl in ("vllm", "kvsched"))
    DIVERGED_HITS.clear()
    _count_diverged_hits(pair[0])
    prompt = list(range(1, 25))
    # "a" caches 5 full-attention blocks and its Mamba states at 20 and 24 tokens only.
    _add(pair, "a", prompt, max_tokens=1, block_size=4)
    while pair[0].requests:  # type: ignore[attr-defined]
        _step(pair)
    # "b" and "c" share 3 blocks with "a": a full-attention hit of 12 tokens, none in the Mamba group.
    _add(pair, "b", prompt[:12] + list(range(90, 100)), max_tokens=1, block_size=4)
    (out,) = _step(pair)[:1]
    assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [("b", 12 + 8)]
    _add(pair, "c", prompt[:12] + list(range(120, 130)), max_tokens=1, block_size=4)
    (out,) = _step(pair)[:1]
    assert [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [("c", 0)]
    for s in pair:
        stats = s.requests["c"].prefill_stats  # type: ignore[attr-defined]
        assert (stats.num_local_cached_tokens, stats.num_external_cached_tokens) == (0, 0)
        assert [c[2] for c in s.connector.calls if c[0] == "matched" and c[1] in "bc"] == [12, 12]  # type: ignore[attr-defined]
    assert DIVERGED_HITS == {"diverged": 2, "replaced": 1}


def test_what_align_mode_mamba_groups_do_not_support_is_refused_by_name() -> None:
    """Prefill checkpoints (num_prefill_checkpoint_blocks) without prefix caching, a Mamba block of another size
    than the attention block, a Mamba spec whose mode differs from the cache config's and EAGLE/MTP's default
    trailing-block drop are refused at construction, by name."""
    import dataclasses

    from vllm.v1.kv_cache_interface import FullAttentionSpec

    full = FullAttentionSpec(**_attention_kw(16))
    off = make_vllm_config(block_size=16, max_model_len=96, enable_prefix_caching=False, mamba_cache_mode="align")
    checkpoints = dataclasses.replace(_mamba_spec(16, "align"), num_prefill_checkpoint_blocks=1,
                                      prefill_checkpoint_alignment=1)  # fmt: skip
    with pytest.raises(UnsupportedFeatureError, match="Mamba prefill checkpoints without prefix caching"):
        _build_mamba(off, checkpoints, full)
    with pytest.raises(UnsupportedFeatureError, match="Mamba blocks of another size"):
        _build_mamba(off, _mamba_spec(32, "align"), full)
    none = make_vllm_config(block_size=16, max_model_len=96, enable_prefix_caching=False)
    with pytest.raises(UnsupportedFeatureError, match="mamba_cache_mode differs from the cache config's"):
        _build_mamba(none, _mamba_spec(16, "align"), full)
    # EAGLE/MTP's trailing-block drop (vLLM's default on 0.32, and on 0.33 without look-ahead hashes) with the
    # drafter's groups marked but not the Mamba groups (MTP on Qwen3-Next): vLLM's Mamba groups then take none of
    # the drop's rules but its checkpoint position and chunk ends, the core's with mamba_eagle_group off.
    eagle = make_vllm_config(block_size=16, max_model_len=96, mamba_cache_mode="align", num_speculative_tokens=2,
                             speculative_method="eagle", eagle_block_drop=True,
                             lookahead_block_hashes=RULES.version == "0.32")  # fmt: skip
    mamba = _mamba_spec(16, "align", num_speculative_blocks=2)
    assert _build_mamba(eagle, mamba, full).kv_config.mamba_eagle_group  # no group marked: all are the drafter's
    unmarked = _build_mamba(eagle, mamba, full, eagle_groups=(1,)).kv_config
    assert unmarked.drop_trailing_hit_block and not unmarked.mamba_eagle_group
    assert _build_mamba(eagle, mamba, full, eagle_groups=(0, 1)).kv_config.mamba_eagle_group
    # With prefill checkpoints, which the drop can key a block below their entry.
    checkpointed = dataclasses.replace(mamba, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=16)
    sched = _build_mamba(eagle, checkpointed, full)
    assert sched.kv_config.drop_trailing_hit_block and sched.kv_config.mamba_prefill_checkpoint_alignment == 16
    assert _build_mamba(off, _mamba_spec(16, "align"), full).kv_config.mamba_align


def _run_out(pair: list[Any], max_steps: int = 10) -> None:
    """Steps both schedulers until vLLM's has no request left (at most ``max_steps``); kvsched's has none then."""
    for _ in range(max_steps):
        step_pair(pair)
        if not pair[0].requests:
            break
    assert not pair[1].requests


def test_mamba_prefix_caching_defers_a_sibling_as_the_installed_vllm() -> None:
    """Two requests with a cached prompt admitted in one step: the first hits the Mamba state at the prompt's
    last block boundary before its last token and computes the rest, its cacheable tokens ending at that
    boundary. vLLM 0.32 then counts the state as cached in this step again (kvsched's
    mamba_defer_new_states_only off), so the second request's hit on it is deferred to the next step; vLLM 0.33
    admits both. The same outputs as vLLM's scheduler, step by step."""
    cfg = make_vllm_config(block_size=4, num_blocks=40, max_model_len=64, max_num_batched_tokens=64,
                           max_num_seqs=8, mamba_cache_mode="align")  # fmt: skip
    pair = [make_scheduler(impl, cfg, kv_cache_groups=("mamba", None)) for impl in ("vllm", "kvsched")]
    assert pair[1].kv_config.mamba_defer_new_states_only is RULES.mamba_defer_new_states_only
    prompt = list(range(100, 110))  # its last block boundary before its last token: 8
    for s in pair:
        s.add_request(make_request("a", prompt, max_tokens=2, block_size=4))
    _run_out(pair)
    for s in pair:
        for rid in ("b", "c"):
            s.add_request(make_request(rid, prompt, max_tokens=2, block_size=4))
    outs, _ = step_pair(pair)
    admitted = [(new.req_id, new.num_computed_tokens) for new in outs[1].scheduled_new_reqs]
    assert admitted == ([("b", 8)] if RULES.version == "0.32" else [("b", 8), ("c", 8)]), admitted
    outs, _ = step_pair(pair)
    if RULES.version == "0.32":
        assert [(new.req_id, new.num_computed_tokens) for new in outs[1].scheduled_new_reqs] == [("c", 8)]


@pytest.mark.parametrize("drop", [True, False], ids=["drop", "lookahead"])
def test_mamba_prefix_caching_with_eagle_rules_as_the_installed_vllm(drop: bool) -> None:
    """An EAGLE drafter's default prefix-cache rules beside an align-mode Mamba group with prefix caching (MTP on
    Qwen3-Next): with the trailing-block drop a 14-token prompt's first chunk ends at 8, a block below the last
    boundary that leaves a token, and a longer prompt's hit lands there (the attention hit gives up a block, and
    the Mamba state it needs is the one cached at 8); with vLLM 0.33's look-ahead hashes (0.32 always drops) the
    chunk ends at 12, a block's hash waiting for the token after it, and the hit lands at 12. The same outputs as
    vLLM's scheduler, step by step."""
    lookahead = not drop and RULES.version != "0.32"
    hashes = not drop or RULES.version == "0.32"  # vLLM 0.32 has no disable_lookahead_block_hashes
    cfg = make_vllm_config(block_size=4, num_blocks=48, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=8,
                           mamba_cache_mode="align", num_speculative_tokens=2, speculative_method="eagle",
                           eagle_block_drop=True, lookahead_block_hashes=hashes)  # fmt: skip
    pair = [make_scheduler(impl, cfg, kv_cache_groups=("mamba", None)) for impl in ("vllm", "kvsched")]
    assert pair[1].kv_config.mamba_align and pair[1].kv_config.drop_trailing_hit_block is not lookahead
    assert pair[1].kv_config.hash_lookahead_tokens == int(lookahead)
    for s in pair:
        s.add_request(make_request("a", list(range(100, 114)), max_tokens=2, block_size=4))
    chunks = []
    for _ in range(10):
        outs, _ = step_pair(pair)
        chunks.append(outs[1].num_scheduled_tokens.get("a", 0))
        if not pair[0].requests:
            break
    assert not pair[1].requests
    assert chunks[:2] == ([12, 2] if lookahead else [8, 6]), chunks
    for s in pair:
        s.add_request(make_request("b", list(range(100, 118)), max_tokens=1, block_size=4))
    outs, _ = step_pair(pair)
    assert [(new.req_id, new.num_computed_tokens) for new in outs[1].scheduled_new_reqs] == [
        ("b", 12 if lookahead else 8)
    ]


def test_mamba_prefill_checkpoint_keyed_below_its_entry_counts_as_the_installed_vllm() -> None:
    """EAGLE/MTP's trailing-block drop beside an align-mode Mamba group that declares prefill checkpoints (vLLM's
    default for Qwen3-Next with MTP on 0.32, and on 0.33 without look-ahead hashes): a 14-token prompt's one chunk
    exports the state after 8 tokens (its checkpoint, a block below the last boundary that leaves a token) into
    the block at entry 2, keyed by the hash of the block at entry 1. The prefill stats count the tokens of that
    hash (8 tokens created in the cache), not the entry's 12; a longer prompt then hits at 8. The same outputs as
    vLLM's scheduler, step by step."""
    cfg = make_vllm_config(block_size=4, num_blocks=48, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=8,
                           mamba_cache_mode="align", num_speculative_tokens=2, speculative_method="eagle",
                           eagle_block_drop=True, lookahead_block_hashes=RULES.version == "0.32")  # fmt: skip
    pair = [
        make_scheduler(impl, cfg, kv_cache_groups=("mamba", None), mamba_prefill_checkpoint_alignment=4)
        for impl in ("vllm", "kvsched")
    ]
    assert pair[1].kv_config.drop_trailing_hit_block and pair[1].kv_config.mamba_prefill_checkpoint_alignment == 4
    for s in pair:
        s.add_request(make_request("a", list(range(100, 114)), max_tokens=2, block_size=4))
    outs, results = step_pair(pair)
    assert outs[1].num_scheduled_tokens == {"a": 14}
    (out,) = results[1][0].outputs
    assert out.prefill_stats is not None and out.prefill_stats.num_cache_creation_tokens == 8
    assert pair[1].group_block_ids("a")[0][1] == 0  # the state below the checkpoint's was never computed
    _run_out(pair)
    for s in pair:
        s.add_request(make_request("b", list(range(100, 118)), max_tokens=1, block_size=4))
    outs, _ = step_pair(pair)
    assert [(new.req_id, new.num_computed_tokens) for new in outs[1].scheduled_new_reqs] == [("b", 8)]


@pytest.mark.parametrize("groups", [("mamba", None), (8, "mamba", None)], ids=["full", "window"])
@pytest.mark.parametrize("marked", [True, False], ids=["attention-marked", "none-marked"])
@pytest.mark.parametrize("retention", [None, 0], ids=["dense", "sparse"])
def test_the_drop_beside_mamba_groups_is_eagle_group_leaves_out_schedules_as_vllms_scheduler(
    groups: tuple[Any, ...], marked: bool, retention: int | None
) -> None:
    """MTP on Qwen3-Next as vLLM plans it: the trailing-block drop with is_eagle_group marking the drafter's
    attention groups but not the Mamba groups (whose lookup is then none of the drop's, whose cached tokens are
    floored to a block and which keep no state one block below a shared-prefix junction), or marking no group;
    prefill checkpoints keyed a block below their entry; the states retained densely and as vLLM's engine default
    (vLLM 0.32 keeping nothing one block below a junction). Requests sharing prefixes hit the cache in a tight
    pool; the same outputs and prefill stats as vLLM's scheduler, step by step."""
    cfg = make_vllm_config(block_size=4, num_blocks=60, max_model_len=96, max_num_batched_tokens=32, max_num_seqs=6,
                           mamba_cache_mode="align", num_speculative_tokens=2, speculative_method="eagle",
                           eagle_block_drop=True, lookahead_block_hashes=RULES.version == "0.32")  # fmt: skip
    attention = tuple(g for g, w in enumerate(groups) if w != "mamba") if marked else ()
    pair = [
        make_scheduler(
            impl,
            cfg,
            kv_cache_groups=groups,
            prefix_cache_retention_interval=retention,
            mamba_prefill_checkpoint_alignment=4,
            eagle_groups=attention,
        )
        for impl in ("vllm", "kvsched")
    ]
    kv = pair[1].kv_config
    assert kv.drop_trailing_hit_block and kv.mamba_eagle_group is not marked
    assert kv.drop_junction_below is RULES.drop_junction_below
    assert _shared_prefix_waves(pair, max_tokens=3) > 0


@pytest.mark.parametrize("marked", [True, False], ids=["attention-marked", "none-marked"])
def test_a_state_below_a_junction_is_kept_as_the_installed_vllm(marked: bool) -> None:
    """The trailing-block drop with sparse retention 0 beside a Mamba group: "a" (40 tokens) caches every
    attention block but Mamba states only where a later request resumes; "b" shares its first 24 tokens, so its
    attention hit (20 tokens after the drop) passes the Mamba hit (none) and 20 is its shared-prefix junction; its
    first chunk (the 16-token budget) ends at 16. vLLM 0.33 keeps that state, one block below the junction, for
    the Mamba groups that take the drop's rules (none marked: all groups are the drafter's), and "c", which
    diverges right after the junction, hits it (its attention hit gives up the block past 16); with the attention
    groups marked only, and on vLLM 0.32, the state is not kept and "c" hits nothing. The same outputs as vLLM's
    scheduler, step by step."""
    cfg = make_vllm_config(block_size=4, num_blocks=80, max_model_len=96, max_num_batched_tokens=16, max_num_seqs=8,
                           mamba_cache_mode="align", num_speculative_tokens=2, speculative_method="eagle",
                           eagle_block_drop=True, lookahead_block_hashes=RULES.version == "0.32")  # fmt: skip
    pair = [
        make_scheduler(
            impl,
            cfg,
            kv_cache_groups=("mamba", None),
            prefix_cache_retention_interval=0,
            eagle_groups=(1,) if marked else (),
        )
        for impl in ("vllm", "kvsched")
    ]
    assert pair[1].kv_config.drop_trailing_hit_block and pair[1].kv_config.mamba_eagle_group is not marked
    base = list(range(100, 140))
    for s in pair:
        s.add_request(make_request("a", base, max_tokens=1, block_size=4))
    _run_out(pair)
    for s in pair:
        s.add_request(make_request("b", [*base[:24], *range(300, 316)], max_tokens=1, block_size=4))
    outs, _ = step_pair(pair)
    assert [(new.req_id, new.num_computed_tokens) for new in outs[1].scheduled_new_reqs] == [("b", 0)]
    assert outs[1].num_scheduled_tokens == {"b": 16}
    for s in pair:
        s.add_request(make_request("c", [*base[:20], *range(500, 508)], max_tokens=1, block_size=4))
    outs, _ = step_pair(pair)
    kept = not marked and RULES.drop_junction_below
    assert [(new.req_id, new.num_computed_tokens) for new in outs[1].scheduled_new_reqs] == [("c", 16 if kept else 0)]


def test_a_window_looked_up_before_an_unmarked_mamba_group_drops_again_as_the_installed_vllm() -> None:
    """The trailing-block drop with is_eagle_group marking the attention groups (a window group before the Mamba
    group) and sparse retention 0: "a" (44 tokens) leaves full-attention blocks and its Mamba state at 40; "b" and
    "c" then arrive together. "b" (31 tokens) hits nothing and its first chunk caches a Mamba state at 24 in that
    step. "c" (51 tokens, sharing a's first 41) gets a full-attention hit of 36 after the drop, the window agrees,
    and the Mamba group, none of the drop's, finds only b's state of this step at 24: the candidate shortens, so
    the window is looked up again at 24 and drops again (its block past 24 was not kept), and c is admitted in the
    same step with no hit. A window that kept its first lookup's verdict would accept 24, and c would wait a step
    for b's state. The same outputs as vLLM's scheduler, step by step."""
    cfg = make_vllm_config(block_size=4, num_blocks=200, max_model_len=96, max_num_batched_tokens=64, max_num_seqs=6,
                           mamba_cache_mode="align", num_speculative_tokens=2, speculative_method="eagle",
                           eagle_block_drop=True, lookahead_block_hashes=RULES.version == "0.32")  # fmt: skip
    pair = [
        make_scheduler(
            impl, cfg, kv_cache_groups=(4, "mamba", None), prefix_cache_retention_interval=0, eagle_groups=(0, 2)
        )
        for impl in ("vllm", "kvsched")
    ]
    assert pair[1].kv_config.drop_trailing_hit_block and not pair[1].kv_config.mamba_eagle_group
    base = list(range(100, 164))
    for s in pair:
        s.add_request(make_request("a", [*base[:41], 300, 301, 302], max_tokens=1, block_size=4))
    _run_out(pair)
    for s in pair:
        s.add_request(make_request("b", [*base[:30], 400], max_tokens=1, block_size=4))
        s.add_request(make_request("c", [*base[:50], 500], max_tokens=1, block_size=4))
    outs, _ = step_pair(pair)
    assert [(new.req_id, new.num_computed_tokens) for new in outs[1].scheduled_new_reqs] == [("b", 0), ("c", 0)]
    assert outs[1].num_scheduled_tokens == {"b": 24, "c": 36}
    _run_out(pair)


def test_mamba_prefix_caching_maps_to_the_cores_align_groups_with_caching() -> None:
    """Mamba prefix caching (mamba_cache_mode "align" with prefix caching on, vLLM's default for hybrid Mamba
    models) runs on the core's align-mode groups with prefix caching, with vLLM's retention of the states (the KV
    cache config's prefix_cache_retention_interval: None dense, the engine's default 0, or an interval) passed to
    the core, KV cache events on with kv_events_config, and the Mamba groups' prefill checkpoints passed as the
    core's mamba_prefill_checkpoint_alignment (None when the spec's alignment is None); Mamba groups of different
    specs are refused at construction, by name."""
    import dataclasses

    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    full = FullAttentionSpec(**_attention_kw(16))
    on = make_vllm_config(block_size=16, max_model_len=96, mamba_cache_mode="align")
    sched = _build_mamba(on, full, _mamba_spec(16, "align"))
    assert sched.kv_config.mamba_align and sched.kv_config.enable_prefix_caching
    events = make_vllm_config(block_size=16, max_model_len=96, mamba_cache_mode="align", kv_events=True)
    assert _build_mamba(events, full, _mamba_spec(16, "align")).kv_config.enable_kv_cache_events
    assert sched.kv_config.mamba_prefill_checkpoint_alignment is None
    checkpoints = dataclasses.replace(_mamba_spec(16, "align"), num_prefill_checkpoint_blocks=1,
                                      prefill_checkpoint_alignment=8)  # fmt: skip
    assert _build_mamba(on, full, checkpoints, checkpoints).kv_config.mamba_prefill_checkpoint_alignment == 8
    unaligned = dataclasses.replace(checkpoints, prefill_checkpoint_alignment=None)
    assert _build_mamba(on, full, unaligned).kv_config.mamba_prefill_checkpoint_alignment is None
    with pytest.raises(UnsupportedFeatureError, match="Mamba KV cache groups of different specs"):
        _build_mamba(on, full, checkpoints, _mamba_spec(16, "align"))
    other = dataclasses.replace(_mamba_spec(16, "align"), shapes=((2,),))
    with pytest.raises(UnsupportedFeatureError, match="Mamba KV cache groups of different specs"):
        _build_mamba(on, _mamba_spec(16, "align"), full, other)
    assert _build_mamba(on, _mamba_spec(16, "align"), full, _mamba_spec(16, "align")).kv_config.mamba_align
    from kvsched.vllm import Scheduler

    groups = [KVCacheGroupSpec(["l0"], full), KVCacheGroupSpec(["l1"], _mamba_spec(16, "align"))]
    for interval in (None, 0, 32):
        kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups,
                           prefix_cache_retention_interval=interval)  # fmt: skip
        sched = Scheduler(vllm_config=on, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(on),
                          block_size=16, hash_block_size=16)  # fmt: skip
        assert sched.kv_config.prefix_cache_retention_interval == interval
    # Without Mamba prefix caching the interval changes nothing: the core gets None.
    off = make_vllm_config(block_size=16, max_model_len=96, enable_prefix_caching=False, mamba_cache_mode="align")
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups, prefix_cache_retention_interval=0)
    sched = Scheduler(vllm_config=off, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(off),
                      block_size=16, hash_block_size=16)  # fmt: skip
    assert sched.kv_config.prefix_cache_retention_interval is None


def test_retention_interval_reaches_the_core_for_sliding_windows() -> None:
    """A sliding-window model runs with vLLM's engine default (prefix_cache_retention_interval 0) and any
    interval vLLM takes: the KV cache config's value reaches the core with prefix caching on (None without, where
    it changes nothing). Values vLLM's scheduler rejects are rejected with the same ValueError: above 0 with no
    window or Mamba group, or not a multiple of the block size."""
    on = make_vllm_config(block_size=4, num_blocks=40, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4)
    off = make_vllm_config(block_size=4, num_blocks=40, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4,
                           enable_prefix_caching=False)  # fmt: skip
    for layout in ({"sliding_window": 8}, {"kv_cache_groups": (None, 8)}, {"kv_cache_groups": (None, 8, "chunked:8")}):
        for interval in (None, 0, 4, 12):
            s = make_scheduler("kvsched", on, prefix_cache_retention_interval=interval, **layout)
            assert s.kv_config.prefix_cache_retention_interval == interval
            s = make_scheduler("kvsched", off, prefix_cache_retention_interval=interval, **layout)
            assert s.kv_config.prefix_cache_retention_interval is None
    # KV cache events run with sparse and dense retention of windows alike.
    events = make_vllm_config(block_size=4, num_blocks=40, max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4,
                              kv_events=True)  # fmt: skip
    for interval in (None, 0, 12):
        s = make_scheduler("kvsched", events, prefix_cache_retention_interval=interval, sliding_window=8)
        assert s.kv_config.enable_kv_cache_events and s.kv_config.prefix_cache_retention_interval == interval
    # 0 on a layout without a window changes nothing (vLLM accepts it): the core gets None.
    assert (
        make_scheduler("kvsched", on, prefix_cache_retention_interval=0).kv_config.prefix_cache_retention_interval
        is None
    )
    for interval, layout in [(8, {}), (8, {"kv_cache_groups": (None, "chunked:8")}), (6, {"sliding_window": 8})]:
        for impl in ("vllm", "kvsched"):
            with pytest.raises(ValueError, match="prefix_cache_retention_interval"):
                make_scheduler(impl, on, prefix_cache_retention_interval=interval, **layout)


def test_the_reference_window_mask_is_vllms() -> None:
    """The reference's sparse retention of a window's blocks (the resumable positions and the blocks kept) is
    vLLM's replay_boundaries and SlidingWindowManager.reachable_block_mask, over block sizes, windows (one token
    included), EAGLE's drop, intervals, prompt lengths, junctions and block ranges."""
    import torch
    from kvsched.reference.kv_cache_manager import _window_reachable, _window_retained
    from vllm.v1.core.kv_cache_coordinator import replay_boundaries
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    checked = 0
    for bs, window, eagle in itertools.product((1, 4, 16), (1, 2, 5, 9, 17, 33), (False, True)):
        spec = SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float16, sliding_window=window)
        for r, num_prompt, junction in itertools.product(
            (0, bs, 2 * bs, 3 * bs, 5 * bs), (1, 4, 5, 13, 40), (0, bs, 4 * bs)
        ):
            reach = [*replay_boundaries(num_prompt, bs, eagle)]
            if junction:
                reach += [junction, junction - bs] if eagle else [junction]
            ours = _window_reachable(num_prompt, junction, bs, eagle)
            assert sorted(set(ours)) == sorted(set(reach))
            for start, end in ((0, 12), (3, 11)):
                mask = SlidingWindowManager.reachable_block_mask(
                    start, end, bs, spec, eagle, retention_interval=r, reachable_boundaries=reach
                )
                want = [True] * (end - start) if mask is None else mask
                assert [_window_retained(i, bs, window, eagle, r, ours) for i in range(start, end)] == want
                checked += 1
    assert checked == 3 * 6 * 2 * 5 * 5 * 3 * 2


# Layouts with sparse retention: a Mamba group in mode "align", one sliding window, a window beside full attention.
_SPARSE_LAYOUTS: dict[str, dict[str, Any]] = {
    "mamba": {"kv_cache_groups": (None, "mamba")},
    "window": {"sliding_window": 6},
    "full+window": {"kv_cache_groups": (None, 6)},
}


@pytest.mark.parametrize("layout", list(_SPARSE_LAYOUTS))
@pytest.mark.parametrize("retention", [0, 8, 12])
def test_sparse_retention_schedules_as_vllms_scheduler(layout: str, retention: int) -> None:
    """Sparse retention of cached Mamba states and sliding-window blocks (vLLM's engine default 0, intervals of
    two and three blocks; a window of 6 tokens needs two blocks): prompts sharing prefixes of several lengths, run
    in chunks, hit only what vLLM's scheduler keeps (the resend of a prompt, the shared-prefix junctions, the
    interval's segments); the same outputs and block tables step by step, and some admissions hit."""
    mamba = layout == "mamba"
    cfg = make_vllm_config(block_size=4, num_blocks=80, max_model_len=64, max_num_batched_tokens=8, max_num_seqs=4,
                           mamba_cache_mode="align" if mamba else "none")  # fmt: skip
    pair = [make_scheduler(impl, cfg, prefix_cache_retention_interval=retention, **_SPARSE_LAYOUTS[layout])
            for impl in ("vllm", "kvsched")]  # fmt: skip
    assert pair[1].kv_config.prefix_cache_retention_interval == retention
    base = list(range(100, 124))
    prompts = [base, [*base[:16], 1, 2, 3, 4, 5], base, base[:10] + [9] * 7, [*base[:16], 6, 7], base[:8] + [8] * 9]
    prompts += prompts[3:4] + prompts[1:2]  # two resends more
    hits = 0
    for k, prompt in enumerate(prompts):
        for s in pair:
            s.add_request(make_request(f"r{k}", prompt, max_tokens=3, block_size=4))
        for _ in range(40):
            outs, _ = step_pair(pair)
            hits += sum(r.num_computed_tokens > 0 for r in outs[0].scheduled_new_reqs)
            if not pair[0].requests:
                break
        assert not pair[1].requests
    assert hits >= 3


def test_what_mamba_groups_do_not_support_is_refused_by_name() -> None:
    """Prefix caching with mamba_cache_mode "none" (vLLM runs prefix caching with mode "align" only), a model with
    Mamba layers only, a Mamba block shorter than max_model_len and a scheduler block size other than vLLM's
    engine's are refused at construction, by name; an attention block size that is not a power of two runs."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    full = FullAttentionSpec(**_attention_kw())
    off = make_vllm_config(block_size=16, max_model_len=96, enable_prefix_caching=False)
    with pytest.raises(UnsupportedFeatureError, match=r"Mamba prefix caching \(mamba_cache_mode 'none'"):
        _build_mamba(make_vllm_config(block_size=16, max_model_len=96), _mamba_spec(96), full)
    with pytest.raises(UnsupportedFeatureError, match="Mamba layers only"):
        _build_mamba(off, _mamba_spec(96))
    with pytest.raises(UnsupportedFeatureError, match="Mamba blocks shorter than max_model_len"):
        _build_mamba(off, _mamba_spec(48), full)
    with pytest.raises(UnsupportedFeatureError, match="least common multiple"):
        _build_mamba(off, _mamba_spec(96), full, block_size=16)
    odd = FullAttentionSpec(**_attention_kw(48))
    sched = _build_mamba(make_vllm_config(block_size=48, max_model_len=96, enable_prefix_caching=False),
                         _mamba_spec(96), odd)  # fmt: skip
    assert sched.kv_config.block_size == 48


_COUNTERS = ("num_computed_tokens", "num_in_flight_tokens", "num_output_placeholders", "is_prefill_chunk")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steady_decoding_cohort_shows_vllms_counters_at_every_point(async_scheduling: bool) -> None:
    """In steady decoding the running requests' counters move through a cohort (one shared count per step
    instead of a loop over the requests): every counter reads as on vLLM's own scheduler after every call, a
    write to one member (as vLLM or a test may make) turns it back into a plain ``Request`` keeping the value
    written, and a request that leaves is a plain ``Request`` with its last counters."""
    from kvsched.vllm._cohort import CohortRequest
    from vllm.v1.request import Request

    pair = _pair(async_scheduling=async_scheduling)
    for i in range(4):
        _add(pair, f"r{i}", list(range(10 * i, 10 * i + 20)), max_tokens=40)

    def check(when: str) -> None:
        for rid, ra in pair[0].requests.items():
            rb = pair[1].requests[rid]
            for f in _COUNTERS:
                compare(f"{when}: {rid}.{f}", getattr(ra, f), getattr(rb, f))

    in_flight: list[tuple[object, object]] = []
    members_seen = 0

    def update_oldest() -> None:
        outs = in_flight.pop(0)
        results = []
        for s, so in zip(pair, outs, strict=True):
            ids = list(so.num_scheduled_tokens)  # type: ignore[attr-defined]
            live = s.requests  # type: ignore[attr-defined]
            sampled = [[] if r in live and live[r].is_prefill_chunk else [9] for r in ids]
            results.append(s.update_from_output(so, ModelRunnerOutput(  # type: ignore[attr-defined]
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
                logprobs=None, prompt_logprobs_dict={}, pooler_output=[])))  # fmt: skip
        compare("EngineCoreOutputs", results[0], results[1])
        check("after update")

    for step in range(30):
        outs = tuple(s.schedule() for s in pair)  # type: ignore[attr-defined]
        compare("SchedulerOutput", outs[0], outs[1])
        check("after schedule")
        in_flight.append(outs)
        members_seen = max(members_seen, sum(type(r) is CohortRequest for r in pair[1].requests.values()))
        if step == 12:
            # A write by someone else folds that member back with the value written.
            for s in pair:
                req = s.requests["r2"]  # type: ignore[attr-defined]
                req.num_in_flight_tokens = req.num_in_flight_tokens
            assert type(pair[1].requests["r2"]) is Request  # type: ignore[attr-defined]
            check("after a write")
        if step == 20:
            finished = [s.finish_requests("r1", RequestStatus.FINISHED_ABORTED) for s in pair]  # type: ignore[attr-defined]
            assert type(finished[1][0]) is Request
            for f in _COUNTERS:
                compare(f"aborted r1.{f}", getattr(finished[0][0], f), getattr(finished[1][0], f))
        if len(in_flight) > (1 if async_scheduling else 0):
            update_oldest()
    while in_flight:
        update_oldest()
    assert members_seen == 4


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steady_decoding_cohort_hashes_the_blocks_its_members_fill(async_scheduling: bool) -> None:
    """While a cohort holds, the members whose sampled token fills a block come from a table built when the
    cohort formed (each member's block boundary repeats every block size steps): every request's block hashes
    equal vLLM's after every update, with members whose prompts of different lengths fill blocks at different
    steps, also with a step whose update arrives after the next step formed the cohort (asynchronous
    scheduling)."""
    from kvsched.vllm._cohort import CohortRequest

    block = 4
    pair = _pair(async_scheduling=async_scheduling, block_size=block)
    for i in range(7):
        _add(pair, f"r{i}", list(range(10 * i, 10 * i + 5 + i)), max_tokens=60, block_size=block)
    in_flight: list[tuple[object, object]] = []
    filled_in_cohort = 0

    def update_oldest() -> None:
        nonlocal filled_in_cohort
        outs = in_flight.pop(0)
        ours = pair[1].requests  # type: ignore[attr-defined]
        before = {rid: len(r.block_hashes) for rid, r in ours.items() if type(r) is CohortRequest}
        for s, so in zip(pair, outs, strict=True):
            ids = list(so.num_scheduled_tokens)  # type: ignore[attr-defined]
            live = s.requests  # type: ignore[attr-defined]
            sampled = [[] if r in live and live[r].is_prefill_chunk else [9] for r in ids]
            s.update_from_output(so, ModelRunnerOutput(  # type: ignore[attr-defined]
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled,
                logprobs=None, prompt_logprobs_dict={}, pooler_output=[]))  # fmt: skip
        for rid, ra in pair[0].requests.items():  # type: ignore[attr-defined]
            compare(f"{rid}.block_hashes", ra.block_hashes, ours[rid].block_hashes)
        filled_in_cohort += sum(len(ours[rid].block_hashes) > n for rid, n in before.items() if rid in ours)

    for _ in range(40):
        outs = tuple(s.schedule() for s in pair)  # type: ignore[attr-defined]
        compare("SchedulerOutput", outs[0], outs[1])
        in_flight.append(outs)
        if len(in_flight) > (1 if async_scheduling else 0):
            update_oldest()
    while in_flight:
        update_oldest()
    # Each of the 7 members fills a block every 4 steps while the cohort holds (from step 7 to 40).
    assert filled_in_cohort >= 7 * 6


def test_steady_decoding_cohort_forms_only_after_undisturbed_steps() -> None:
    """A cohort costs more to form and break than one step's per-request updates: it forms only once the same
    requests decoded one token each for several steps in a row, and a step where a request finishes (or one
    arrives) starts the count again."""
    from kvsched.vllm._cohort import CohortRequest

    pair = _pair()
    for i in range(4):
        _add(pair, f"r{i}", list(range(10 * i, 10 * i + 20)), max_tokens=60 if i else 12)
    ours = pair[1]
    first_member_step: list[int] = []
    for step in range(40):
        _step(pair)
        if any(type(r) is CohortRequest for r in ours.requests.values()):  # type: ignore[attr-defined]
            first_member_step.append(step)
        if step == 20:
            _add(pair, "late", list(range(100, 120)), max_tokens=30)
    after = ours._cohort_after  # type: ignore[attr-defined]
    assert after > 2
    # Step 0 prefills the four requests, step 1 is the first to schedule the same ones one token each. r0
    # finishes at step 11 and "late" is scheduled first at step 21: each starts the count again.
    expected = [s for s in range(40) if after <= s < 11 or 12 + after <= s < 21 or 21 + after <= s]
    assert first_member_step == expected


def test_invalid_blocks_roll_running_requests_back_even_without_a_kv_connector() -> None:
    """vLLM applies ``invalid_block_ids`` to its running requests whatever its connector (none here, so policy
    recompute): a request holding a block named invalid (here a prefix hit shared by two requests) is cut back,
    the first in running order recomputing the shared block, and their outputs of that step are dropped;
    kvsched.vllm does the same (it used to ignore the report without a connector)."""
    from vllm.v1.outputs import KVConnectorOutput

    pair = _pair(block_size=16, num_blocks=64)
    _add(pair, "a", list(range(3, 40)), max_tokens=8)
    _step(pair)
    _add(pair, "b", list(range(3, 40)), max_tokens=8)
    outs = [s.schedule() for s in pair]  # type: ignore[attr-defined]
    compare("SchedulerOutput", outs[0], outs[1])
    vllm_sched, ks = pair
    shared = vllm_sched.kv_cache_manager.get_block_ids("a")[0][0]  # type: ignore[attr-defined]
    assert ks.kv_cache_manager.get_block_ids("b")[0][0] == shared  # type: ignore[attr-defined]
    results = []
    for s, so in zip(pair, outs, strict=True):
        ids = list(so.num_scheduled_tokens)
        mro = runner_output(ids, [[9] for _ in ids], kv_connector_output=KVConnectorOutput(invalid_block_ids={shared}))
        results.append(s.update_from_output(so, mro))  # type: ignore[attr-defined]
        assert s.requests["a"].num_computed_tokens == 0  # type: ignore[attr-defined]
        assert s.requests["a"].num_output_tokens == 1  # its token of this step was dropped
    compare("EngineCoreOutputs", results[0], results[1])
    for _ in range(3):
        _step(pair)


def _build_groups(vcfg: Any, hash_block_size: int, windows: tuple[int | None, ...] = (None, 32)) -> Any:
    """kvsched's scheduler over full-attention / sliding-window groups of the config's block size, its requests
    hashed at ``hash_block_size`` (vLLM's prefix_match_unit)."""
    from kvsched.vllm import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.structured_output import StructuredOutputManager

    kw = _attention_kw()
    specs = [FullAttentionSpec(**kw) if w is None else SlidingWindowSpec(sliding_window=w, **kw) for w in windows]
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]
    return Scheduler(
        vllm_config=vcfg,
        kv_cache_config=KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups),
        structured_output_manager=StructuredOutputManager(vcfg),
        block_size=int(vcfg.cache_config.block_size),
        hash_block_size=hash_block_size,
    )


def test_a_hash_block_smaller_than_the_block_is_supported_with_several_groups() -> None:
    """vLLM's hash_block_size below the block (prefix_match_unit) with several KV cache groups: the core chains each
    block's hash over the hash blocks; what its rules would change with is refused by name."""
    vcfg = make_vllm_config(block_size=16, num_blocks=64, max_model_len=96)
    sched = _build_groups(vcfg, 4)
    assert sched.hash_block_size == 4 and sched.kv_config.hash_block_size == 4
    assert not sched._core_keys_vllm  # the request's other hash blocks' hashes are vLLM's, not the core's
    # The block's own size changes nothing: not passed to the core.
    assert _build_groups(vcfg, 16).kv_config.hash_block_size is None
    with pytest.raises(UnsupportedFeatureError, match="does not divide the block size"):
        _build_groups(vcfg, 6)
    with pytest.raises(UnsupportedFeatureError, match="with one KV cache group"):
        _build_groups(vcfg, 4, windows=(None,))
    events = make_vllm_config(block_size=16, num_blocks=64, max_model_len=96, kv_events=True)
    with pytest.raises(UnsupportedFeatureError, match="KV cache events with a hash block smaller"):
        _build_groups(events, 4)
    connector = make_vllm_config(block_size=16, num_blocks=64, max_model_len=96, kv_connector_seed=1)
    with pytest.raises(UnsupportedFeatureError, match="KV connectors with a hash block smaller"):
        _build_groups(connector, 4)
    if RULES.version != "0.32":  # (0.32 has no auxiliary output connector)
        from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

        with pytest.raises(UnsupportedFeatureError, match="auxiliary output connector with a hash block smaller"):
            sched.aux_output_connector = AuxOutputSchedulerConnector(sched.kv_cache_manager)
        assert sched.aux_output_connector is None


def _hash_lookahead(cfg: Any) -> int:
    """The look-ahead block hashes' tokens of vLLM's engine (none on vLLM 0.32, which has no such hashes)."""
    return int(getattr(cfg, "num_hash_lookahead_tokens", 0) or 0)


def _mtp_config() -> Any:
    """A multi-module MTP drafter of 3 modules with vLLM's default prefix-cache rules (on vLLM 0.33 look-ahead
    hashes of 3 tokens), blocks of 4 tokens, a budget of 18 tokens."""
    return make_vllm_config(
        block_size=4,
        max_num_batched_tokens=18,
        max_num_seqs=4,
        num_speculative_tokens=3,
        speculative_method="eagle",
        eagle_block_drop=True,
        multi_module_mtp=True,
    )


def test_multi_module_mtp_prefill_lookahead_ends_chunks_as_vllm() -> None:
    """A multi-module MTP drafter (3 modules): vLLM never ends a prefill chunk fewer than 3 tokens before the
    prompt's end, and keeps the last 2 computed tokens out of the prefix cache; kvsched.vllm the same."""
    cfg = _mtp_config()
    assert cfg.num_prefill_lookahead_tokens == 3
    scheds = (make_scheduler("vllm", cfg), make_scheduler("kvsched", cfg))
    assert scheds[1].num_prefill_lookahead == scheds[0].num_prefill_lookahead == 3  # type: ignore[attr-defined]
    prompt = list(range(10, 30))
    _add(scheds, "r0", prompt, hash_lookahead_tokens=_hash_lookahead(cfg), block_size=4)
    first = _step(scheds)
    # 18 tokens would leave 2 of the 20: the chunk stops at 17, leaving the drafter its 3.
    assert [so.num_scheduled_tokens["r0"] for so in first] == [17, 17]  # type: ignore[attr-defined]
    for _ in range(4):
        _step(scheds)
    # A second request with the same prompt hits what each cached (compared in the outputs).
    _add(scheds, "r1", prompt, hash_lookahead_tokens=_hash_lookahead(cfg), block_size=4)
    outs = _step(scheds)
    new = [{r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs} for so in outs]  # type: ignore[attr-defined]
    assert new[0] == new[1] and new[0]["r1"] > 0


def test_windows_keep_the_extra_retained_tokens_as_vllm() -> None:
    """A sliding window tagged with extra_retained_tokens (multi-module MTP): its blocks leave the request that many
    tokens later in vLLM's manager; kvsched.vllm's block tables and KV usage follow, step by step."""
    cfg = make_vllm_config(
        block_size=4,
        max_num_batched_tokens=12,
        max_num_seqs=4,
        num_speculative_tokens=4,
        speculative_method="eagle",
        multi_module_mtp=True,
    )
    scheds = tuple(make_scheduler(impl, cfg, sliding_window=5) for impl in ("vllm", "kvsched"))
    spec = scheds[0].kv_cache_manager.kv_cache_config.kv_cache_groups[0].kv_cache_spec  # type: ignore[attr-defined]
    assert spec.extra_retained_tokens == 3
    assert scheds[1].core.config.extra_retained_tokens == 3  # type: ignore[attr-defined]
    _add(scheds, "r0", list(range(10, 50)), block_size=4)
    for _ in range(8):
        _step(scheds)
        tables = [s.kv_cache_manager.get_block_ids("r0") for s in scheds]  # type: ignore[attr-defined]
        assert [list(t) for t in tables[0]] == [list(t) for t in tables[1]]
        usage = [s.kv_cache_manager.usage for s in scheds]  # type: ignore[attr-defined]
        assert usage[0] == usage[1]


@pytest.mark.skipif(RULES.version == "0.32", reason="vLLM 0.32 has no look-ahead block hashes")
def test_multi_module_mtp_layouts_vllm_cannot_run_are_refused_or_rejected_as_vllm() -> None:
    """Multi-module MTP: vLLM rejects prefix caching with a block below the lookahead (the same ValueError here);
    look-ahead hashes of several tokens over windows without full attention (vLLM's window lookup reads past the
    request's hashes) are refused by name; align-mode Mamba groups with prefix caching are taken."""
    mtp = {"num_speculative_tokens": 3, "speculative_method": "eagle", "multi_module_mtp": True, "max_num_seqs": 4}
    small = make_vllm_config(block_size=2, eagle_block_drop=True, lookahead_block_hashes=False, **mtp)  # type: ignore[arg-type]
    for impl in ("vllm", "kvsched"):
        with pytest.raises(ValueError, match="scheduler_block_size"):
            make_scheduler(impl, small)
    hashes = make_vllm_config(block_size=4, eagle_block_drop=True, **mtp)  # type: ignore[arg-type]
    assert hashes.num_hash_lookahead_tokens == 3
    with pytest.raises(UnsupportedFeatureError, match="look-ahead block hashes of more than one token"):
        make_scheduler("kvsched", hashes, sliding_window=8)
    make_scheduler("kvsched", hashes, kv_cache_groups=(None, 8))  # a full-attention group looks up first
    mamba = make_vllm_config(block_size=4, mamba_cache_mode="align", **mtp)  # type: ignore[arg-type]
    core = make_scheduler("kvsched", mamba, kv_cache_groups=(None, "mamba")).core  # type: ignore[attr-defined]
    assert core.config.prefill_lookahead_tokens == 3 and core.config.mamba_align


def test_multi_module_mtp_admission_cut_to_nothing_is_skipped_or_ends_the_pass_as_vllm() -> None:
    """An admission whose chunk the prefill lookahead cuts to nothing (1 token of budget left, 2 of its 3 tokens
    would remain) is skipped and keeps its place in vLLM 0.33's scheduler (the one-token prompt behind it takes the
    token left); vLLM 0.32's admission pass ends there (the core's skip_lookahead_cut_admissions off); in
    kvsched.vllm's the same, step by step."""
    cfg = _mtp_config()
    scheds = (make_scheduler("vllm", cfg), make_scheduler("kvsched", cfg))
    assert scheds[1].core.config.skip_lookahead_cut_admissions is RULES.skip_lookahead_cut_admissions  # type: ignore[attr-defined]
    _add(scheds, "r0", list(range(10, 27)), hash_lookahead_tokens=_hash_lookahead(cfg), block_size=4)
    _add(scheds, "r1", [5, 6, 7], hash_lookahead_tokens=_hash_lookahead(cfg), block_size=4)
    _add(scheds, "r2", [8], hash_lookahead_tokens=_hash_lookahead(cfg), block_size=4)
    first = _step(scheds)
    expected = {"r0": 17, "r2": 1} if RULES.skip_lookahead_cut_admissions else {"r0": 17}
    assert [dict(so.num_scheduled_tokens) for so in first] == [expected] * 2  # type: ignore[attr-defined]
    second = _step(scheds)
    assert [so.num_scheduled_tokens.get("r1") for so in second] == [3, 3]  # type: ignore[attr-defined]
    for _ in range(3):
        outs = _step(scheds)
        assert dict(outs[0].num_scheduled_tokens) == dict(outs[1].num_scheduled_tokens)  # type: ignore[attr-defined]
