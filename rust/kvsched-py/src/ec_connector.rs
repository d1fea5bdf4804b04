//! The encoder-cache connector: a Python object behind the core's `EcConnector` trait.
//!
//! The core calls its hooks only from inside `schedule()`. A hook's exception (or an answer that is not a
//! bool) cannot unwind through the core: the hook answers conservatively (`has_cache_item`: false, the input
//! is computed; `ensure_cache_available`: true), the exception is kept, and the binding raises it once the core
//! call has returned (the scheduler is consistent then).

use std::sync::{Arc, Mutex};

use kvsched_core as core;
use pyo3::prelude::*;
use pyo3::types::PyBool;

use crate::convert::type_name;
use crate::errors::py_error;

/// The binding's handle on an EC connector: the Python object and the first exception its hooks raised.
pub(crate) struct EcHandle {
    pub(crate) obj: Py<PyAny>,
    error: Arc<Mutex<Option<PyErr>>>,
}

struct PyEcConnector {
    obj: Py<PyAny>,
    error: Arc<Mutex<Option<PyErr>>>,
    /// The object has the optional `ensure_cache_available(req_id, num_computed_tokens)` hook.
    has_ensure_hook: bool,
    /// The object has the optional `update_state_after_alloc(req_id, input_index)` hook.
    has_alloc_hook: bool,
}

impl PyEcConnector {
    fn ask(
        &self,
        conservative: bool,
        call: impl FnOnce(Python<'_>) -> PyResult<Bound<'_, PyAny>>,
        hook: &str,
    ) -> bool {
        Python::with_gil(|py| {
            let res = call(py).and_then(|r| {
                r.downcast::<PyBool>().map(|b| b.is_true()).map_err(|_| {
                    py_error(
                        py,
                        "SchedulerTypeError",
                        format!("ec_connector.{hook} must return a bool, got {}", type_name(&r)),
                    )
                })
            });
            res.unwrap_or_else(|e| {
                if let Ok(mut s) = self.error.lock() {
                    if s.is_none() {
                        *s = Some(e);
                    }
                }
                conservative
            })
        })
    }
}

impl core::EcConnector for PyEcConnector {
    fn has_cache_item(&mut self, hash: u64) -> bool {
        let obj = &self.obj;
        self.ask(false, |py| obj.bind(py).call_method1("has_cache_item", (hash,)), "has_cache_item")
    }

    fn ensure_cache_available(&mut self, req: &core::Request, num_computed_tokens: u32) -> bool {
        if !self.has_ensure_hook {
            return true;
        }
        let obj = &self.obj;
        self.ask(
            true,
            |py| obj.bind(py).call_method1("ensure_cache_available", (&*req.id, num_computed_tokens)),
            "ensure_cache_available",
        )
    }

    fn update_state_after_alloc(&mut self, req: &core::Request, input: u32) {
        if !self.has_alloc_hook {
            return;
        }
        Python::with_gil(|py| {
            if let Err(e) = self.obj.bind(py).call_method1("update_state_after_alloc", (&*req.id, input)) {
                if let Ok(mut s) = self.error.lock() {
                    if s.is_none() {
                        *s = Some(e);
                    }
                }
            }
        })
    }
}

impl EcHandle {
    /// Wraps `obj` (which must have `has_cache_item`) and the core-side trait object around it.
    pub(crate) fn new(obj: &Bound<'_, PyAny>) -> PyResult<(Self, Box<dyn core::EcConnector>)> {
        let py = obj.py();
        if !obj.hasattr("has_cache_item")? {
            return Err(py_error(
                py,
                "SchedulerTypeError",
                format!("ec_connector must have a has_cache_item() method, got {}", type_name(obj)),
            ));
        }
        let error = Arc::new(Mutex::new(None));
        let inner = PyEcConnector {
            obj: obj.clone().unbind(),
            error: error.clone(),
            has_ensure_hook: obj.hasattr("ensure_cache_available")?,
            has_alloc_hook: obj.hasattr("update_state_after_alloc")?,
        };
        Ok((EcHandle { obj: obj.clone().unbind(), error }, Box::new(inner)))
    }

    /// Raises the first exception a hook raised since the last check.
    pub(crate) fn check(&self) -> PyResult<()> {
        match self.error.lock().ok().and_then(|mut s| s.take()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
