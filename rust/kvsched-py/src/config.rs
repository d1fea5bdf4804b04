//! Config conversion: a `kvsched.SchedulerConfig` (any object with its attributes) to `core::SchedulerConfig`,
//! and the core's default config back to a dict (for the tests that hold the two sides together).
//!
//! Each field is read by name and type-checked here; range and consistency checks are the core's
//! (`SchedulerConfig::validate`), so the Python and Rust sides cannot disagree on what is valid. An int that
//! does not fit the core's `u32` gets the core's message for the field's bounds.

use kvsched_core as core;
use kvsched_core::{CHUNKED_LOCAL, CROSS_ATTENTION, MAMBA, MAX_CHUNK_SIZE, RING};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyMapping};

use crate::convert::{int_arg, seed_bytes};
use crate::errors::{guard, map_err, py_error};

/// The core's `SchedulerConfig::default()` as a dict of the Python fields (names as strings, `None` for unset).
#[pyfunction]
pub(crate) fn _default_config(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let c = core::SchedulerConfig::default();
    let d = PyDict::new(py);
    d.set_item("block_size", c.block_size)?;
    d.set_item("num_blocks", c.num_blocks)?;
    d.set_item("max_num_seqs", c.max_num_seqs)?;
    d.set_item("max_num_batched_tokens", c.max_num_batched_tokens)?;
    d.set_item("max_model_len", c.max_model_len)?;
    d.set_item("enable_prefix_caching", c.enable_prefix_caching)?;
    d.set_item("enable_kv_cache_events", c.enable_kv_cache_events)?;
    d.set_item("enable_chunked_prefill", c.enable_chunked_prefill)?;
    d.set_item("long_prefill_token_threshold", c.long_prefill_token_threshold)?;
    d.set_item("policy", c.policy.name())?;
    d.set_item("num_lookahead_tokens", c.num_lookahead_tokens)?;
    d.set_item("num_speculative_tokens", c.num_speculative_tokens)?;
    d.set_item("prefix_hash_algo", c.prefix_hash_algo.name())?;
    d.set_item("prefix_hash_seed", c.prefix_hash_seed.as_deref().map(|b| PyBytes::new(py, b)))?;
    d.set_item("scheduler_reserve_full_isl", c.scheduler_reserve_full_isl)?;
    d.set_item("cache_aware_admission_window", c.cache_aware_admission_window)?;
    d.set_item("cache_aware_admission_threshold", c.cache_aware_admission_threshold)?;
    let weights = PyDict::new(py);
    for (tenant, w) in &c.tenant_weights {
        weights.set_item(tenant, w)?;
    }
    d.set_item("tenant_weights", weights)?;
    d.set_item("fair_prefill_weight", c.fair_prefill_weight)?;
    d.set_item("fair_decode_weight", c.fair_decode_weight)?;
    d.set_item("isolate_tenant_cache", c.isolate_tenant_cache)?;
    d.set_item("max_running_per_tenant", c.max_running_per_tenant)?;
    d.set_item("tenant_max_running", limits_dict(py, &c.tenant_max_running)?)?;
    d.set_item("max_waiting_per_tenant", c.max_waiting_per_tenant)?;
    d.set_item("tenant_max_waiting", limits_dict(py, &c.tenant_max_waiting)?)?;
    d.set_item("priority_aging_steps", c.priority_aging_steps)?;
    d.set_item("default_ttft_slo_s", c.default_ttft_slo_s)?;
    d.set_item("max_wait_steps", c.max_wait_steps)?;
    d.set_item("session_ttl_steps", c.session_ttl_steps)?;
    d.set_item("async_scheduling", c.async_scheduling)?;
    d.set_item("max_loras", c.max_loras)?;
    d.set_item("watermark", c.watermark)?;
    d.set_item("preemption_mode", c.preemption_mode.name())?;
    d.set_item("num_cpu_blocks", c.num_cpu_blocks)?;
    d.set_item("recompute_cost_per_token", c.recompute_cost_per_token)?;
    d.set_item("swap_cost_per_block", c.swap_cost_per_block)?;
    d.set_item("preemption_victim", c.preemption_victim.name())?;
    d.set_item("kv_load_failure_policy", c.kv_load_failure_policy.name())?;
    // 0: as many as max_num_seqs (Python's None).
    d.set_item("max_num_active_seqs", Some(c.max_num_active_seqs).filter(|&v| v != 0))?;
    d.set_item("long_prefill_token_threshold_adaptive", c.long_prefill_token_threshold_adaptive)?;
    d.set_item("prefill_schedule_interval", c.prefill_schedule_interval)?;
    d.set_item("park_grammar_waits", c.park_grammar_waits)?;
    d.set_item("dcp_world_size", c.dcp_world_size)?;
    d.set_item("pcp_world_size", c.pcp_world_size)?;
    d.set_item("cp_kv_cache_interleave_size", c.cp_kv_cache_interleave_size)?;
    d.set_item("max_num_encoder_input_tokens", c.max_num_encoder_input_tokens)?;
    d.set_item("encoder_cache_size", c.encoder_cache_size)?;
    d.set_item("disable_chunked_mm_input", c.disable_chunked_mm_input)?;
    d.set_item("encoder_decoder", c.encoder_decoder)?;
    d.set_item("park_kv_loads", c.park_kv_loads)?;
    d.set_item("reserve_inflight_prefills", c.reserve_inflight_prefills)?;
    d.set_item("defer_block_free", c.defer_block_free)?;
    d.set_item("defer_async_loads", c.defer_async_loads)?;
    d.set_item("drop_preempted_output", c.drop_preempted_output)?;
    d.set_item("kv_connector_groups", c.kv_connector_groups)?;
    d.set_item("divergent_local_hits", c.divergent_local_hits)?;
    d.set_item("max_loras_counts_unscheduled", c.max_loras_counts_unscheduled)?;
    d.set_item("continue_after_self_preemption", c.continue_after_self_preemption)?;
    d.set_item("skip_encoder_blocked_admissions", c.skip_encoder_blocked_admissions)?;
    d.set_item("exact_encoder_cut_and_release", c.exact_encoder_cut_and_release)?;
    d.set_item("skip_lookahead_cut_admissions", c.skip_lookahead_cut_admissions)?;
    d.set_item("cache_drafts_at_update", c.cache_drafts_at_update)?;
    d.set_item("trim_computed_on_stop", c.trim_computed_on_stop)?;
    d.set_item("cache_upto_in_flight", c.cache_upto_in_flight)?;
    d.set_item("hash_lookahead_tokens", c.hash_lookahead_tokens)?;
    d.set_item("prefill_lookahead_tokens", c.prefill_lookahead_tokens)?;
    d.set_item("extra_retained_tokens", c.extra_retained_tokens)?;
    d.set_item("hash_block_size", c.hash_block_size)?;
    d.set_item("drop_trailing_hit_block", c.drop_trailing_hit_block)?;
    d.set_item("sliding_window", c.sliding_window)?;
    let groups: Option<Vec<Py<PyAny>>> = (!c.kv_cache_groups.is_empty()).then(|| {
        c.kv_cache_groups
            .iter()
            .map(|g| match g {
                Some(CROSS_ATTENTION) => pyo3::types::PyString::new(py, "cross").into_any().unbind(),
                Some(MAMBA) => pyo3::types::PyString::new(py, "mamba").into_any().unbind(),
                Some(RING) => pyo3::types::PyString::new(py, "ring").into_any().unbind(),
                Some(w) if *w & CHUNKED_LOCAL != 0 => {
                    pyo3::types::PyString::new(py, &format!("chunked:{}", w & !CHUNKED_LOCAL))
                        .into_any()
                        .unbind()
                }
                Some(w) => pyo3::types::PyInt::new(py, *w).into_any().unbind(),
                None => py.None(),
            })
            .collect()
    });
    d.set_item("kv_cache_groups", groups)?;
    let sizes: Option<Vec<u32>> =
        (!c.kv_cache_group_block_sizes.is_empty()).then(|| c.kv_cache_group_block_sizes.clone());
    d.set_item("kv_cache_group_block_sizes", sizes.map(|v| pyo3::types::PyTuple::new(py, v)).transpose()?)?;
    d.set_item("max_num_scheduled_tokens", Some(c.max_num_scheduled_tokens).filter(|&v| v != 0))?;
    d.set_item("mamba_speculative_blocks", c.mamba_speculative_blocks)?;
    d.set_item("mamba_align", c.mamba_align)?;
    d.set_item("zero_new_blocks", c.zero_new_blocks)?;
    d.set_item("mamba_defer_new_states_only", c.mamba_defer_new_states_only)?;
    d.set_item("mamba_eagle_group", c.mamba_eagle_group)?;
    d.set_item("drop_junction_below", c.drop_junction_below)?;
    d.set_item("prefix_cache_retention_interval", c.prefix_cache_retention_interval)?;
    d.set_item("mamba_prefill_checkpoint_alignment", c.mamba_prefill_checkpoint_alignment)?;
    d.set_item("ring_block_size", c.ring_block_size)?;
    d.set_item("prefix_replay_groups", pyo3::types::PyTuple::new(py, &c.prefix_replay_groups)?)?;
    d.set_item("draft_slots", c.draft_slots)?;
    d.set_item("decode_stagger", c.decode_stagger)?;
    d.set_item("max_concurrent_batches", Some(c.max_concurrent_batches).filter(|&v| v != 0))?;
    Ok(d)
}

fn limits_dict<'py>(py: Python<'py>, limits: &[(String, u32)]) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (tenant, limit) in limits {
        d.set_item(tenant, limit)?;
    }
    Ok(d)
}

/// A per-tenant limit mapping (`tenant_max_running`, `tenant_max_waiting`): str tenants to ints; a value
/// outside the core's range gets the core's message.
fn tenant_limits(cfg: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<(String, u32)>> {
    let py = cfg.py();
    let bad = || py_error(py, "InvalidConfigError", format!("{name} must map str tenants to int limits"));
    let value = cfg.getattr(name)?;
    let mapping = value.downcast::<PyMapping>().map_err(|_| bad())?;
    let mut out = Vec::new();
    for item in mapping.items().map_err(|_| bad())?.iter() {
        let (tenant, limit) = item.extract::<(String, Bound<'_, PyAny>)>().map_err(|_| bad())?;
        if limit.is_instance_of::<PyBool>() {
            return Err(bad());
        }
        // Beyond int64: the core's message with the bound it exceeds.
        let v = limit.extract::<i64>().or_else(|_| {
            if limit.is_instance_of::<pyo3::types::PyInt>() {
                Ok(i64::MAX)
            } else {
                Err(bad())
            }
        })?;
        let v = core::config::check_tenant_limit(name, &tenant, v)
            .map_err(|m| py_error(py, "InvalidConfigError", m))?;
        out.push((tenant, v));
    }
    Ok(out)
}

/// Convert and validate `config` as `Scheduler(config)` does, without building a scheduler: the core's checks
/// alone, for tests that compare them with the Python table's.
#[pyfunction]
pub(crate) fn _validate_config(config: &Bound<'_, PyAny>) -> PyResult<()> {
    let cfg = config_from_py(config)?;
    guard(config.py(), || cfg.validate())
}

pub(crate) fn config_from_py(cfg: &Bound<'_, PyAny>) -> PyResult<core::SchedulerConfig> {
    let py = cfg.py();
    // An int outside the core's u32 (or the core's 0 standing for None) gets the field's bounds in the message.
    let out_of_bounds = |name: &str, v: i64| match core::config::int_field_bounds(name) {
        Some((min, max)) => map_err(py, core::config::int_out_of_range(name, v, min, max)),
        None => py_error(py, "InvalidConfigError", format!("{name} must be in [0, 2**32), got {v}")),
    };
    let u32_field = |name: &str| -> PyResult<u32> {
        let v = int_arg(&cfg.getattr(name)?, name, "InvalidConfigError")?;
        u32::try_from(v).map_err(|_| out_of_bounds(name, v))
    };
    let bool_field = |name: &str| -> PyResult<bool> {
        let v = cfg.getattr(name)?;
        v.downcast::<PyBool>()
            .map(|b| b.is_true())
            .map_err(|_| py_error(py, "InvalidConfigError", format!("{name} must be a bool, got {v}")))
    };
    let str_field = |name: &str| -> PyResult<String> {
        let v = cfg.getattr(name)?;
        v.extract::<String>()
            .map_err(|_| py_error(py, "InvalidConfigError", format!("{name} must be a str, got {v}")))
    };
    let f64_field = |name: &str| -> PyResult<f64> {
        let v = cfg.getattr(name)?;
        if v.is_instance_of::<PyBool>() {
            return Err(py_error(py, "InvalidConfigError", format!("{name} must be a float, got {v}")));
        }
        v.extract::<f64>()
            .map_err(|_| py_error(py, "InvalidConfigError", format!("{name} must be a float, got {v}")))
    };
    let bad_weights =
        || py_error(py, "InvalidConfigError", "tenant_weights must map str tenants to float weights".into());
    let weights = cfg.getattr("tenant_weights")?;
    let weights = weights.downcast::<PyMapping>().map_err(|_| bad_weights())?;
    let mut tenant_weights = Vec::new();
    for item in weights.items().map_err(|_| bad_weights())?.iter() {
        let (name, w) = item.extract::<(String, f64)>().map_err(|_| bad_weights())?;
        tenant_weights.push((name, w));
    }
    let policy = core::Policy::parse(&str_field("policy")?).map_err(|e| map_err(py, e))?;
    let kv_load_failure_policy = core::KvLoadFailurePolicy::parse(&str_field("kv_load_failure_policy")?)
        .map_err(|e| map_err(py, e))?;
    let algo = core::HashAlgo::parse(&str_field("prefix_hash_algo")?).map_err(|e| map_err(py, e))?;
    let preemption_mode =
        core::PreemptionMode::parse(&str_field("preemption_mode")?).map_err(|e| map_err(py, e))?;
    let preemption_victim =
        core::PreemptionVictim::parse(&str_field("preemption_victim")?).map_err(|e| map_err(py, e))?;
    Ok(core::SchedulerConfig {
        block_size: u32_field("block_size")?,
        num_blocks: u32_field("num_blocks")?,
        max_num_seqs: u32_field("max_num_seqs")?,
        max_num_batched_tokens: u32_field("max_num_batched_tokens")?,
        max_model_len: u32_field("max_model_len")?,
        enable_prefix_caching: bool_field("enable_prefix_caching")?,
        enable_kv_cache_events: bool_field("enable_kv_cache_events")?,
        enable_chunked_prefill: bool_field("enable_chunked_prefill")?,
        long_prefill_token_threshold: u32_field("long_prefill_token_threshold")?,
        policy,
        num_lookahead_tokens: u32_field("num_lookahead_tokens")?,
        num_speculative_tokens: if cfg.getattr("num_speculative_tokens")?.is_none() {
            None
        } else {
            Some(u32_field("num_speculative_tokens")?)
        },
        prefix_hash_algo: algo,
        prefix_hash_seed: hash_seed(&cfg.getattr("prefix_hash_seed")?, algo)?,
        scheduler_reserve_full_isl: bool_field("scheduler_reserve_full_isl")?,
        cache_aware_admission_window: u32_field("cache_aware_admission_window")?,
        cache_aware_admission_threshold: f64_field("cache_aware_admission_threshold")?,
        tenant_weights,
        fair_prefill_weight: f64_field("fair_prefill_weight")?,
        fair_decode_weight: f64_field("fair_decode_weight")?,
        isolate_tenant_cache: bool_field("isolate_tenant_cache")?,
        max_running_per_tenant: if cfg.getattr("max_running_per_tenant")?.is_none() {
            None
        } else {
            Some(u32_field("max_running_per_tenant")?)
        },
        tenant_max_running: tenant_limits(cfg, "tenant_max_running")?,
        max_waiting_per_tenant: if cfg.getattr("max_waiting_per_tenant")?.is_none() {
            None
        } else {
            Some(u32_field("max_waiting_per_tenant")?)
        },
        tenant_max_waiting: tenant_limits(cfg, "tenant_max_waiting")?,
        priority_aging_steps: u32_field("priority_aging_steps")?,
        default_ttft_slo_s: if cfg.getattr("default_ttft_slo_s")?.is_none() {
            None
        } else {
            Some(f64_field("default_ttft_slo_s")?)
        },
        max_wait_steps: if cfg.getattr("max_wait_steps")?.is_none() {
            None
        } else {
            Some(u32_field("max_wait_steps")?)
        },
        session_ttl_steps: u32_field("session_ttl_steps")?,
        async_scheduling: bool_field("async_scheduling")?,
        max_loras: u32_field("max_loras")?,
        watermark: f64_field("watermark")?,
        preemption_mode,
        num_cpu_blocks: u32_field("num_cpu_blocks")?,
        recompute_cost_per_token: f64_field("recompute_cost_per_token")?,
        swap_cost_per_block: f64_field("swap_cost_per_block")?,
        preemption_victim,
        kv_load_failure_policy,
        // None: as many as max_num_seqs, the core's 0; so a 0 given is out of the field's bounds.
        max_num_active_seqs: if cfg.getattr("max_num_active_seqs")?.is_none() {
            0
        } else {
            match u32_field("max_num_active_seqs")? {
                0 => return Err(out_of_bounds("max_num_active_seqs", 0)),
                v => v,
            }
        },
        long_prefill_token_threshold_adaptive: bool_field("long_prefill_token_threshold_adaptive")?,
        prefill_schedule_interval: u32_field("prefill_schedule_interval")?,
        park_grammar_waits: bool_field("park_grammar_waits")?,
        dcp_world_size: u32_field("dcp_world_size")?,
        pcp_world_size: u32_field("pcp_world_size")?,
        cp_kv_cache_interleave_size: u32_field("cp_kv_cache_interleave_size")?,
        max_num_encoder_input_tokens: u32_field("max_num_encoder_input_tokens")?,
        encoder_cache_size: u32_field("encoder_cache_size")?,
        disable_chunked_mm_input: bool_field("disable_chunked_mm_input")?,
        encoder_decoder: bool_field("encoder_decoder")?,
        park_kv_loads: bool_field("park_kv_loads")?,
        reserve_inflight_prefills: bool_field("reserve_inflight_prefills")?,
        defer_block_free: bool_field("defer_block_free")?,
        defer_async_loads: bool_field("defer_async_loads")?,
        drop_preempted_output: bool_field("drop_preempted_output")?,
        kv_connector_groups: bool_field("kv_connector_groups")?,
        divergent_local_hits: bool_field("divergent_local_hits")?,
        max_loras_counts_unscheduled: bool_field("max_loras_counts_unscheduled")?,
        continue_after_self_preemption: bool_field("continue_after_self_preemption")?,
        skip_encoder_blocked_admissions: bool_field("skip_encoder_blocked_admissions")?,
        exact_encoder_cut_and_release: bool_field("exact_encoder_cut_and_release")?,
        skip_lookahead_cut_admissions: bool_field("skip_lookahead_cut_admissions")?,
        cache_drafts_at_update: bool_field("cache_drafts_at_update")?,
        trim_computed_on_stop: bool_field("trim_computed_on_stop")?,
        cache_upto_in_flight: bool_field("cache_upto_in_flight")?,
        hash_lookahead_tokens: u32_field("hash_lookahead_tokens")?,
        prefill_lookahead_tokens: u32_field("prefill_lookahead_tokens")?,
        extra_retained_tokens: u32_field("extra_retained_tokens")?,
        hash_block_size: if cfg.getattr("hash_block_size")?.is_none() {
            None
        } else {
            Some(u32_field("hash_block_size")?)
        },
        drop_trailing_hit_block: bool_field("drop_trailing_hit_block")?,
        sliding_window: if cfg.getattr("sliding_window")?.is_none() {
            None
        } else {
            Some(u32_field("sliding_window")?)
        },
        kv_cache_groups: kv_cache_groups_field(py, &cfg.getattr("kv_cache_groups")?)?,
        kv_cache_group_block_sizes: group_block_sizes_field(&cfg.getattr("kv_cache_group_block_sizes")?)?,
        // None: max_num_batched_tokens, the core's 0; so a 0 given is out of the field's bounds.
        max_num_scheduled_tokens: if cfg.getattr("max_num_scheduled_tokens")?.is_none() {
            0
        } else {
            match u32_field("max_num_scheduled_tokens")? {
                0 => return Err(out_of_bounds("max_num_scheduled_tokens", 0)),
                v => v,
            }
        },
        draft_slots: u32_field("draft_slots")?,
        mamba_speculative_blocks: u32_field("mamba_speculative_blocks")?,
        mamba_align: bool_field("mamba_align")?,
        zero_new_blocks: bool_field("zero_new_blocks")?,
        mamba_defer_new_states_only: bool_field("mamba_defer_new_states_only")?,
        mamba_eagle_group: bool_field("mamba_eagle_group")?,
        drop_junction_below: bool_field("drop_junction_below")?,
        prefix_cache_retention_interval: if cfg.getattr("prefix_cache_retention_interval")?.is_none() {
            None
        } else {
            Some(u32_field("prefix_cache_retention_interval")?)
        },
        mamba_prefill_checkpoint_alignment: if cfg.getattr("mamba_prefill_checkpoint_alignment")?.is_none() {
            None
        } else {
            Some(u32_field("mamba_prefill_checkpoint_alignment")?)
        },
        ring_block_size: if cfg.getattr("ring_block_size")?.is_none() {
            None
        } else {
            Some(u32_field("ring_block_size")?)
        },
        prefix_replay_groups: replay_groups_field(&cfg.getattr("prefix_replay_groups")?)?,
        decode_stagger: u32_field("decode_stagger")?,
        // None: 2 with async scheduling, else 1 (the core's 0); so a 0 given is out of the field's bounds.
        max_concurrent_batches: if cfg.getattr("max_concurrent_batches")?.is_none() {
            0
        } else {
            match u32_field("max_concurrent_batches")? {
                0 => return Err(out_of_bounds("max_concurrent_batches", 0)),
                v => v,
            }
        },
    })
}

/// `kv_cache_groups`: `None` (one group) or a sequence of `None` (full attention), int windows, `"chunked:c"`
/// (chunked-local attention), `"cross"` (cross attention) and `"mamba"` (Mamba).
fn kv_cache_groups_field(py: Python<'_>, v: &Bound<'_, PyAny>) -> PyResult<Vec<Option<u32>>> {
    if v.is_none() {
        return Ok(Vec::new());
    }
    let bad = || {
        py_error(
            py,
            "InvalidConfigError",
            format!(
                "kv_cache_groups must be None or a list of None (full attention), int windows, 'chunked:<chunk \
                 size>' (chunked-local attention), 'cross' (cross attention), 'mamba' (Mamba) and 'ring' (ring \
                 buffer), got {v}"
            ),
        )
    };
    if v.is_instance_of::<pyo3::types::PyString>() || v.is_instance_of::<PyBytes>() {
        return Err(bad());
    }
    let mut groups = Vec::new();
    for item in v.try_iter().map_err(|_| bad())? {
        let item = item?;
        if item.is_none() {
            groups.push(None);
            continue;
        }
        if let Ok(name) = item.downcast::<pyo3::types::PyString>() {
            let name = name.to_cow()?;
            match &*name {
                "cross" => groups.push(Some(CROSS_ATTENTION)),
                "mamba" => groups.push(Some(MAMBA)),
                "ring" => groups.push(Some(RING)),
                _ => {
                    // "chunked:c": chunked-local attention in chunks of c tokens, c in [1, MAX_CHUNK_SIZE].
                    let chunk = name
                        .strip_prefix("chunked:")
                        .filter(|d| {
                            !d.is_empty() && !d.starts_with('0') && d.bytes().all(|b| b.is_ascii_digit())
                        })
                        .and_then(|d| d.parse::<u32>().ok())
                        .filter(|&c| c <= MAX_CHUNK_SIZE);
                    match chunk {
                        Some(c) => groups.push(Some(CHUNKED_LOCAL | c)),
                        None => return Err(bad()),
                    }
                }
            }
            continue;
        }
        if item.is_instance_of::<PyBool>() {
            return Err(bad());
        }
        let w = int_arg(&item, "kv_cache_groups", "InvalidConfigError")?;
        let w = u32::try_from(w).ok().filter(|&w| w <= i32::MAX as u32).ok_or_else(|| {
            py_error(
                py,
                "InvalidConfigError",
                format!("kv_cache_groups windows must be in [1, 2147483647], got {w}"),
            )
        })?;
        groups.push(Some(w));
    }
    Ok(groups)
}

/// `kv_cache_group_block_sizes`: `None` (every group `block_size`) or a sequence of ints.
fn group_block_sizes_field(v: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if v.is_none() {
        return Ok(Vec::new());
    }
    u32_list_field(v, "kv_cache_group_block_sizes", 1, "None or a list of ints in [1, 2147483647]")
}

/// `prefix_replay_groups`: a sequence of group indices.
fn replay_groups_field(v: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    u32_list_field(v, "prefix_replay_groups", 0, "a list of group indices (ints >= 0)")
}

/// A config field holding a sequence of ints in `[min, 2**31 - 1]` (not a str, bytes or bool): `expected` words the
/// `InvalidConfigError` otherwise.
fn u32_list_field(v: &Bound<'_, PyAny>, name: &str, min: u32, expected: &str) -> PyResult<Vec<u32>> {
    let py = v.py();
    let bad = || py_error(py, "InvalidConfigError", format!("{name} must be {expected}, got {v}"));
    if v.is_instance_of::<pyo3::types::PyString>() || v.is_instance_of::<PyBytes>() {
        return Err(bad());
    }
    let mut values = Vec::new();
    for item in v.try_iter().map_err(|_| bad())? {
        let item = item?;
        if item.is_instance_of::<PyBool>() {
            return Err(bad());
        }
        let n = int_arg(&item, name, "InvalidConfigError")?;
        values.push(u32::try_from(n).ok().filter(|&n| n >= min && n <= i32::MAX as u32).ok_or_else(bad)?);
    }
    Ok(values)
}

/// The core's `prefix_hash_seed`: with `sha256_pickle` a bytes seed is block 0's parent hash as it is, otherwise
/// the type-tagged bytes of the seed (`seed_bytes`).
fn hash_seed(obj: &Bound<'_, PyAny>, algo: core::HashAlgo) -> PyResult<Option<Vec<u8>>> {
    match obj.downcast::<PyBytes>() {
        Ok(b) if algo == core::HashAlgo::Sha256Pickle => Ok(Some(b.as_bytes().to_vec())),
        _ => seed_bytes(obj),
    }
}
