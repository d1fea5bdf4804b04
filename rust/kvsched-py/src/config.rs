//! Config conversion: a `kvsched.SchedulerConfig` (any object with its attributes) to `core::SchedulerConfig`.
//!
//! Each field is read by name and type-checked here; range and consistency checks are the core's
//! (`SchedulerConfig::validate`), so the Python and Rust sides cannot disagree on what is valid.

use kvsched_core as core;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyMapping};

use crate::convert::{int_arg, seed_bytes};
use crate::errors::{map_err, py_error};

pub(crate) fn config_from_py(cfg: &Bound<'_, PyAny>) -> PyResult<core::SchedulerConfig> {
    let py = cfg.py();
    let u32_field = |name: &str| -> PyResult<u32> {
        let v = int_arg(&cfg.getattr(name)?, name, "InvalidConfigError")?;
        u32::try_from(v)
            .map_err(|_| py_error(py, "InvalidConfigError", format!("{name} must be in [0, 2**32), got {v}")))
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
    Ok(core::SchedulerConfig {
        block_size: u32_field("block_size")?,
        num_blocks: u32_field("num_blocks")?,
        max_num_seqs: u32_field("max_num_seqs")?,
        max_num_batched_tokens: u32_field("max_num_batched_tokens")?,
        max_model_len: u32_field("max_model_len")?,
        enable_prefix_caching: bool_field("enable_prefix_caching")?,
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
        prefix_hash_seed: seed_bytes(&cfg.getattr("prefix_hash_seed")?)?,
        scheduler_reserve_full_isl: bool_field("scheduler_reserve_full_isl")?,
        cache_aware_admission_window: u32_field("cache_aware_admission_window")?,
        cache_aware_admission_threshold: f64_field("cache_aware_admission_threshold")?,
        tenant_weights,
        fair_prefill_weight: f64_field("fair_prefill_weight")?,
        fair_decode_weight: f64_field("fair_decode_weight")?,
        priority_aging_steps: u32_field("priority_aging_steps")?,
        async_scheduling: bool_field("async_scheduling")?,
        max_loras: u32_field("max_loras")?,
        watermark: f64_field("watermark")?,
        preemption_mode,
        num_cpu_blocks: u32_field("num_cpu_blocks")?,
        recompute_cost_per_token: f64_field("recompute_cost_per_token")?,
        swap_cost_per_block: f64_field("swap_cost_per_block")?,
        kv_load_failure_policy,
        // None: as many as max_num_seqs (the core's 0).
        max_num_active_seqs: if cfg.getattr("max_num_active_seqs")?.is_none() {
            0
        } else {
            u32_field("max_num_active_seqs")?
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
        park_kv_loads: bool_field("park_kv_loads")?,
        reserve_inflight_prefills: bool_field("reserve_inflight_prefills")?,
        max_loras_counts_unscheduled: bool_field("max_loras_counts_unscheduled")?,
        continue_after_self_preemption: bool_field("continue_after_self_preemption")?,
        cache_drafts_at_update: bool_field("cache_drafts_at_update")?,
        trim_computed_on_stop: bool_field("trim_computed_on_stop")?,
    })
}
