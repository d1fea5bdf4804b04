//! The cache-hit cap: a Python object behind the core's `CacheHitCap` trait.
//!
//! The core calls its hooks only from inside `schedule()`, with the request's id and, per full block of the
//! request, whether the prefix cache holds it now (a list of bools). A hook's exception (or an answer that is
//! not a non-negative int) cannot unwind through the core: the hook answers conservatively (0: no hit), the
//! exception is kept, and the binding raises it once the core call has returned (the scheduler is consistent
//! then).

use std::sync::{Arc, Mutex};

use kvsched_core as core;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt, PyList};

use crate::convert::type_name;
use crate::errors::py_error;

/// The binding's handle on a cap: the Python object and the first exception its hooks raised.
pub(crate) struct HitCapHandle {
    pub(crate) obj: Py<PyAny>,
    error: Arc<Mutex<Option<PyErr>>>,
}

struct PyHitCap {
    obj: Py<PyAny>,
    error: Arc<Mutex<Option<PyErr>>>,
}

impl PyHitCap {
    fn ask(&self, call: impl FnOnce(Python<'_>) -> PyResult<Bound<'_, PyAny>>, hook: &str) -> u32 {
        Python::with_gil(|py| {
            let res = call(py).and_then(|r| {
                let bad = || {
                    py_error(
                        py,
                        "SchedulerTypeError",
                        format!("cache_hit_cap.{hook} must return an int >= 0, got {}", value_repr(&r)),
                    )
                };
                if r.is_instance_of::<PyBool>() || !r.is_instance_of::<PyInt>() {
                    return Err(bad());
                }
                match r.extract::<i128>() {
                    Ok(v) if v >= 0 => Ok(u32::try_from(v).unwrap_or(u32::MAX)),
                    Ok(_) => Err(bad()),
                    // Beyond i128: a huge cap is no cap.
                    Err(_) if r.gt(0).unwrap_or(false) => Ok(u32::MAX),
                    Err(_) => Err(bad()),
                }
            });
            res.unwrap_or_else(|e| {
                if let Ok(mut s) = self.error.lock() {
                    if s.is_none() {
                        *s = Some(e);
                    }
                }
                0
            })
        })
    }
}

fn value_repr(v: &Bound<'_, PyAny>) -> String {
    if v.is_instance_of::<PyInt>() {
        v.str().map(|s| s.to_string()).unwrap_or_else(|_| type_name(v))
    } else {
        type_name(v)
    }
}

impl core::CacheHitCap for PyHitCap {
    fn max_cache_hit(&mut self, req: &core::Request, cached: &[bool]) -> u32 {
        let obj = &self.obj;
        self.ask(
            |py| {
                let mask = PyList::new(py, cached)?;
                obj.bind(py).call_method1("max_cache_hit", (&*req.id, mask))
            },
            "max_cache_hit",
        )
    }

    fn cap_external_hit(&mut self, req: &core::Request, cached: &[bool], local: u32, ext: u32) -> u32 {
        let obj = &self.obj;
        self.ask(
            |py| {
                let mask = PyList::new(py, cached)?;
                obj.bind(py).call_method1("cap_external_hit", (&*req.id, mask, local, ext))
            },
            "cap_external_hit",
        )
    }
}

impl HitCapHandle {
    /// Wraps `obj` (which must have `max_cache_hit` and `cap_external_hit`) and the core-side trait object.
    pub(crate) fn new(obj: &Bound<'_, PyAny>) -> PyResult<(Self, Box<dyn core::CacheHitCap>)> {
        let py = obj.py();
        for hook in ["max_cache_hit", "cap_external_hit"] {
            if !obj.hasattr(hook)? {
                return Err(py_error(
                    py,
                    "SchedulerTypeError",
                    format!("cache_hit_cap must have a {hook}() method, got {}", type_name(obj)),
                ));
            }
        }
        let error = Arc::new(Mutex::new(None));
        let inner = PyHitCap { obj: obj.clone().unbind(), error: error.clone() };
        Ok((HitCapHandle { obj: obj.clone().unbind(), error }, Box::new(inner)))
    }

    /// Raises the first exception a hook raised since the last check.
    pub(crate) fn check(&self) -> PyResult<()> {
        match self.error.lock().ok().and_then(|mut s| s.take()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
