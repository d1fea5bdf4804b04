//! The `Scheduler` pyclass: each method converts its arguments, borrows the core, and calls it through `guard`.
//!
//! Arguments are converted before the core is borrowed (a re-entrant call gets `SchedulerError`, not a
//! panic). Ids are kept once per request (at `add_request`) in a table by slot that the step outputs share
//! (`ids.rs`); an output looks its requests' ids up when Python first asks for them.

use std::mem::ManuallyDrop;
use std::sync::Arc;

use kvsched_core as core;
use kvsched_core::{Ragged, RequestParams, SchedError};
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyInt, PyList, PyString, PyTuple};

use crate::config::config_from_py;
use crate::connector::{id_list, int_list, ConnectorHandle};
use crate::convert::{
    float_arg, id_arg, int_arg, opt_int_arg, opt_str_arg, paired_lists, str_arg, token_list, type_name,
    RaggedInput,
};
use crate::ec_connector::EcHandle;
use crate::errors::{guard, py_error, type_error};
use crate::hit_cap::HitCapHandle;
use crate::ids::IdTable;
use crate::output::{LazyArray, PyModelInputs, PySchedulerOutput, PyUpdateResult, SpareOutput};

/// The Rust scheduler. Use `kvsched.Scheduler` (a thin Python subclass that builds the config).
#[pyclass(module = "kvsched._core", name = "Scheduler", subclass)]
pub(crate) struct PyScheduler {
    core: core::Scheduler,
    /// The caller's id string of each request, by slot, shared with the outputs (`ids.rs`).
    ids: Arc<IdTable>,
    config: Py<PyAny>,
    /// The KV connector, if one was given (`connector.rs`).
    connector: Option<ConnectorHandle>,
    /// The encoder-cache connector, if one was set (`ec_connector.rs`).
    ec: Option<EcHandle>,
    /// The cache-hit cap, if one was set (`hit_cap.rs`).
    hit_cap: Option<HitCapHandle>,
    /// Where dropped outputs leave their core output for the next step (`output.rs`).
    spare: Arc<SpareOutput>,
}

/// The `(scheduler_id, step_id)` an output of `schedule()` stands for (`out` must be one).
fn step_key(py: Python<'_>, out: &Bound<'_, PyAny>) -> PyResult<(u64, u64)> {
    let o = out.downcast::<PySchedulerOutput>().map_err(|_| {
        type_error(py, format!("out must be a SchedulerOutput from schedule(), got {}", type_name(out)))
    })?;
    let o = o.try_borrow().map_err(|_| type_error(py, "out is in use".into()))?;
    Ok((o.out.scheduler_id, o.out.step_id))
}

fn borrow_mut<'py>(slf: &Bound<'py, PyScheduler>) -> PyResult<PyRefMut<'py, PyScheduler>> {
    slf.try_borrow_mut().map_err(|_| {
        py_error(slf.py(), "SchedulerError", "the scheduler is busy: a call re-entered it".into())
    })
}

fn borrow<'py>(slf: &Bound<'py, PyScheduler>) -> PyResult<PyRef<'py, PyScheduler>> {
    slf.try_borrow().map_err(|_| {
        py_error(slf.py(), "SchedulerError", "the scheduler is busy: a call re-entered it".into())
    })
}

/// A request's block ids (GPU or CPU, as `blocks` picks them) as a new int32 array; unknown ids raise.
fn block_id_array<'py>(
    slf: &Bound<'py, PyScheduler>,
    req_id: &Bound<'py, PyAny>,
    blocks: impl for<'a> FnOnce(&'a core::Scheduler, &str) -> core::Result<&'a [u32]>,
) -> PyResult<Bound<'py, PyArray1<i32>>> {
    let py = slf.py();
    let id = id_arg(req_id, "UnknownRequestError")?;
    let this = borrow(slf)?;
    let ids: Vec<i32> = guard(py, || Ok(blocks(&this.core, &id)?.iter().map(|&b| b as i32).collect()))?;
    Ok(ids.into_pyarray(py))
}

fn warn_preempted(py: Python<'_>, num: usize, total: u64) -> PyResult<()> {
    py.import("kvsched.scheduler")?.getattr("_on_preemption")?.call1((num, total))?;
    Ok(())
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (config, kv_connector=None, *_args, **_kwargs))]
    fn new(
        config: &Bound<'_, PyAny>,
        kv_connector: Option<&Bound<'_, PyAny>>,
        _args: &Bound<'_, PyTuple>,
        _kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let py = config.py();
        let cfg = config_from_py(config)?;
        let mut core = guard(py, || core::Scheduler::new(cfg))?;
        let connector = match kv_connector.filter(|c| !c.is_none()) {
            Some(obj) => {
                let (handle, hooks) = ConnectorHandle::new(obj)?;
                guard(py, || core.set_kv_connector(Some(hooks)))?;
                Some(handle)
            }
            None => None,
        };
        Ok(PyScheduler {
            core,
            ids: Arc::default(),
            config: config.clone().unbind(),
            connector,
            ec: None,
            hit_cap: None,
            spare: Arc::default(),
        })
    }

    /// Sets (None: removes) the encoder-cache connector; it applies from the next step (see docs/api.md).
    fn set_ec_connector(slf: &Bound<'_, Self>, connector: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = slf.py();
        let (handle, hooks) = if connector.is_none() {
            (None, None)
        } else {
            let (handle, hooks) = EcHandle::new(connector)?;
            (Some(handle), Some(hooks))
        };
        let mut this = borrow_mut(slf)?;
        guard(py, || this.core.set_ec_connector(hooks))?;
        this.ec = handle;
        Ok(())
    }

    /// The encoder-cache connector set with `set_ec_connector`, or None.
    #[getter]
    fn ec_connector(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.ec.as_ref().map(|c| c.obj.clone_ref(py))
    }

    /// Sets (None: removes) the cache-hit cap; it applies from the next admission (see docs/api.md).
    fn set_cache_hit_cap(slf: &Bound<'_, Self>, cap: &Bound<'_, PyAny>) -> PyResult<()> {
        let (handle, hooks) = if cap.is_none() {
            (None, None)
        } else {
            let (handle, hooks) = HitCapHandle::new(cap)?;
            (Some(handle), Some(hooks))
        };
        let mut this = borrow_mut(slf)?;
        this.core.set_cache_hit_cap(hooks);
        this.hit_cap = handle;
        Ok(())
    }

    /// The cache-hit cap set with `set_cache_hit_cap`, or None.
    #[getter]
    fn cache_hit_cap(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.hit_cap.as_ref().map(|c| c.obj.clone_ref(py))
    }

    /// The KV connector given at construction, or None.
    #[getter]
    fn kv_connector(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.connector.as_ref().map(|c| c.obj.clone_ref(py))
    }

    /// Applies what the engine reports about KV transfers (see docs/api.md). Returns the ids of requests
    /// finished because their load failed (`kv_load_failure_policy="fail"`).
    #[pyo3(signature = (finished_recving=None, finished_sending=None, failed_recving=None, invalid_block_ids=None))]
    fn update_kv_transfers(
        slf: &Bound<'_, Self>,
        finished_recving: Option<&Bound<'_, PyAny>>,
        finished_sending: Option<&Bound<'_, PyAny>>,
        failed_recving: Option<&Bound<'_, PyAny>>,
        invalid_block_ids: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<String>> {
        let py = slf.py();
        let recv = id_list(finished_recving, "finished_recving")?;
        let send = id_list(finished_sending, "finished_sending")?;
        let failed = id_list(failed_recving, "failed_recving")?;
        let invalid = int_list(invalid_block_ids, "invalid_block_ids")?;
        let mut this = borrow_mut(slf)?;
        let report = core::KvTransferReport {
            finished_recving: &recv,
            finished_sending: &send,
            failed_recving: &failed,
            invalid_block_ids: &invalid,
        };
        let errored = guard(py, || this.core.update_kv_transfers(report))?;
        if let Some(c) = &this.connector {
            // Requests failed by their load get no transfer parameters (vLLM drops them too).
            c.take_transfer_params(py)?;
        }
        this.after_hooks(py)?;
        Ok(errored.iter().map(|s| s.to_string()).collect())
    }

    /// Takes the listed blocks that carry a hash out of the prefix cache, in order (vLLM's
    /// `KVCacheManager.evict_blocks`; see docs/api.md).
    fn evict_cached_blocks(slf: &Bound<'_, Self>, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = slf.py();
        let blocks = int_list(Some(block_ids), "block_ids")?;
        let mut this = borrow_mut(slf)?;
        guard(py, || this.core.evict_cached_blocks(&blocks))?;
        this.after_hooks(py)
    }

    /// Finished requests whose blocks are still held for a KV transfer (a send, or a load they were aborted in).
    #[getter]
    fn num_held_kv_requests(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.core.num_held_kv_requests())
    }

    /// The Mamba boundary states offered to the KV connector since the last call, as `(req_id, group, block_id,
    /// num_tokens)` tuples (see docs/semantics.md, KV connectors with several groups).
    fn take_mamba_boundary_offers(slf: &Bound<'_, Self>) -> PyResult<Vec<(String, u32, u32, u32)>> {
        let mut this = borrow_mut(slf)?;
        let offers = this.core.take_mamba_boundary_offers();
        Ok(offers.into_iter().map(|(id, g, b, n)| (id.to_string(), g, b, n)).collect())
    }

    #[getter]
    fn config(&self, py: Python<'_>) -> Py<PyAny> {
        self.config.clone_ref(py)
    }

    #[pyo3(signature = (req_id, prompt_token_ids, max_tokens=None, min_tokens=None, eos_token_id=None,
        ignore_eos=None, stop_token_ids=None, priority=None, arrival_time=None, cache_salt=None, lora_name=None,
        tenant=None, ready=None, skip_reading_prefix_cache=None, encoder_inputs=None, session_id=None,
        ttft_slo_s=None, order_key=None, resumable=None, cross_attention_tokens=None))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        slf: &Bound<'_, Self>,
        req_id: &Bound<'_, PyAny>,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_tokens: Option<&Bound<'_, PyAny>>,
        min_tokens: Option<&Bound<'_, PyAny>>,
        eos_token_id: Option<&Bound<'_, PyAny>>,
        ignore_eos: Option<&Bound<'_, PyAny>>,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
        priority: Option<&Bound<'_, PyAny>>,
        arrival_time: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        lora_name: Option<&Bound<'_, PyAny>>,
        tenant: Option<&Bound<'_, PyAny>>,
        ready: Option<&Bound<'_, PyAny>>,
        skip_reading_prefix_cache: Option<&Bound<'_, PyAny>>,
        encoder_inputs: Option<&Bound<'_, PyAny>>,
        session_id: Option<&Bound<'_, PyAny>>,
        ttft_slo_s: Option<&Bound<'_, PyAny>>,
        order_key: Option<&Bound<'_, PyAny>>,
        resumable: Option<&Bound<'_, PyAny>>,
        cross_attention_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let py = slf.py();
        let bad = |msg: String| py_error(py, "InvalidRequestError", msg);
        let id = str_arg(req_id, "req_id")?;
        let prompt = token_list(prompt_token_ids, "prompt_token_ids", "InvalidRequestError")?;
        let max_tokens = max_tokens_arg(py, max_tokens)?;
        let min_tokens = match opt_int_arg(min_tokens, "min_tokens", "InvalidRequestError")? {
            None => 0,
            Some(m) if m < 0 => return Err(bad(format!("min_tokens must be >= 0, got {m}"))),
            Some(m) => u32::try_from(m).map_err(|_| {
                bad(format!("min_tokens={m} exceeds what any request can generate (max_model_len)"))
            })?,
        };
        let eos_token_id = eos_token_id_arg(py, eos_token_id)?;
        let ignore_eos = bool_arg(py, ignore_eos, "ignore_eos", false)?;
        let ready = bool_arg(py, ready, "ready", true)?;
        let skip_reading_prefix_cache =
            bool_arg(py, skip_reading_prefix_cache, "skip_reading_prefix_cache", false)?;
        let resumable = bool_arg(py, resumable, "resumable", false)?;
        let stops = stop_token_ids_arg(py, stop_token_ids)?;
        let priority = opt_int_arg(priority, "priority", "InvalidRequestError")?.unwrap_or(0);
        let arrival_time = match arrival_time {
            Some(t) if !t.is_none() => {
                if t.is_instance_of::<PyBool>() {
                    return Err(type_error(py, "arrival_time must be a float or None, got bool".into()));
                }
                match t.extract::<f64>() {
                    Ok(v) => v,
                    Err(_) if t.is_instance_of::<PyInt>() => {
                        return Err(bad(format!("arrival_time is out of range: {t}")))
                    }
                    Err(_) => {
                        return Err(type_error(
                            py,
                            format!("arrival_time must be a float or None, got {}", type_name(t)),
                        ))
                    }
                }
            }
            _ => py.import("time")?.call_method0("monotonic")?.extract::<f64>()?,
        };
        let params = RequestParams {
            max_tokens,
            min_tokens,
            eos_token_id,
            ignore_eos,
            stop_token_ids: stops,
            priority,
            arrival_time,
            cache_salt: opt_str_arg(cache_salt, "cache_salt")?,
            lora_name: opt_str_arg(lora_name, "lora_name")?,
            tenant: opt_str_arg(tenant, "tenant")?,
            waiting_for_grammar: !ready,
            skip_reading_prefix_cache,
            encoder_inputs: crate::encoder::encoder_inputs_arg(encoder_inputs)?,
            session_id: opt_str_arg(session_id, "session_id")?,
            ttft_slo_s: match ttft_slo_s {
                Some(t) if !t.is_none() => Some(float_arg(t, "ttft_slo_s")?),
                _ => None,
            },
            order_key: opt_int_arg(order_key, "order_key", "InvalidRequestError")?,
            resumable,
            cross_attention_tokens: match opt_int_arg(
                cross_attention_tokens,
                "cross_attention_tokens",
                "InvalidRequestError",
            )? {
                None => 0,
                Some(n) => u32::try_from(n).ok().filter(|&n| n <= i32::MAX as u32).ok_or_else(|| {
                    bad(format!("cross_attention_tokens must be in [0, 2147483647], got {n}"))
                })?,
            },
        };
        let id_str = id_arg(req_id, "InvalidRequestError")?;
        let mut this = borrow_mut(slf)?;
        let slot = this.core_next_slot();
        guard(py, || this.core.add_request(&id_str, &prompt, params))?;
        IdTable::set(py, &mut this.ids, slot, id.unbind());
        Ok(())
    }

    #[pyo3(signature = (throttle_prefills=None))]
    fn schedule(
        slf: &Bound<'_, Self>,
        throttle_prefills: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PySchedulerOutput>> {
        let py = slf.py();
        let throttle = match throttle_prefills {
            None => false,
            Some(t) => t.downcast::<PyBool>().map(|b| b.is_true()).map_err(|_| {
                type_error(py, format!("throttle_prefills must be a bool, got {}", type_name(t)))
            })?,
        };
        let mut this = borrow_mut(slf)?;
        if let Some(spare) = this.spare.take() {
            this.core.recycle_output(spare);
        }
        let out = guard(py, || this.core.schedule_boxed(throttle))?;
        if this.connector.is_some() {
            this.after_hooks(py)?;
        }
        if let Some(ec) = &this.ec {
            ec.check()?;
        }
        if let Some(cap) = &this.hit_cap {
            cap.check()?;
        }
        let mut preempted_ids: Vec<Py<PyString>> =
            out.preempted_before_step.iter().map(|id| PyString::new(py, id).unbind()).collect();
        for &h in &out.preempted {
            preempted_ids.push(this.ids.id(py, h)?.clone().unbind());
        }
        let ids = this.ids.clone();
        let num_preempted = preempted_ids.len();
        let total_preemptions = this.core.num_preemptions();
        let has_connector = this.connector.is_some();
        let spare = this.spare.clone();
        drop(this);
        if num_preempted > 0 {
            warn_preempted(py, num_preempted, total_preemptions)?;
        }
        let out = Py::new(
            py,
            PySchedulerOutput {
                out: ManuallyDrop::new(out),
                spare,
                ids,
                preempted_ids,
                arrays: Default::default(),
                req_ids_cache: None,
                kv_connector_metadata: None,
            },
        )?;
        if has_connector {
            // The connector's metadata for the workers (vLLM's `build_connector_meta`), built once the step is.
            let this = borrow(slf)?;
            let meta = match &this.connector {
                Some(c) => c.build_meta(py, out.bind(py).as_any())?,
                None => None,
            };
            drop(this);
            out.borrow_mut(py).kv_connector_metadata = meta;
        }
        Ok(out)
    }

    #[pyo3(signature = (out, sampled_token_ids, draft_token_ids=None))]
    fn update_from_output(
        slf: &Bound<'_, Self>,
        out: &Bound<'_, PyAny>,
        sampled_token_ids: &Bound<'_, PyAny>,
        draft_token_ids: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyUpdateResult> {
        let py = slf.py();
        let (scheduler_id, step_id) = step_key(py, out)?;
        let sampled = RaggedInput::parse(sampled_token_ids, "sampled_token_ids")?;
        let drafts = match draft_token_ids {
            Some(d) if !d.is_none() => Some(RaggedInput::parse(d, "draft_token_ids")?),
            _ => None,
        };
        let (sv, sp) = sampled.views("sampled_token_ids")?;
        let draft_views = match &drafts {
            Some(d) => Some(d.views("draft_token_ids")?),
            None => None,
        };
        let mut this = borrow_mut(slf)?;
        let res = guard(py, || {
            this.core.update_from_output(
                scheduler_id,
                step_id,
                Ragged { values: sv.as_slice(), indptr: sp.as_slice() },
                draft_views.as_ref().map(|(v, p)| Ragged { values: v.as_slice(), indptr: p.as_slice() }),
            )
        })?;
        let kv_transfer_params = match &this.connector {
            Some(c) => {
                let params = c.take_transfer_params(py)?;
                this.after_hooks(py)?;
                params
            }
            None => None,
        };
        Ok(PyUpdateResult {
            kv_transfer_params,
            finished_ids: res.finished_req_ids,
            finish_reasons: LazyArray::new(res.finish_reasons.iter().map(|&r| r as i8).collect()),
            stop_reasons: LazyArray::new(res.stop_reasons),
            num_new_tokens: LazyArray::new(res.num_new_tokens),
            finished_cache: None,
            part_finished_ids: res.part_finished_req_ids,
            part_finish_reasons: res.part_finish_reasons.iter().map(|&r| r as i8).collect(),
            part_stop_reasons: res.part_stop_reasons,
        })
    }

    #[pyo3(signature = (out, *, dcp_rank=None))]
    fn prepare_model_inputs(
        slf: &Bound<'_, Self>,
        out: &Bound<'_, PyAny>,
        dcp_rank: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyModelInputs> {
        let py = slf.py();
        let dcp_rank = match opt_int_arg(dcp_rank, "dcp_rank", "InvalidRequestError")? {
            None => 0,
            Some(r) => u32::try_from(r).map_err(|_| {
                py_error(
                    py,
                    "InvalidRequestError",
                    format!("dcp_rank must be in [0, dcp_world_size), got {r}"),
                )
            })?,
        };
        let (scheduler_id, step_id) = step_key(py, out)?;
        let this = borrow(slf)?;
        let mi = guard(py, || this.core.prepare_model_inputs_for_rank(scheduler_id, step_id, dcp_rank))?;
        drop(this);
        let n = mi.seq_lens.len();
        let num_tokens = mi.input_token_ids.len();
        let table = Array2::from_shape_vec((n, mi.max_num_blocks), mi.block_table)
            .map_err(|e| py_error(py, "InternalError", format!("block table shape: {e}")))?;
        Ok(PyModelInputs {
            input_token_ids: mi.input_token_ids.into_pyarray(py).unbind(),
            input_positions: mi.input_positions.into_pyarray(py).unbind(),
            slot_mapping: mi.slot_mapping.into_pyarray(py).unbind(),
            query_start_loc: mi.query_start_loc.into_pyarray(py).unbind(),
            seq_lens: mi.seq_lens.into_pyarray(py).unbind(),
            block_table: table.into_pyarray(py).into_any().unbind(),
            logits_indices: mi.logits_indices.into_pyarray(py).unbind(),
            num_reqs: n,
            num_tokens,
            max_seq_len: mi.max_seq_len,
            max_query_len: mi.max_query_len,
        })
    }

    fn abort_requests(slf: &Bound<'_, Self>, req_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = slf.py();
        if req_ids.is_instance_of::<PyString>() {
            return Err(type_error(py, "req_ids must be an iterable of str, not a single str".into()));
        }
        let iter = req_ids.try_iter().map_err(|_| {
            type_error(py, format!("req_ids must be an iterable of str, got {}", type_name(req_ids)))
        })?;
        let mut ids = Vec::new();
        for item in iter {
            ids.push(id_arg(&item?, "UnknownRequestError")?);
        }
        let mut this = borrow_mut(slf)?;
        guard(py, || this.core.abort_requests(&ids))?;
        if let Some(c) = &this.connector {
            // vLLM returns no transfer parameters for aborted requests either.
            c.take_transfer_params(py)?;
        }
        this.after_hooks(py)
    }

    /// vLLM's `update_draft_token_ids`: the drafts each request proposes for its next step.
    fn set_draft_token_ids(
        slf: &Bound<'_, Self>,
        req_ids: &Bound<'_, PyAny>,
        draft_token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let py = slf.py();
        if req_ids.is_instance_of::<PyString>() {
            return Err(type_error(py, "req_ids must be an iterable of str, not a single str".into()));
        }
        let iter = req_ids.try_iter().map_err(|_| {
            type_error(py, format!("req_ids must be an iterable of str, got {}", type_name(req_ids)))
        })?;
        let mut ids = Vec::new();
        for item in iter {
            ids.push(id_arg(&item?, "UnknownRequestError")?);
        }
        let drafts = RaggedInput::parse(draft_token_ids, "draft_token_ids")?;
        let (dv, dp) = drafts.views("draft_token_ids")?;
        let mut this = borrow_mut(slf)?;
        guard(py, || {
            this.core.set_draft_token_ids(&ids, Ragged { values: dv.as_slice(), indptr: dp.as_slice() })
        })
    }

    /// The runner could not execute step `out` (the only step in flight): aborts its live requests, takes the
    /// blocks it cached out of the prefix cache, and returns the aborted ids (see docs/semantics.md).
    fn fail_step(slf: &Bound<'_, Self>, out: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
        let py = slf.py();
        let (scheduler_id, step_id) = step_key(py, out)?;
        let mut this = borrow_mut(slf)?;
        let ids = guard(py, || this.core.fail_step(scheduler_id, step_id))?;
        if let Some(c) = &this.connector {
            // Aborted, as by abort_requests: no transfer parameters for them.
            c.take_transfer_params(py)?;
        }
        this.after_hooks(py)?;
        Ok(ids.iter().map(|s| s.to_string()).collect())
    }

    fn has_unfinished_requests(slf: &Bound<'_, Self>) -> PyResult<bool> {
        Ok(borrow(slf)?.core.has_unfinished_requests())
    }

    #[getter]
    fn num_unfinished_requests(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.core.num_unfinished_requests())
    }

    #[getter]
    fn num_free_blocks(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.core.num_free_blocks())
    }

    #[pyo3(signature = (req_id, group=0))]
    fn get_block_ids<'py>(
        slf: &Bound<'py, Self>,
        req_id: &Bound<'py, PyAny>,
        group: usize,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        block_id_array(slf, req_id, |core, id| core.get_group_block_ids(id, group))
    }

    #[pyo3(signature = (req_id, group=0))]
    fn get_held_block_ids<'py>(
        slf: &Bound<'py, Self>,
        req_id: &Bound<'py, PyAny>,
        group: usize,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        block_id_array(slf, req_id, |core, id| core.get_held_block_ids(id, group))
    }

    /// For each block of the request's table of KV cache group `group`, the tokens the hash it is cached under
    /// covers (vLLM's `block_hash_num_tokens`), 0 for a null block or one not cached.
    #[pyo3(signature = (req_id, group=0))]
    fn get_block_hash_num_tokens<'py>(
        slf: &Bound<'py, Self>,
        req_id: &Bound<'py, PyAny>,
        group: usize,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let py = slf.py();
        let id = id_arg(req_id, "UnknownRequestError")?;
        let this = borrow(slf)?;
        let counts = guard(py, || this.core.get_block_hash_num_tokens(&id, group))?;
        Ok(counts.into_iter().map(i64::from).collect::<Vec<i64>>().into_pyarray(py))
    }

    fn get_block_hashes<'py>(
        slf: &Bound<'py, Self>,
        req_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let py = slf.py();
        let id = id_arg(req_id, "UnknownRequestError")?;
        let this = borrow(slf)?;
        let width = hash_width(this.core.config());
        let hashes = guard(py, || Ok(this.core.get_request(&id)?.block_hashes.clone()))?;
        PyList::new(py, hashes.iter().map(|h| PyBytes::new(py, &h.0[..width])))
    }

    /// For each pair of `hash_lists` and `req_ids`: appends to the list the request's prefix-cache block hashes
    /// past its length (bytes), if the list's last hash is the request's hash at that position (the two chains
    /// agree so far). Returns the positions skipped: an empty list, a last hash that differs, no hash past it.
    /// Everything is checked before any list changes.
    fn _extend_block_hashes<'py>(
        slf: &Bound<'py, Self>,
        hash_lists: &Bound<'py, PyAny>,
        req_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let py = slf.py();
        let (hash_lists, req_ids) = paired_lists(hash_lists, "hash_lists", req_ids, "req_ids")?;
        let this = borrow(slf)?;
        let width = hash_width(this.core.config());
        let mut skipped: Vec<usize> = Vec::new();
        let mut new: Vec<(Bound<'py, PyList>, Vec<Bound<'py, PyBytes>>)> =
            Vec::with_capacity(hash_lists.len());
        for (i, (hashes, req_id)) in hash_lists.iter().zip(req_ids.iter()).enumerate() {
            let hashes = hashes.downcast_into::<PyList>().map_err(|e| {
                type_error(py, format!("hash_lists[{i}] must be a list, got {}", type_name(&e.into_inner())))
            })?;
            let id = str_arg(&req_id, "req_id")?;
            let id = id.to_str().map_err(|_| {
                py_error(
                    py,
                    "UnknownRequestError",
                    format!("request id {id} is not valid unicode (lone surrogate)"),
                )
            })?;
            let req = guard(py, || this.core.get_request(id))?;
            let n = hashes.len();
            let agrees = n > 0 && {
                let last = hashes.get_item(n - 1)?;
                let last = last.downcast::<PyBytes>().map_err(|_| {
                    type_error(py, format!("hash_lists[{i}] must hold bytes, got {}", type_name(&last)))
                })?;
                req.block_hashes.get(n - 1).is_some_and(|h| h.0[..width] == *last.as_bytes())
            };
            match req.block_hashes.get(n..) {
                Some(more) if agrees && !more.is_empty() => {
                    new.push((hashes, more.iter().map(|h| PyBytes::new(py, &h.0[..width])).collect()))
                }
                _ => skipped.push(i),
            }
        }
        for (hashes, more) in new {
            for h in more {
                hashes.append(h)?;
            }
        }
        PyList::new(py, skipped)
    }

    fn get_request_status(slf: &Bound<'_, Self>, req_id: &Bound<'_, PyAny>) -> PyResult<u8> {
        let id = id_arg(req_id, "UnknownRequestError")?;
        let this = borrow(slf)?;
        guard(slf.py(), || Ok(this.core.get_request(&id)?.status as u8))
    }

    fn get_num_computed_tokens(slf: &Bound<'_, Self>, req_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        let id = id_arg(req_id, "UnknownRequestError")?;
        let this = borrow(slf)?;
        guard(slf.py(), || this.core.get_num_computed_tokens(&id))
    }

    fn get_output_token_ids(slf: &Bound<'_, Self>, req_id: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let id = id_arg(req_id, "UnknownRequestError")?;
        let this = borrow(slf)?;
        guard(slf.py(), || Ok(this.core.get_request(&id)?.output_token_ids().to_vec()))
    }

    /// `(num_prompt_tokens, num_preemptions, num_cached_tokens, priority, arrival_time)` of a live request.
    fn _request_info(
        slf: &Bound<'_, Self>,
        req_id: &Bound<'_, PyAny>,
    ) -> PyResult<(u32, u32, i64, i64, f64)> {
        let id = id_arg(req_id, "UnknownRequestError")?;
        let this = borrow(slf)?;
        guard(slf.py(), || {
            let r = this.core.get_request(&id)?;
            Ok((r.num_prompt_tokens, r.num_preemptions, r.num_cached_tokens, r.priority, r.arrival_time))
        })
    }

    #[pyo3(signature = (prompt_token_ids, cache_salt=None, lora_name=None, tenant=None))]
    fn get_num_cached_tokens(
        slf: &Bound<'_, Self>,
        prompt_token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        lora_name: Option<&Bound<'_, PyAny>>,
        tenant: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u32> {
        let py = slf.py();
        let prompt = token_list(prompt_token_ids, "prompt_token_ids", "InvalidRequestError")?;
        let salt = opt_str_arg(cache_salt, "cache_salt")?;
        let lora = opt_str_arg(lora_name, "lora_name")?;
        let tenant = opt_str_arg(tenant, "tenant")?;
        if tenant.as_deref() == Some("") {
            return Err(py_error(
                py,
                "InvalidRequestError",
                "a tenant name must be a non-empty string".into(),
            ));
        }
        let this = borrow(slf)?;
        guard(py, || {
            this.core.get_num_cached_tokens_of(&prompt, salt.as_deref(), lora.as_deref(), tenant.as_deref())
        })
    }

    /// vLLM's `num_output_tokens` column for each entry of `out`, the step just scheduled (see the core).
    fn step_num_output_tokens<'py>(
        slf: &Bound<'py, Self>,
        out: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let py = slf.py();
        let (scheduler_id, step_id) = step_key(py, out)?;
        let this = borrow(slf)?;
        let counts = guard(py, || this.core.step_num_output_tokens(scheduler_id, step_id))?;
        Ok(counts.into_pyarray(py))
    }

    /// The block ids a prefix lookup of these tokens would hit now (at most `max_hit_tokens` tokens' worth,
    /// default all but the last token); touches nothing.
    /// `group`: that KV cache group's blocks of the hit (with `kv_cache_groups`).
    #[pyo3(signature = (token_ids, cache_salt=None, lora_name=None, max_hit_tokens=None, group=0))]
    fn get_cached_block_ids<'py>(
        slf: &Bound<'py, Self>,
        token_ids: &Bound<'py, PyAny>,
        cache_salt: Option<&Bound<'py, PyAny>>,
        lora_name: Option<&Bound<'py, PyAny>>,
        max_hit_tokens: Option<&Bound<'py, PyAny>>,
        group: usize,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let py = slf.py();
        let tokens = token_list(token_ids, "token_ids", "InvalidRequestError")?;
        let salt = opt_str_arg(cache_salt, "cache_salt")?;
        let lora = opt_str_arg(lora_name, "lora_name")?;
        let limit = opt_int_arg(max_hit_tokens, "max_hit_tokens", "InvalidRequestError")?
            .map(|v| u32::try_from(v.max(0)).unwrap_or(u32::MAX));
        let this = borrow(slf)?;
        let ids = guard(py, || {
            this.core.get_group_cached_block_ids(&tokens, salt.as_deref(), lora.as_deref(), limit, group)
        })?;
        Ok(ids.into_iter().map(|b| b as i32).collect::<Vec<i32>>().into_pyarray(py))
    }

    /// For each full block of these tokens, whether the prefix cache holds a block with its hash now; touches
    /// nothing.
    #[pyo3(signature = (token_ids, cache_salt=None, lora_name=None))]
    fn get_cached_block_mask(
        slf: &Bound<'_, Self>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        lora_name: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<bool>> {
        let py = slf.py();
        let tokens = token_list(token_ids, "token_ids", "InvalidRequestError")?;
        let salt = opt_str_arg(cache_salt, "cache_salt")?;
        let lora = opt_str_arg(lora_name, "lora_name")?;
        let this = borrow(slf)?;
        guard(py, || this.core.get_cached_block_mask(&tokens, salt.as_deref(), lora.as_deref()))
    }

    /// A block's reference count (requests holding it); `InvalidRequestError` for an id outside the pool.
    fn get_block_ref_cnt(slf: &Bound<'_, Self>, block_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        let py = slf.py();
        let block = int_arg(block_id, "block_id", "InvalidRequestError")?;
        let block = u32::try_from(block).map_err(|_| {
            py_error(py, "InvalidRequestError", format!("block id {block} is outside the KV cache pool"))
        })?;
        let this = borrow(slf)?;
        guard(py, || this.core.get_block_ref_cnt(block))
    }

    /// Takes one reference on each block id (vLLM's `BlockPool.touch`; see docs/api.md, "Block pins").
    fn pin_blocks(slf: &Bound<'_, Self>, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = slf.py();
        let blocks = block_id_list(block_ids)?;
        let mut this = borrow_mut(slf)?;
        guard(py, || this.core.pin_blocks(&blocks))
    }

    /// Gives back one pin of each block id, first evicted first (vLLM's `BlockPool.free_blocks`).
    fn unpin_blocks(slf: &Bound<'_, Self>, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = slf.py();
        let blocks = block_id_list(block_ids)?;
        let mut this = borrow_mut(slf)?;
        guard(py, || this.core.unpin_blocks(&blocks))
    }

    /// How many pins a block carries.
    fn get_block_pin_cnt(slf: &Bound<'_, Self>, block_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        let py = slf.py();
        let block = block_id_arg(block_id)?;
        let this = borrow(slf)?;
        guard(py, || this.core.get_block_pin_cnt(block))
    }

    /// The hash a block is cached under (as `cached_block_hashes` shows it), or None.
    fn get_block_hash<'py>(
        slf: &Bound<'py, Self>,
        block_id: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let py = slf.py();
        let block = block_id_arg(block_id)?;
        let this = borrow(slf)?;
        let width = hash_width(this.core.config());
        let hash = guard(py, || this.core.get_block_hash(block))?;
        Ok(hash.map(|h| PyBytes::new(py, &h.0[..width])))
    }

    /// The free blocks in eviction order, head first.
    fn free_block_ids<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let py = slf.py();
        let ids: Vec<i32> = borrow(slf)?.core.free_block_ids().into_iter().map(|b| b as i32).collect();
        Ok(ids.into_pyarray(py))
    }

    /// The request block hash a block is cached under and the KV cache group whose key of it that is, or None.
    fn get_block_hash_group<'py>(
        slf: &Bound<'py, Self>,
        block_id: &Bound<'py, PyAny>,
    ) -> PyResult<Option<(Bound<'py, PyBytes>, usize)>> {
        let py = slf.py();
        let block = block_id_arg(block_id)?;
        let this = borrow(slf)?;
        let width = hash_width(this.core.config());
        let found = guard(py, || this.core.get_block_hash_group(block))?;
        Ok(found.map(|(h, g)| (PyBytes::new(py, &h.0[..width]), g)))
    }

    /// The block a prefix lookup of this hash (KV cache group `group`'s key of it) returns now, or None.
    #[pyo3(signature = (block_hash, group=None))]
    fn get_cached_block_id(
        slf: &Bound<'_, Self>,
        block_hash: &Bound<'_, PyAny>,
        group: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Option<u32>> {
        let py = slf.py();
        let bytes = block_hash.downcast::<PyBytes>().map_err(|_| {
            type_error(py, format!("block_hash must be bytes, got {}", type_name(block_hash)))
        })?;
        let group = match group {
            None => 0,
            Some(g) => int_arg(g, "group", "InvalidRequestError")?,
        };
        let this = borrow(slf)?;
        let width = hash_width(this.core.config());
        let raw = bytes.as_bytes();
        if raw.len() != width {
            return Err(py_error(
                py,
                "InvalidRequestError",
                format!(
                    "block_hash must be {width} bytes (the width of this scheduler's hashes), got {}",
                    raw.len()
                ),
            ));
        }
        let num_groups = this.core.config().kv_cache_groups.len().max(1);
        let group = usize::try_from(group).map_err(|_| {
            py_error(py, "InvalidRequestError", format!("group must be in [0, {num_groups}), got {group}"))
        })?;
        let mut hash = core::BlockHash::default();
        hash.0[..width].copy_from_slice(raw);
        guard(py, || this.core.get_group_cached_block_id(&hash, group))
    }

    #[pyo3(signature = (reset_running_requests=None))]
    fn reset_prefix_cache(
        slf: &Bound<'_, Self>,
        reset_running_requests: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let py = slf.py();
        let reset = match reset_running_requests {
            None => false,
            Some(o) => o.downcast::<PyBool>().map(|b| b.is_true()).map_err(|_| {
                type_error(py, format!("reset_running_requests must be a bool, got {}", type_name(o)))
            })?,
        };
        let mut this = borrow_mut(slf)?;
        guard(py, || this.core.reset_prefix_cache(reset))
    }

    /// Preempts the running request `req_id` now, as a step preempts a victim in recompute mode (vLLM's
    /// `_preempt_request` called by hand; docs/semantics.md, Preemption by hand).
    #[pyo3(signature = (req_id, drop_stale_output=None))]
    fn preempt_request(
        slf: &Bound<'_, Self>,
        req_id: &Bound<'_, PyAny>,
        drop_stale_output: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let py = slf.py();
        let id = id_arg(req_id, "UnknownRequestError")?;
        let drop = match drop_stale_output {
            None => false,
            Some(o) => o.downcast::<PyBool>().map(|b| b.is_true()).map_err(|_| {
                type_error(py, format!("drop_stale_output must be a bool, got {}", type_name(o)))
            })?,
        };
        let mut this = borrow_mut(slf)?;
        guard(py, || this.core.preempt_request(&id, drop))
    }

    /// The next input part of a streaming-input session (docs/semantics.md, Streaming input).
    #[pyo3(signature = (req_id, prompt_token_ids, max_tokens=None, eos_token_id=None, ignore_eos=None,
        stop_token_ids=None, arrival_time=None))]
    #[allow(clippy::too_many_arguments)]
    fn append_input(
        slf: &Bound<'_, Self>,
        req_id: &Bound<'_, PyAny>,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_tokens: Option<&Bound<'_, PyAny>>,
        eos_token_id: Option<&Bound<'_, PyAny>>,
        ignore_eos: Option<&Bound<'_, PyAny>>,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
        arrival_time: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let py = slf.py();
        let id = id_arg(req_id, "UnknownRequestError")?;
        let prompt = token_list(prompt_token_ids, "prompt_token_ids", "InvalidRequestError")?;
        let mut token_ids = Vec::with_capacity(prompt.len());
        for t in prompt {
            token_ids.push(guard(py, || core::Scheduler::check_token_id("prompt_token_ids", t))?);
        }
        let max_tokens = max_tokens_arg(py, max_tokens)?;
        let eos_token_id = eos_token_id_arg(py, eos_token_id)?;
        let ignore_eos = bool_arg(py, ignore_eos, "ignore_eos", false)?;
        let stops = stop_token_ids_arg(py, stop_token_ids)?;
        let arrival_time = match arrival_time {
            Some(t) if !t.is_none() => {
                if t.is_instance_of::<PyBool>() {
                    return Err(type_error(py, "arrival_time must be a float or None, got bool".into()));
                }
                t.extract::<f64>().map_err(|_| {
                    type_error(py, format!("arrival_time must be a float or None, got {}", type_name(t)))
                })?
            }
            _ => py.import("time")?.call_method0("monotonic")?.extract::<f64>()?,
        };
        let part = core::InputPart {
            token_ids,
            max_tokens,
            eos_token_id,
            ignore_eos,
            stop_token_ids: stops,
            arrival_time,
        };
        let mut this = borrow_mut(slf)?;
        guard(py, || this.core.append_input(&id, part))
    }

    /// Ends the input of a streaming-input session (a streaming-input session waiting for input is aborted).
    fn finish_input(slf: &Bound<'_, Self>, req_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = id_arg(req_id, "UnknownRequestError")?;
        let mut this = borrow_mut(slf)?;
        guard(slf.py(), || this.core.finish_input(&id))
    }

    /// Whether the request is known (vLLM's `has_request`): live, waiting for input, or its blocks held.
    fn has_request(slf: &Bound<'_, Self>, req_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        let id = id_arg(req_id, "UnknownRequestError")?;
        Ok(borrow(slf)?.core.has_request(&id))
    }

    /// Releases a request added with `ready=False` (its structured-output grammar is compiled).
    fn set_ready(slf: &Bound<'_, Self>, req_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = id_arg(req_id, "UnknownRequestError")?;
        let mut this = borrow_mut(slf)?;
        guard(slf.py(), || this.core.set_ready(&id))
    }

    /// `(num_executed_steps, last_prefill_step, prefill_capacity_bound)`: the prefill cadence's state.
    #[getter]
    fn prefill_cadence(slf: &Bound<'_, Self>) -> PyResult<(u64, i64, bool)> {
        Ok(borrow(slf)?.core.prefill_cadence())
    }

    #[getter]
    fn pause_state(slf: &Bound<'_, Self>) -> PyResult<&'static str> {
        Ok(borrow(slf)?.core.pause_state().name())
    }

    fn set_pause_state(slf: &Bound<'_, Self>, state: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = slf.py();
        let name = state
            .extract::<String>()
            .map_err(|_| type_error(py, format!("pause state must be a str, got {}", type_name(state))))?;
        let parsed = guard(py, || core::PauseState::parse(&name))?;
        borrow_mut(slf)?.core.set_pause_state(parsed);
        Ok(())
    }

    fn get_replay_start(slf: &Bound<'_, Self>, req_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        let id = id_arg(req_id, "UnknownRequestError")?;
        let this = borrow(slf)?;
        guard(slf.py(), || this.core.get_replay_start(&id))
    }

    fn get_num_output_placeholders(slf: &Bound<'_, Self>, req_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        let id = id_arg(req_id, "UnknownRequestError")?;
        let this = borrow(slf)?;
        guard(slf.py(), || this.core.get_num_output_placeholders(&id))
    }

    /// The counters as a dict (`kvsched.Scheduler.stats()` wraps it in a dataclass).
    fn _stats_dict<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyDict>> {
        let py = slf.py();
        let s = borrow(slf)?.core.stats();
        let d = PyDict::new(py);
        d.set_item("num_running_reqs", s.num_running_reqs)?;
        d.set_item("num_waiting_reqs", s.num_waiting_reqs)?;
        d.set_item("num_skipped_waiting_reqs", s.num_skipped_waiting_reqs)?;
        d.set_item("kv_cache_usage", s.kv_cache_usage)?;
        d.set_item("num_free_blocks", s.num_free_blocks)?;
        d.set_item("prefix_cache_queries", s.prefix_cache_queries)?;
        d.set_item("prefix_cache_hits", s.prefix_cache_hits)?;
        d.set_item("prefix_cache_preempted_queries", s.prefix_cache_preempted_queries)?;
        d.set_item("prefix_cache_preempted_hits", s.prefix_cache_preempted_hits)?;
        d.set_item("num_preemptions", s.num_preemptions)?;
        d.set_item("num_finished_reqs", s.num_finished_reqs)?;
        d.set_item("step_id", s.step_id)?;
        d.set_item("num_swapped_out_reqs", s.num_swapped_out_reqs)?;
        d.set_item("num_swapped_out_blocks", s.num_swapped_out_blocks)?;
        d.set_item("num_swapped_in_reqs", s.num_swapped_in_reqs)?;
        d.set_item("num_swapped_in_blocks", s.num_swapped_in_blocks)?;
        d.set_item("num_swap_fallbacks", s.num_swap_fallbacks)?;
        d.set_item("num_recomputed_tokens", s.num_recomputed_tokens)?;
        d.set_item("num_free_cpu_blocks", s.num_free_cpu_blocks)?;
        d.set_item("cpu_kv_cache_usage", s.cpu_kv_cache_usage)?;
        d.set_item("connector_prefix_cache_queries", s.connector_prefix_cache_queries)?;
        d.set_item("connector_prefix_cache_hits", s.connector_prefix_cache_hits)?;
        d.set_item("encoder_cache_usage", s.encoder_cache_usage)?;
        d.set_item("num_encoder_cache_entries", s.num_encoder_cache_entries)?;
        d.set_item("num_encoder_inputs_computed", s.num_encoder_inputs_computed)?;
        d.set_item("num_encoder_tokens_computed", s.num_encoder_tokens_computed)?;
        d.set_item("encoder_cache_hits", s.encoder_cache_hits)?;
        Ok(d)
    }

    /// The four counters vLLM's `SchedulerStats` takes from the scheduler every step: `(num_running_reqs,
    /// num_waiting_reqs, num_skipped_waiting_reqs, kv_cache_usage)` (a tuple: no dict of every counter).
    fn _vllm_stats(slf: &Bound<'_, Self>) -> PyResult<(usize, usize, usize, f64)> {
        let s = borrow(slf)?.core.stats();
        Ok((s.num_running_reqs, s.num_waiting_reqs, s.num_skipped_waiting_reqs, s.kv_cache_usage))
    }

    /// `(tenant, (weight, counter, num_prefill_tokens, num_decode_tokens, num_waiting_reqs, num_running_reqs))`
    /// per tenant, in registration order (`kvsched.Scheduler.tenant_stats()` wraps them in dataclasses).
    #[allow(clippy::type_complexity)]
    fn _tenant_stats(slf: &Bound<'_, Self>) -> PyResult<Vec<(String, (f64, f64, u64, u64, u32, u32))>> {
        let this = borrow(slf)?;
        Ok(this
            .core
            .tenant_stats()
            .map(|t| {
                let fields = (
                    t.weight,
                    t.counter,
                    t.num_prefill_tokens,
                    t.num_decode_tokens,
                    t.num_waiting,
                    t.num_running,
                );
                (t.name.to_string(), fields)
            })
            .collect())
    }

    /// Changes a tenant's weight from now on (a new tenant is registered). On error nothing changes.
    fn set_tenant_weight(
        slf: &Bound<'_, Self>,
        tenant: &Bound<'_, PyAny>,
        weight: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let py = slf.py();
        let name = str_arg(tenant, "tenant")?;
        let name = name.to_str().map_err(|_| {
            py_error(
                py,
                "InvalidRequestError",
                "a tenant name must be valid unicode (a lone surrogate)".into(),
            )
        })?;
        if weight.is_instance_of::<PyBool>() {
            return Err(type_error(py, format!("the weight of tenant {name:?} must be a float, got bool")));
        }
        let w = match weight.extract::<f64>() {
            Ok(w) => w,
            Err(_) if weight.is_instance_of::<PyInt>() => f64::INFINITY, // beyond the float range: refused below
            Err(_) => {
                return Err(type_error(
                    py,
                    format!("the weight of tenant {name:?} must be a float, got {}", type_name(weight)),
                ))
            }
        };
        let mut this = borrow_mut(slf)?;
        guard(py, || this.core.set_tenant_weight(name, w))
    }

    fn check_invariants(slf: &Bound<'_, Self>) -> PyResult<()> {
        let py = slf.py();
        let this = borrow(slf)?;
        guard(py, || this.core.check_invariants().map_err(SchedError::Internal))
    }

    /// Ids of the running requests, in running order.
    fn running_req_ids(slf: &Bound<'_, Self>) -> PyResult<Vec<String>> {
        let this = borrow(slf)?;
        Ok(this.core.running_req_ids().iter().map(|s| s.to_string()).collect())
    }

    /// Ids of the waiting requests, in the order admission considers them.
    fn waiting_req_ids(slf: &Bound<'_, Self>) -> PyResult<Vec<String>> {
        let this = borrow(slf)?;
        Ok(this.core.waiting_req_ids().iter().map(|s| s.to_string()).collect())
    }

    /// Sets the auto preemption mode's cost constants from now on. On error nothing changes.
    fn set_preemption_costs(
        slf: &Bound<'_, Self>,
        recompute_cost_per_token: &Bound<'_, PyAny>,
        swap_cost_per_block: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let recompute = float_arg(recompute_cost_per_token, "recompute_cost_per_token")?;
        let swap = float_arg(swap_cost_per_block, "swap_cost_per_block")?;
        let mut this = borrow_mut(slf)?;
        guard(slf.py(), || this.core.set_preemption_costs(recompute, swap))
    }

    /// Turns `defer_block_free` on or off from now on (frees already deferred keep their fence); `config`
    /// shows the new value.
    fn set_defer_block_free(slf: &Bound<'_, Self>, on: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = slf.py();
        let on = on
            .downcast::<PyBool>()
            .map_err(|_| type_error(py, format!("defer_block_free must be a bool, got {}", type_name(on))))?
            .is_true();
        let mut this = borrow_mut(slf)?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("defer_block_free", on)?;
        let config =
            py.import("dataclasses")?.getattr("replace")?.call((this.config.bind(py),), Some(&kwargs))?;
        guard(py, || this.core.set_defer_block_free(on))?;
        this.config = config.unbind();
        Ok(())
    }

    /// Encoder-decoder scheduling: the slot count of vLLM's `EncoderDecoderCacheManager` (docs/semantics.md,
    /// Encoder-decoder scheduling).
    #[getter]
    fn encoder_decoder_free_slots(slf: &Bound<'_, Self>) -> PyResult<i64> {
        Ok(borrow(slf)?.core.encoder_decoder_free_slots())
    }

    /// Encoder-decoder scheduling: the slot count back to `encoder_cache_size` (vLLM's
    /// `EncoderDecoderCacheManager.reset`); refused without `encoder_decoder`.
    fn reset_encoder_decoder_slots(slf: &Bound<'_, Self>) -> PyResult<()> {
        let py = slf.py();
        let mut this = borrow_mut(slf)?;
        guard(py, || this.core.reset_encoder_decoder_slots())
    }

    /// Re-sizes the encoder compute budget (from the next step) and the encoder cache (only while it holds no
    /// entry); neither may drop below a live request's encoder input. `config` shows the new values.
    fn set_encoder_sizes(
        slf: &Bound<'_, Self>,
        max_num_encoder_input_tokens: &Bound<'_, PyAny>,
        encoder_cache_size: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let py = slf.py();
        let size = |o: &Bound<'_, PyAny>, name: &str| -> PyResult<u32> {
            let v = int_arg(o, name, "InvalidConfigError")?;
            u32::try_from(v).ok().filter(|&v| v <= i32::MAX as u32).ok_or_else(|| {
                py_error(py, "InvalidConfigError", format!("{name} must be in [0, {}], got {v}", i32::MAX))
            })
        };
        let budget = size(max_num_encoder_input_tokens, "max_num_encoder_input_tokens")?;
        let cache = size(encoder_cache_size, "encoder_cache_size")?;
        let mut this = borrow_mut(slf)?;
        guard(py, || this.core.set_encoder_sizes(budget, cache))?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("max_num_encoder_input_tokens", budget)?;
        kwargs.set_item("encoder_cache_size", cache)?;
        let config =
            py.import("dataclasses")?.getattr("replace")?.call((this.config.bind(py),), Some(&kwargs))?;
        this.config = config.unbind();
        Ok(())
    }

    /// Sets the drafter's prefill lookahead of the chunk rules and the encoder window (from the next step), only
    /// while no request is live; `config` shows the new value.
    fn set_prefill_lookahead(
        slf: &Bound<'_, Self>,
        prefill_lookahead_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let py = slf.py();
        let v = int_arg(prefill_lookahead_tokens, "prefill_lookahead_tokens", "InvalidConfigError")?;
        let n = u32::try_from(v).ok().filter(|&v| v <= 1024).ok_or_else(|| {
            py_error(
                py,
                "InvalidConfigError",
                format!("prefill_lookahead_tokens must be in [0, 1024], got {v}"),
            )
        })?;
        let mut this = borrow_mut(slf)?;
        guard(py, || this.core.set_prefill_lookahead(n))?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("prefill_lookahead_tokens", n)?;
        let config =
            py.import("dataclasses")?.getattr("replace")?.call((this.config.bind(py),), Some(&kwargs))?;
        this.config = config.unbind();
        Ok(())
    }

    /// Turns `defer_async_loads` on or off from now on (loads already deferred keep their fence); `config`
    /// shows the new value.
    fn set_defer_async_loads(slf: &Bound<'_, Self>, on: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = slf.py();
        let on = on
            .downcast::<PyBool>()
            .map_err(|_| type_error(py, format!("defer_async_loads must be a bool, got {}", type_name(on))))?
            .is_true();
        let mut this = borrow_mut(slf)?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("defer_async_loads", on)?;
        let config =
            py.import("dataclasses")?.getattr("replace")?.call((this.config.bind(py),), Some(&kwargs))?;
        this.core.set_defer_async_loads(on);
        this.config = config.unbind();
        Ok(())
    }

    /// With `kv_connector_groups`: frees now the blocks that left a window at the finish of the held request
    /// `req_id` (they otherwise go back with its held blocks).
    fn free_held_window_blocks(slf: &Bound<'_, Self>, req_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = slf.py();
        let id: String = req_id
            .extract()
            .map_err(|_| type_error(py, format!("req_id must be a str, got {}", type_name(req_id))))?;
        let mut this = borrow_mut(slf)?;
        guard(py, || this.core.free_held_window_blocks(&id))
    }

    /// Requests whose asynchronous load waits for the steps in flight before the connector is told of it
    /// (`defer_async_loads`), in the order they will be registered.
    fn deferred_load_ids(slf: &Bound<'_, Self>) -> PyResult<Vec<String>> {
        Ok(borrow(slf)?.core.deferred_load_ids().iter().map(|s| s.to_string()).collect())
    }

    /// The deferred frees: `(fence, block ids in the order they go back)` per free, oldest first (vLLM's
    /// `deferred_frees`; the fence counts the non-empty steps scheduled at the free).
    fn deferred_frees(slf: &Bound<'_, Self>) -> PyResult<Vec<(u64, Vec<u32>)>> {
        Ok(borrow(slf)?.core.deferred_frees())
    }

    /// `(scheduled, applied)`: the non-empty steps scheduled and applied so far (vLLM's `sched_step_seq` and
    /// `processed_step_seq`).
    #[getter]
    fn step_seqs(slf: &Bound<'_, Self>) -> PyResult<(u64, u64)> {
        Ok(borrow(slf)?.core.step_seqs())
    }

    /// Blocks whose free waits for steps in flight (`defer_block_free`), in the order they go back to the pool.
    fn deferred_free_block_ids<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let ids: Vec<i32> =
            borrow(slf)?.core.deferred_free_block_ids().into_iter().map(|b| b as i32).collect();
        Ok(ids.into_pyarray(slf.py()))
    }

    /// `(recompute_cost_per_token, swap_cost_per_block)` now in force.
    #[getter]
    fn preemption_costs(slf: &Bound<'_, Self>) -> PyResult<(f64, f64)> {
        Ok(borrow(slf)?.core.preemption_costs())
    }

    /// CPU blocks holding a swapped-out request's KV (empty unless it is swapped out).
    fn get_cpu_block_ids<'py>(
        slf: &Bound<'py, Self>,
        req_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        block_id_array(slf, req_id, |core, id| core.get_cpu_block_ids(id))
    }

    /// The KV cache events since the last call, as arrays that `kvsched.Scheduler.take_kv_cache_events` wraps in
    /// a `KVCacheEvents`: `(kinds, block_hashes, block_hashes_indptr, num_copies, parent_block_hashes, has_parent,
    /// token_ids, token_ids_indptr, lora_names, cache_salts, req_ids, num_cached_blocks, groups, block_positions)`;
    /// hashes are rows of `width` bytes.
    fn _take_kv_cache_events<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let mut this = borrow_mut(slf)?;
        let width = hash_width(this.core.config());
        let ev = guard(py, || Ok(this.core.take_kv_cache_events()))?;
        drop(this);
        let rows = |hashes: &mut dyn Iterator<Item = Option<&core::BlockHash>>, n: usize| {
            let mut flat = Vec::with_capacity(n * width);
            for h in hashes {
                flat.extend_from_slice(h.map_or(&[0u8; 32][..width], |h| &h.0[..width]));
            }
            Array2::from_shape_vec((n, width), flat)
                .map_err(|e| py_error(py, "InternalError", format!("event hash rows: {e}")))
        };
        let hashes = rows(&mut ev.block_hashes.iter().map(Some), ev.block_hashes.len())?;
        let parents = rows(&mut ev.parents.iter().map(Option::as_ref), ev.parents.len())?;
        let i32s = |v: &[u32]| v.iter().map(|&x| x as i32).collect::<Vec<i32>>();
        let has_parent: Vec<bool> = ev.parents.iter().map(Option::is_some).collect();
        let loras = PyList::new(py, ev.extra_keys.iter().map(|k| k.lora_name.as_deref()))?;
        let salts = PyList::new(py, ev.extra_keys.iter().map(|k| k.cache_salt.as_deref()))?;
        let req_ids = PyList::new(py, ev.req_ids.iter().map(Option::as_deref))?;
        let items: Vec<Bound<'py, PyAny>> = vec![
            ev.kinds.into_pyarray(py).into_any(),
            hashes.into_pyarray(py).into_any(),
            i32s(&ev.block_indptr).into_pyarray(py).into_any(),
            i32s(&ev.num_copies).into_pyarray(py).into_any(),
            parents.into_pyarray(py).into_any(),
            has_parent.into_pyarray(py).into_any(),
            i32s(&ev.token_ids).into_pyarray(py).into_any(),
            i32s(&ev.token_indptr).into_pyarray(py).into_any(),
            loras.into_any(),
            salts.into_any(),
            req_ids.into_any(),
            i32s(&ev.num_cached_blocks).into_pyarray(py).into_any(),
            i32s(&ev.groups).into_pyarray(py).into_any(),
            i32s(&ev.block_positions).into_pyarray(py).into_any(),
            i32s(&ev.block_sizes).into_pyarray(py).into_any(),
        ];
        PyTuple::new(py, items)
    }

    /// The encoder cache's entries as `{hash: [req_id, ...]}` (hash ascending; the ids of the requests
    /// referencing each entry, sorted; empty for a freeable entry).
    fn encoder_cache_entries<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyDict>> {
        let py = slf.py();
        let entries = borrow(slf)?.core.encoder_cache_entries();
        let d = PyDict::new(py);
        for (hash, ids) in entries {
            d.set_item(hash, PyList::new(py, ids.iter().map(|id| &**id))?)?;
        }
        Ok(d)
    }

    /// The hash of every block in the prefix cache, in block id order (one entry per block).
    fn cached_block_hashes<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        let py = slf.py();
        let this = borrow(slf)?;
        let width = hash_width(this.core.config());
        let hashes = guard(py, || Ok(this.core.cached_block_hashes()))?;
        PyList::new(py, hashes.iter().map(|h| PyBytes::new(py, &h.0[..width])))
    }

    /// Leading blocks of the request that are entered in the prefix cache.
    fn get_num_cached_blocks(slf: &Bound<'_, Self>, req_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        let id = id_arg(req_id, "UnknownRequestError")?;
        let this = borrow(slf)?;
        guard(slf.py(), || this.core.get_num_cached_blocks(&id))
    }
}

/// A block id argument: an int in the u32 range (`InvalidRequestError` otherwise; the core checks the pool).
fn block_id_arg(obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    let v = int_arg(obj, "block_id", "InvalidRequestError")?;
    block_id_in_range(obj.py(), v)
}

fn block_id_in_range(py: Python<'_>, v: i64) -> PyResult<u32> {
    u32::try_from(v).map_err(|_| {
        py_error(py, "InvalidRequestError", format!("block id {v} is outside the KV cache pool"))
    })
}

/// An iterable of block ids, each as `block_id_arg` takes it.
fn block_id_list(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let py = obj.py();
    int_list(Some(obj), "block_ids")?.into_iter().map(|v| block_id_in_range(py, v)).collect()
}

/// The bytes of a block hash Python sees: xxh3-128 fills 16 of the core's 32.
fn hash_width(config: &core::SchedulerConfig) -> usize {
    match config.prefix_hash_algo {
        core::HashAlgo::Xxh3_128 => 16,
        core::HashAlgo::Sha256 | core::HashAlgo::Sha256Pickle => 32,
    }
}

impl PyScheduler {
    fn core_next_slot(&self) -> usize {
        self.core.next_slot() as usize
    }

    /// Raises the first exception a connector hook raised during the last core call (the core has finished
    /// the call consistently, taking the hook's answer as "nothing external, no delayed free").
    fn after_hooks(&self, _py: Python<'_>) -> PyResult<()> {
        match &self.connector {
            Some(c) => c.check(),
            None => Ok(()),
        }
    }
}

// The per-request arguments `add_request` and `append_input` share, with the same checks and messages.

/// `max_tokens`: None or >= 1. Python ints beyond int64 are still valid limits: a huge one is capped by
/// max_model_len.
fn max_tokens_arg(py: Python<'_>, o: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u32>> {
    if o.is_some_and(|o| o.is_instance_of::<PyInt>() && o.gt(i64::MAX).unwrap_or(false)) {
        return Ok(Some(u32::MAX));
    }
    match opt_int_arg(o, "max_tokens", "InvalidRequestError")? {
        None => Ok(None),
        Some(m) if m < 1 => {
            Err(py_error(py, "InvalidRequestError", format!("max_tokens must be >= 1, got {m}")))
        }
        Some(m) => Ok(Some(u32::try_from(m).unwrap_or(u32::MAX))),
    }
}

fn eos_token_id_arg(py: Python<'_>, o: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u32>> {
    match opt_int_arg(o, "eos_token_id", "InvalidRequestError")? {
        None => Ok(None),
        Some(t) => Ok(Some(guard(py, || core::Scheduler::check_token_id("eos_token_id", t))?)),
    }
}

/// A bool argument; None or absent gives `default`.
fn bool_arg(py: Python<'_>, o: Option<&Bound<'_, PyAny>>, name: &str, default: bool) -> PyResult<bool> {
    match o {
        Some(o) if !o.is_none() => o
            .downcast::<PyBool>()
            .map(|b| b.is_true())
            .map_err(|_| type_error(py, format!("{name} must be a bool, got {}", type_name(o)))),
        _ => Ok(default),
    }
}

fn stop_token_ids_arg(py: Python<'_>, o: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<u32>> {
    let mut stops = Vec::new();
    if let Some(s) = o {
        if !s.is_none() {
            for t in token_list(s, "stop_token_ids", "InvalidRequestError")? {
                stops.push(guard(py, || core::Scheduler::check_token_id("stop_token_ids", t))?);
            }
        }
    }
    Ok(stops)
}
