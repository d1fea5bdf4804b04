//! The KV connector: a Python object behind the core's `KvConnector` trait.
//!
//! The core calls a hook only when a connector is set, from inside `schedule()` (admissions), and from every
//! call that finishes requests (`update_from_output`, `abort_requests`, `update_kv_transfers`). A hook's
//! exception cannot unwind through the core: the hook answers conservatively (no external tokens, no delayed
//! free), the exception is kept, and the binding raises it once the core call has returned (the scheduler is
//! consistent then; see docs/api.md). `request_finished`'s transfer parameters are collected here and handed to
//! the caller with the result of the call that finished the request.

use std::sync::{Arc, Mutex};

use kvsched_core as core;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList, PyTuple};

use crate::convert::type_name;
use crate::errors::py_error;

/// What the hooks leave for the binding: the first exception, and transfer parameters of finished requests.
#[derive(Default)]
pub(crate) struct HookState {
    pub(crate) error: Option<PyErr>,
    pub(crate) transfer_params: Vec<(Arc<str>, Py<PyAny>)>,
}

/// The binding's handle on a connector: the Python object and the state its hooks share with the binding.
pub(crate) struct ConnectorHandle {
    pub(crate) obj: Py<PyAny>,
    pub(crate) state: Arc<Mutex<HookState>>,
    has_build_meta: bool,
}

struct PyKvConnector {
    obj: Py<PyAny>,
    state: Arc<Mutex<HookState>>,
    /// The object asked for `update_state_after_alloc`'s optional fourth argument (`num_cached_blocks`).
    pass_cached_blocks: bool,
    /// The object has the optional `has_pending_block_frees()` hook.
    has_pending_frees_hook: bool,
    /// The object has the optional `load_deferred(req_id, block_ids, num_external_tokens)` hook.
    has_load_deferred_hook: bool,
    /// The object has the optional `get_loaded_kv_cache_group_ids(req_id)` hook.
    has_loaded_groups_hook: bool,
    /// The object has the optional `local_hit_replaced(req_id, num_local_tokens)` hook.
    has_local_hit_replaced_hook: bool,
}

impl PyKvConnector {
    fn keep(&self, e: PyErr) {
        if let Ok(mut s) = self.state.lock() {
            if s.error.is_none() {
                s.error = Some(e);
            }
        }
    }

    /// The blocks argument of the allocation hooks: the primary table, or (`tables`) one list per group.
    fn blocks_arg<'py>(
        py: Python<'py>,
        req: &core::Request,
        tables: Option<&[&[u32]]>,
    ) -> PyResult<Bound<'py, PyAny>> {
        match tables {
            Some(t) => table_lists(py, t),
            None => block_list(py, &req.blocks).map(Bound::into_any),
        }
    }

    fn after_alloc(
        &self,
        req: &core::Request,
        tables: Option<&[&[u32]]>,
        key_tokens: &[Vec<u32>],
        num_external_tokens: u32,
    ) {
        Python::with_gil(|py| {
            let hook = "update_state_after_alloc";
            let r = Self::blocks_arg(py, req, tables).and_then(|blocks| {
                let obj = self.obj.bind(py);
                if self.pass_cached_blocks {
                    // With tables: per group, each block's cache key tokens (lists of ints, 0: not cached).
                    let cached = match tables {
                        Some(_) => PyList::new(
                            py,
                            key_tokens
                                .iter()
                                .map(|g| PyList::new(py, g.iter().copied()))
                                .collect::<PyResult<Vec<_>>>()?,
                        )?
                        .into_any(),
                        None => PyList::new(py, [req.num_cached_blocks])?.get_item(0)?,
                    };
                    obj.call_method1(hook, (&*req.id, blocks, num_external_tokens, cached))
                } else {
                    obj.call_method1(hook, (&*req.id, blocks, num_external_tokens))
                }
            });
            if let Err(e) = r {
                self.keep(e);
            }
        })
    }

    fn deferred(&self, req: &core::Request, tables: Option<&[&[u32]]>, num_external_tokens: u32) {
        if !self.has_load_deferred_hook {
            return;
        }
        Python::with_gil(|py| {
            let r = Self::blocks_arg(py, req, tables).and_then(|blocks| {
                self.obj.bind(py).call_method1("load_deferred", (&*req.id, blocks, num_external_tokens))
            });
            if let Err(e) = r {
                self.keep(e);
            }
        })
    }

    fn finished(&self, py: Python<'_>, req: &core::Request, blocks: PyResult<Bound<'_, PyAny>>) -> bool {
        let hook = "request_finished";
        let res = blocks
            .and_then(|blocks| self.obj.bind(py).call_method1(hook, (&*req.id, blocks)))
            .and_then(|r| {
                let (delay, params) = match r.downcast::<PyTuple>() {
                    Ok(t) if t.len() == 2 => (t.get_item(0)?, Some(t.get_item(1)?)),
                    _ => (r.clone(), None),
                };
                let delay = delay.downcast::<PyBool>().map_err(|_| {
                    bad_answer(py, hook, format!("must return bool or (bool, params), got {}", type_name(&r)))
                })?;
                Ok((delay.is_true(), params.filter(|p| !p.is_none()).map(Bound::unbind)))
            });
        match res {
            Ok((delay, params)) => {
                if let (Some(p), Ok(mut s)) = (params, self.state.lock()) {
                    s.transfer_params.push((req.id.clone(), p));
                }
                delay
            }
            Err(e) => {
                self.keep(e);
                false
            }
        }
    }
}

fn bad_answer(py: Python<'_>, hook: &str, msg: String) -> PyErr {
    py_error(py, "KVConnectorError", format!("kv_connector.{hook}: {msg}"))
}

fn block_list<'py>(py: Python<'py>, blocks: &[u32]) -> PyResult<Bound<'py, PyList>> {
    PyList::new(py, blocks.iter().copied())
}

/// One list of block ids per KV cache group, as a list of lists.
fn table_lists<'py>(py: Python<'py>, tables: &[&[u32]]) -> PyResult<Bound<'py, PyAny>> {
    let lists = tables.iter().map(|t| block_list(py, t)).collect::<PyResult<Vec<_>>>()?;
    Ok(PyList::new(py, lists)?.into_any())
}

impl core::KvConnector for PyKvConnector {
    fn get_num_new_matched_tokens(
        &mut self,
        req: &core::Request,
        num_computed_tokens: u32,
    ) -> Option<(u32, bool)> {
        Python::with_gil(|py| {
            let hook = "get_num_new_matched_tokens";
            let res = self.obj.bind(py).call_method1(hook, (&*req.id, num_computed_tokens)).and_then(|r| {
                let t = r.downcast::<PyTuple>().map_err(|_| {
                    bad_answer(py, hook, format!("must return (int | None, bool), got {}", type_name(&r)))
                })?;
                if t.len() != 2 {
                    return Err(bad_answer(py, hook, format!("must return a pair, got {} items", t.len())));
                }
                let (n, a) = (t.get_item(0)?, t.get_item(1)?);
                let load_async = a
                    .downcast::<PyBool>()
                    .map_err(|_| {
                        bad_answer(py, hook, format!("async flag must be a bool, got {}", type_name(&a)))
                    })?
                    .is_true();
                if n.is_none() {
                    return Ok(None);
                }
                if n.is_instance_of::<PyBool>() {
                    return Err(bad_answer(py, hook, "token count must be an int or None, got bool".into()));
                }
                let n = n.extract::<i64>().map_err(|_| {
                    bad_answer(py, hook, format!("token count must be an int or None, got {}", type_name(&n)))
                })?;
                let n = u32::try_from(n)
                    .map_err(|_| bad_answer(py, hook, format!("token count must be >= 0, got {n}")))?;
                Ok(Some((n, load_async)))
            });
            res.unwrap_or_else(|e| {
                self.keep(e);
                None
            })
        })
    }

    fn update_state_after_alloc(&mut self, req: &core::Request, num_external_tokens: u32) {
        self.after_alloc(req, None, &[], num_external_tokens);
    }

    fn update_state_after_alloc_groups(
        &mut self,
        req: &core::Request,
        tables: &[&[u32]],
        key_tokens: &[Vec<u32>],
        num_external_tokens: u32,
    ) {
        self.after_alloc(req, Some(tables), key_tokens, num_external_tokens);
    }

    fn load_deferred_groups(&mut self, req: &core::Request, tables: &[&[u32]], num_external_tokens: u32) {
        self.deferred(req, Some(tables), num_external_tokens);
    }

    fn load_deferred(&mut self, req: &core::Request, num_external_tokens: u32) {
        self.deferred(req, None, num_external_tokens);
    }

    fn request_finished(&mut self, req: &core::Request, block_ids: &[u32]) -> bool {
        Python::with_gil(|py| {
            let blocks = block_list(py, block_ids).map(Bound::into_any);
            self.finished(py, req, blocks)
        })
    }

    fn request_finished_groups(&mut self, req: &core::Request, tables: &[Vec<u32>]) -> bool {
        Python::with_gil(|py| {
            let views: Vec<&[u32]> = tables.iter().map(|t| &t[..]).collect();
            let blocks = table_lists(py, &views);
            self.finished(py, req, blocks)
        })
    }

    fn loaded_groups(&mut self, req: &core::Request) -> Option<Vec<usize>> {
        if !self.has_loaded_groups_hook {
            return None;
        }
        Python::with_gil(|py| {
            let hook = "get_loaded_kv_cache_group_ids";
            let res = self.obj.bind(py).call_method1(hook, (&*req.id,)).and_then(|r| {
                let bad = || {
                    bad_answer(
                        py,
                        hook,
                        format!("must return an iterable of int >= 0, got {}", type_name(&r)),
                    )
                };
                let mut groups = Vec::new();
                for item in r.try_iter().map_err(|_| bad())? {
                    let item = item?;
                    if item.is_instance_of::<PyBool>() {
                        return Err(bad());
                    }
                    groups.push(item.extract::<usize>().map_err(|_| bad())?);
                }
                Ok(groups)
            });
            match res {
                Ok(groups) => Some(groups),
                Err(e) => {
                    self.keep(e);
                    None
                }
            }
        })
    }

    fn local_hit_replaced(&mut self, req: &core::Request, num_local_tokens: u32) {
        if !self.has_local_hit_replaced_hook {
            return;
        }
        Python::with_gil(|py| {
            if let Err(e) = self.obj.bind(py).call_method1("local_hit_replaced", (&*req.id, num_local_tokens))
            {
                self.keep(e);
            }
        })
    }

    fn has_pending_block_frees(&mut self) -> bool {
        if !self.has_pending_frees_hook {
            return false;
        }
        Python::with_gil(|py| {
            let hook = "has_pending_block_frees";
            let res = self.obj.bind(py).call_method0(hook).and_then(|r| {
                r.downcast::<PyBool>()
                    .map(|b| b.is_true())
                    .map_err(|_| bad_answer(py, hook, format!("must return a bool, got {}", type_name(&r))))
            });
            res.unwrap_or_else(|e| {
                self.keep(e);
                false
            })
        })
    }
}

impl ConnectorHandle {
    /// Wraps `obj` (which must have the three scheduler hooks) and the core-side trait object around it.
    pub(crate) fn new(obj: &Bound<'_, PyAny>) -> PyResult<(Self, Box<dyn core::KvConnector>)> {
        let py = obj.py();
        for hook in ["get_num_new_matched_tokens", "update_state_after_alloc", "request_finished"] {
            if !obj.hasattr(hook)? {
                return Err(py_error(
                    py,
                    "SchedulerTypeError",
                    format!("kv_connector must have a {hook}() method, got {}", type_name(obj)),
                ));
            }
        }
        let state = Arc::new(Mutex::new(HookState::default()));
        // Opt-in (kvsched.vllm's bridge): how many leading blocks are in the prefix cache after the allocation.
        let pass_cached_blocks = match obj.getattr("wants_num_cached_blocks") {
            Ok(v) => v.is_truthy()?,
            Err(_) => false,
        };
        let has_pending_frees_hook = obj.hasattr("has_pending_block_frees")?;
        let has_load_deferred_hook = obj.hasattr("load_deferred")?;
        let has_loaded_groups_hook = obj.hasattr("get_loaded_kv_cache_group_ids")?;
        let has_local_hit_replaced_hook = obj.hasattr("local_hit_replaced")?;
        let inner = PyKvConnector {
            obj: obj.clone().unbind(),
            state: state.clone(),
            pass_cached_blocks,
            has_pending_frees_hook,
            has_load_deferred_hook,
            has_loaded_groups_hook,
            has_local_hit_replaced_hook,
        };
        let has_build_meta = obj.hasattr("build_connector_meta")?;
        Ok((ConnectorHandle { obj: obj.clone().unbind(), state, has_build_meta }, Box::new(inner)))
    }

    /// Raises the first exception a hook raised since the last check.
    pub(crate) fn check(&self) -> PyResult<()> {
        let err = self.state.lock().ok().and_then(|mut s| s.error.take());
        match err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The transfer parameters collected since the last call, as `{req_id: params}`.
    pub(crate) fn take_transfer_params(&self, py: Python<'_>) -> PyResult<Option<Py<PyDict>>> {
        let params = match self.state.lock() {
            Ok(mut s) if !s.transfer_params.is_empty() => std::mem::take(&mut s.transfer_params),
            _ => return Ok(None),
        };
        let d = PyDict::new(py);
        for (id, p) in params {
            d.set_item(&*id, p)?;
        }
        Ok(Some(d.unbind()))
    }

    /// `kv_connector.build_connector_meta(out)`, if the connector has it.
    pub(crate) fn build_meta(&self, py: Python<'_>, out: &Bound<'_, PyAny>) -> PyResult<Option<Py<PyAny>>> {
        if !self.has_build_meta {
            return Ok(None);
        }
        Ok(Some(self.obj.bind(py).call_method1("build_connector_meta", (out,))?.unbind()))
    }
}

/// An iterable of str ids for `update_kv_transfers` (None: empty).
pub(crate) fn id_list(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Vec<String>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else { return Ok(Vec::new()) };
    let py = obj.py();
    if obj.is_instance_of::<pyo3::types::PyString>() {
        return Err(py_error(
            py,
            "SchedulerTypeError",
            format!("{name} must be an iterable of str, not a str"),
        ));
    }
    let iter = obj.try_iter().map_err(|_| {
        py_error(
            py,
            "SchedulerTypeError",
            format!("{name} must be an iterable of str, got {}", type_name(obj)),
        )
    })?;
    let mut ids = Vec::new();
    for item in iter {
        let item = item?;
        ids.push(item.extract::<String>().map_err(|_| {
            py_error(py, "SchedulerTypeError", format!("{name} must hold str ids, got {}", type_name(&item)))
        })?);
    }
    Ok(ids)
}

/// An iterable of int block ids (None: empty).
pub(crate) fn int_list(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Vec<i64>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else { return Ok(Vec::new()) };
    let py = obj.py();
    let iter = obj.try_iter().map_err(|_| {
        py_error(
            py,
            "SchedulerTypeError",
            format!("{name} must be an iterable of int, got {}", type_name(obj)),
        )
    })?;
    let mut v = Vec::new();
    for item in iter {
        let item = item?;
        if item.is_instance_of::<PyBool>() {
            return Err(py_error(py, "SchedulerTypeError", format!("{name} must hold ints, got bool")));
        }
        v.push(crate::convert::int_arg(&item, name, "InvalidRequestError")?);
    }
    Ok(v)
}
