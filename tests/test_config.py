"""The configuration is declared once: the field table in ``kvsched/config.py`` drives the dataclass, its
validation and the docs table, and the Rust core agrees with it (same defaults, same verdicts, same messages)."""

from __future__ import annotations

import math
import re
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kvsched import InvalidConfigError, _core
from kvsched.config import CONFIG_FIELDS, DEFAULT_BLOCK_SIZE, ConfigField, SchedulerConfig, fields_markdown

ROOT = Path(__file__).resolve().parent.parent


def test_every_field_is_in_the_table() -> None:
    assert [f.name for f in CONFIG_FIELDS] == [f.name for f in fields(SchedulerConfig)]
    assert all(f.spec.doc for f in CONFIG_FIELDS)
    # Only these are checked by explicit code; the table states the type and range of every other field.
    assert {f.name for f in CONFIG_FIELDS if f.kind == "other"} == {
        "prefix_hash_seed",
        "tenant_weights",
        "tenant_max_running",
        "tenant_max_waiting",
        "kv_cache_groups",
        "kv_cache_group_block_sizes",
        "prefix_replay_groups",
    }
    assert SchedulerConfig().to_dict() == {f.name: f.default for f in CONFIG_FIELDS}
    assert SchedulerConfig().block_size == DEFAULT_BLOCK_SIZE


def test_the_docs_table_is_the_field_table() -> None:
    text = (ROOT / "docs" / "semantics.md").read_text(encoding="utf-8")
    section = text.split("## Configuration", 1)[1]
    start = section.index("| field | default | valid values | meaning |")
    end = section.index("\n\n", start)
    assert section[start : end + 1] == fields_markdown(), (
        "docs/semantics.md's configuration table differs from the field table in kvsched/config.py: paste "
        "the output of `python -c \"from kvsched.config import fields_markdown; print(fields_markdown(), end='')\"`"
    )


def test_the_core_defaults_are_the_python_defaults() -> None:
    core = _core._default_config()
    python = SchedulerConfig().to_dict()
    assert sorted(core) == sorted(python)
    for name, value in python.items():
        assert (core[name], type(core[name])) == (value, type(value)), name


def _bad_values(f: ConfigField) -> list[Any]:
    """Values just outside the field's valid range, from the table."""
    spec = f.spec
    if f.kind in ("int", "optional_int"):
        values: list[Any] = [spec.lo - 1, f.hi + 1]
        if spec.hi_field is not None:
            values.append(getattr(SchedulerConfig(), spec.hi_field) + 1)
        return values
    if f.kind in ("float", "optional_float"):
        values = [spec.lo - 0.5, math.nan, -math.inf]
        values += [math.inf] if spec.hi is None else [float(spec.hi) if spec.hi_open else spec.hi + 0.5]
        return values + ([float(spec.lo)] if spec.lo_open else [])
    if f.kind == "choice":
        return ["bogus", "it's"]
    return []  # bool and the two explicit fields: their bad values are bad types, which the binding refuses


def _good_values(f: ConfigField) -> list[Any]:
    """The ends of the field's valid range, from the table."""
    spec = f.spec
    if f.kind in ("int", "optional_int"):
        hi = getattr(SchedulerConfig(), spec.hi_field) if spec.hi_field is not None else f.hi
        return [spec.lo, hi, *([None] if f.kind == "optional_int" else [])]
    if f.kind in ("float", "optional_float"):
        lo = 1e-300 if spec.lo_open else float(spec.lo)
        ends = [lo, 1e300 if spec.hi is None else (0.999 if spec.hi_open else float(spec.hi))]
        return ends + ([None] if f.kind == "optional_float" else [])
    if f.kind == "choice":
        return list(f.choices)
    return []


BAD = [(f.name, v) for f in CONFIG_FIELDS for v in _bad_values(f)]
GOOD = [(f.name, v) for f in CONFIG_FIELDS for v in _good_values(f)]
# The rules between fields, and the explicit fields' values.
RULES: list[dict[str, Any]] = [
    {"block_size": 16, "hash_block_size": 6, "kv_cache_groups": (None, 8)},
    {"block_size": 16, "hash_block_size": 32, "kv_cache_groups": (None, 8)},
    {"block_size": 16, "hash_block_size": 8},
    {"block_size": 16, "hash_block_size": 8, "kv_cache_groups": (None, "mamba", 8), "mamba_align": True},
    {
        "block_size": 16,
        "hash_block_size": 8,
        "kv_cache_groups": (None, "mamba"),
        "mamba_align": True,
        "num_cpu_blocks": 4,
    },
    {"block_size": 16, "hash_block_size": 8, "kv_cache_groups": (None, 8), "hash_lookahead_tokens": 1},
    {"block_size": 16, "hash_block_size": 8, "kv_cache_groups": (None, 8), "drop_trailing_hit_block": True},
    {"block_size": 16, "hash_block_size": 8, "kv_cache_groups": (None, 8), "enable_kv_cache_events": True},
    {"max_num_batched_tokens": 8, "draft_slots": 8},
    {"extra_retained_tokens": 1},
    {"extra_retained_tokens": 1, "kv_cache_groups": (None, "chunked:8")},
    {"max_num_batched_tokens": 8, "max_num_scheduled_tokens": 9},
    {"num_blocks": 2**24, "block_size": 1024},
    {"dcp_world_size": 2, "pcp_world_size": 4},
    {"num_blocks": 2**22, "block_size": 256, "dcp_world_size": 4},
    {"max_num_seqs": 4, "max_num_active_seqs": 5},
    {"block_size": 8, "cp_kv_cache_interleave_size": 16},
    {"cp_kv_cache_interleave_size": 3},
    {"cache_aware_admission_window": 4, "policy": "fair"},
    {"cache_aware_admission_window": 4, "policy": "priority"},
    {"cache_aware_admission_window": 4, "policy": "sjf"},
    {"cache_aware_admission_window": 4, "policy": "slo"},
    {"preemption_mode": "swap"},
    {"preemption_mode": "auto"},
    {"priority_aging_steps": 3},
    {"priority_aging_steps": 3, "policy": "fair"},
    {"tenant_weights": {"a": 0.0}},
    {"tenant_weights": {"a": -1.5}},
    {"tenant_weights": {"it's": math.nan}},
    {"tenant_weights": {'say "hi"': math.inf}},
    {"tenant_weights": {"": 1.0}},
    {"mamba_speculative_blocks": 1},
    {"kv_cache_groups": (None, "mamba")},
    {"kv_cache_groups": ("mamba", "mamba"), "enable_prefix_caching": False},
    {"kv_cache_groups": ("mamba", "cross", None), "enable_prefix_caching": False},
    {"kv_cache_groups": (None, 8), "mamba_speculative_blocks": 2},
    {"prefix_cache_retention_interval": 32},
    {"prefix_cache_retention_interval": 24, "kv_cache_groups": (None, "mamba"), "mamba_align": True},
    {"prefix_cache_retention_interval": 24, "sliding_window": 64},
    {"prefix_cache_retention_interval": 16, "kv_cache_groups": (None, "chunked:64")},
    # KV cache groups of different block sizes
    {"block_size": 16, "kv_cache_group_block_sizes": (16, 32)},
    {"block_size": 16, "kv_cache_groups": (None, 8), "kv_cache_group_block_sizes": (16,)},
    {"block_size": 16, "kv_cache_groups": (None, 8), "kv_cache_group_block_sizes": (16, 24)},
    {"block_size": 16, "kv_cache_groups": (None, 8), "kv_cache_group_block_sizes": (32, 48)},
    {"block_size": 16, "kv_cache_groups": ("mamba", None), "kv_cache_group_block_sizes": (32, 32)},
    {"block_size": 16, "kv_cache_groups": (None, "chunked:64"), "kv_cache_group_block_sizes": (16, 32)},
    {
        "block_size": 16,
        "kv_cache_groups": (None, "mamba"),
        "kv_cache_group_block_sizes": (16, 32),
        "enable_prefix_caching": False,
    },
    {"block_size": 16, "kv_cache_groups": (None, 8), "kv_cache_group_block_sizes": (16, 32), "hash_block_size": 8},
    {
        "block_size": 16,
        "kv_cache_groups": (None, 8),
        "kv_cache_group_block_sizes": (16, 48),
        "prefix_cache_retention_interval": 32,
    },
    {"block_size": 16, "num_blocks": 2**20, "kv_cache_groups": (None, 8), "kv_cache_group_block_sizes": (16, 4096)},
    {"kv_cache_groups": ("ring", "ring")},
    {"kv_cache_groups": ("ring", "mamba"), "enable_prefix_caching": False},
    {"kv_cache_groups": ("ring", "cross", None), "enable_prefix_caching": False},
    {"kv_cache_groups": (None, "Ring")},
    {"kv_cache_groups": (None, f"chunked:{2**31 - 3}")},
    {"block_size": 16, "kv_cache_groups": ("ring", None), "kv_cache_group_block_sizes": (16, 32)},
    {"block_size": 16, "hash_block_size": 8, "kv_cache_groups": (None, "mamba", "ring", 8), "mamba_align": True},
    {"prefix_replay_groups": (1,)},
    {"kv_cache_groups": (None, 8), "prefix_replay_groups": (2,)},
    {"kv_cache_groups": (None, 8), "prefix_replay_groups": (1, 1)},
    {"kv_cache_groups": (None, 8, "ring"), "prefix_replay_groups": (2,)},
    {"kv_cache_groups": (None, 8, "chunked:8"), "prefix_replay_groups": (2,)},
    {"kv_cache_groups": (None, 8, 16), "prefix_replay_groups": (1, 2)},
    {"kv_cache_groups": ("ring", 8, 8), "prefix_replay_groups": (1, 2)},
    {
        "block_size": 16,
        "kv_cache_groups": (8, None),
        "prefix_replay_groups": (0,),
        "kv_cache_group_block_sizes": (2, 32),
    },
    {
        "block_size": 16,
        "kv_cache_groups": (8, None, 8),
        "prefix_replay_groups": (0,),
        "kv_cache_group_block_sizes": (2, 16, 8),
    },
    {
        "block_size": 16,
        "kv_cache_groups": (8, None),
        "prefix_replay_groups": (0,),
        "kv_cache_group_block_sizes": (0, 16),
    },
    {"kv_cache_groups": (None, "mamba", 8), "mamba_align": True, "prefix_replay_groups": (2,)},
    {
        "kv_cache_groups": (None, "cross", 8),
        "enable_prefix_caching": False,
        "encoder_decoder": True,
        "prefix_replay_groups": (2,),
    },
    {"kv_cache_groups": (None, 8), "num_cpu_blocks": 4, "prefix_replay_groups": (1,)},
]
# Combinations that are valid (each next to a rule above).
VALID_COMBOS: list[dict[str, Any]] = [
    # DeepSeek V4.1's layout: a replayed window first, of smaller blocks (any size); with an MTP drafter's rules
    # when its blocks divide the block.
    {
        "block_size": 16,
        "kv_cache_groups": (8, None, "ring"),
        "prefix_replay_groups": (0,),
        "kv_cache_group_block_sizes": (4, 16, 16),
    },
    {
        "block_size": 16,
        "kv_cache_groups": (8, None),
        "prefix_replay_groups": (0,),
        "kv_cache_group_block_sizes": (12, 16),
    },
    {
        "block_size": 16,
        "kv_cache_groups": (8, None),
        "prefix_replay_groups": (0,),
        "kv_cache_group_block_sizes": (8, 16),
        "drop_trailing_hit_block": True,
    },
    {
        "block_size": 16,
        "kv_cache_groups": (8, None),
        "prefix_replay_groups": (0,),
        "kv_cache_group_block_sizes": (8, 16),
        "hash_lookahead_tokens": 1,
    },
    {"block_size": 16, "kv_cache_groups": (None, "ring", 8), "kv_cache_group_block_sizes": (16, 16, 32)},
    {"block_size": 16, "hash_block_size": 16},
    {
        "block_size": 16,
        "kv_cache_groups": (None, 8),
        "kv_cache_group_block_sizes": (16, 32),
        "kv_connector_groups": True,
    },
    {"block_size": 12, "hash_block_size": 3, "kv_cache_groups": (None, "chunked:24", 7)},
    {"block_size": 16, "hash_block_size": 8, "kv_cache_groups": (None, "mamba"), "enable_prefix_caching": False},
    {"kv_cache_groups": ("ring", None, "ring", 8)},
    {"kv_cache_groups": ("ring", "mamba", None), "enable_prefix_caching": False},
    {"kv_cache_groups": (None, f"chunked:{2**31 - 4}")},
    {"block_size": 16, "kv_cache_groups": ("ring", None), "kv_cache_group_block_sizes": (16, 16)},
    {"block_size": 16, "hash_block_size": 8, "kv_cache_groups": (None, "mamba", "ring"), "mamba_align": True},
    {
        "block_size": 16,
        "hash_block_size": 8,
        "kv_cache_groups": (None, 8),
        "enable_prefix_caching": False,
        "hash_lookahead_tokens": 1,
        "drop_trailing_hit_block": True,
        "enable_kv_cache_events": True,
    },
    {"max_num_batched_tokens": 8, "draft_slots": 7, "max_num_scheduled_tokens": 8},
    {"num_blocks": 2**20, "block_size": 1024},
    {"dcp_world_size": 4, "pcp_world_size": 2},
    {"pcp_world_size": 3},
    {"max_num_seqs": 4, "max_num_active_seqs": 4},
    {"block_size": 8, "cp_kv_cache_interleave_size": 8},
    {"cache_aware_admission_window": 4, "policy": "fcfs"},
    {"preemption_mode": "swap", "num_cpu_blocks": 1},
    {"priority_aging_steps": 3, "policy": "priority"},
    {"tenant_weights": {"a": 1e-300, "b": 2.0}},
    {"policy": "sjf", "max_wait_steps": 3, "default_ttft_slo_s": 0.5},
    {"policy": "slo", "default_ttft_slo_s": 2.0, "session_ttl_steps": 1},
    {"kv_cache_groups": ("mamba", None, "mamba"), "enable_prefix_caching": False, "mamba_speculative_blocks": 3},
    {"prefix_cache_retention_interval": 0},
    {"prefix_cache_retention_interval": 32, "kv_cache_groups": (None, "mamba"), "mamba_align": True},
    {"prefix_cache_retention_interval": 0, "kv_cache_groups": (None, 8), "enable_prefix_caching": False},
    {"prefix_cache_retention_interval": 0, "sliding_window": 64},
    {"prefix_cache_retention_interval": 32, "kv_cache_groups": (None, 64, "chunked:64")},
    {"prefix_cache_retention_interval": 0, "kv_cache_groups": ("mamba", None, 8), "mamba_align": True},
    {"block_size": 16, "kv_cache_groups": (None, 8), "kv_cache_group_block_sizes": (16, 16)},
    {"block_size": 16, "kv_cache_groups": (8, None, 5), "kv_cache_group_block_sizes": (16, 32, 48)},
    {
        "block_size": 16,
        "kv_cache_groups": (8, None),
        "kv_cache_group_block_sizes": (16, 32),
        "enable_kv_cache_events": True,
    },
    {
        "block_size": 16,
        "kv_cache_groups": (None, 8),
        "kv_cache_group_block_sizes": (16, 48),
        "prefix_cache_retention_interval": 96,
        "hash_block_size": 16,
    },
    {"block_size": 16, "kv_cache_groups": ("mamba", None), "kv_cache_group_block_sizes": (16, 16), "mamba_align": True},
    {"prefill_lookahead_tokens": 4, "kv_cache_groups": (None, 8, "chunked:8"), "extra_retained_tokens": 3},
    {"prefill_lookahead_tokens": 1, "max_num_encoder_input_tokens": 8, "encoder_cache_size": 8},
    {"prefill_lookahead_tokens": 3, "max_num_encoder_input_tokens": 8, "encoder_cache_size": 8},
    {"prefill_lookahead_tokens": 3, "kv_cache_groups": (None, "mamba"), "enable_prefix_caching": False},
    {"prefill_lookahead_tokens": 3, "kv_cache_groups": (None, "mamba"), "mamba_align": True},
    {"kv_cache_groups": (None, 8), "prefix_replay_groups": (1,)},
    {"kv_cache_groups": ("ring", None, 8, 32, 8), "prefix_replay_groups": [4, 2]},
    {"kv_cache_groups": (16, 8), "prefix_replay_groups": (1,)},
]


def _python_verdict(changes: dict[str, Any]) -> str | None:
    try:
        SchedulerConfig(**changes)
    except InvalidConfigError as exc:
        return str(exc)
    return None


def _core_verdict(changes: dict[str, Any]) -> str | None:
    """The core's checks alone: the values reach it without passing the Python ones."""
    try:
        _core._validate_config(SimpleNamespace(**{**SchedulerConfig().to_dict(), **changes}))
    except InvalidConfigError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(("name", "value"), BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_both_sides_refuse_a_bad_value_with_the_same_message(name: str, value: Any) -> None:
    message = _python_verdict({name: value})
    assert message is not None and re.search(rf"\b{name}\b", message), message
    assert _core_verdict({name: value}) == message


# What a field's valid values need from the others.
_CONTEXT: dict[str, dict[str, Any]] = {
    "priority_aging_steps": {"policy": "priority"},
    "preemption_mode": {"num_cpu_blocks": 8},
    "draft_slots": {"max_num_batched_tokens": 2**31 - 1},
    "mamba_speculative_blocks": {"kv_cache_groups": ("mamba", None), "enable_prefix_caching": False},
    "prefix_cache_retention_interval": {"kv_cache_groups": (None, "mamba"), "mamba_align": True, "block_size": 1},
    "mamba_prefill_checkpoint_alignment": {"kv_cache_groups": (None, "mamba"), "mamba_align": True},
    "ring_block_size": {"kv_cache_groups": (None, "ring")},
    "prefix_replay_groups": {"kv_cache_groups": (None, 8)},
    "hash_block_size": {"block_size": 4096, "num_blocks": 64, "kv_cache_groups": (None, 8)},
    "extra_retained_tokens": {"sliding_window": 8},
}


@pytest.mark.parametrize(("name", "value"), GOOD, ids=[f"{n}={v!r}" for n, v in GOOD])
def test_both_sides_accept_the_ends_of_each_range(name: str, value: Any) -> None:
    changes = {**_CONTEXT.get(name, {}), name: value}
    assert (_python_verdict(changes), _core_verdict(changes)) == (None, None)


@pytest.mark.parametrize("changes", RULES, ids=[repr(c) for c in RULES])
def test_both_sides_apply_the_same_rules_between_fields(changes: dict[str, Any]) -> None:
    message = _python_verdict(changes)
    assert message is not None
    assert _core_verdict(changes) == message


@pytest.mark.parametrize("changes", VALID_COMBOS, ids=[repr(c) for c in VALID_COMBOS])
def test_both_sides_accept_the_valid_combinations(changes: dict[str, Any]) -> None:
    assert (_python_verdict(changes), _core_verdict(changes)) == (None, None)


def test_float_fields_hold_floats() -> None:
    cfg = SchedulerConfig(watermark=0, fair_decode_weight=3, cache_aware_admission_threshold=1, swap_cost_per_block=2)
    floats = [f.name for f in CONFIG_FIELDS if f.kind == "float"]
    assert len(floats) == 6 and all(type(getattr(cfg, name)) is float for name in floats)


def test_the_default_block_size_is_written_once() -> None:
    pattern = re.compile(r"block_size\s*(:\s*int\s*)?=\s*16\b|--block-size.*default=16\b")
    package = ROOT / "python" / "kvsched"
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "use kvsched.config.DEFAULT_BLOCK_SIZE:\n" + "\n".join(found)
