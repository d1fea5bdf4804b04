//! Encoder-input conversion: `add_request(..., encoder_inputs=[(start, num_tokens, hash), ...])`.
//!
//! Accepts a list or tuple of 3-item lists or tuples of ints (or an `(m, 3)` integer array, read row by row). Positions
//! and lengths must fit int32 and hashes `[0, 2**64)`; the core checks the rest (inside the prompt, sorted, not
//! overlapping, sizes). Converted before the scheduler is borrowed, like every argument.

use kvsched_core::EncoderInput;
use numpy::PyUntypedArray;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt, PyList, PyTuple};

use crate::convert::{int_arg, type_name};
use crate::errors::{py_error, type_error};

fn bad(py: Python<'_>, msg: String) -> PyErr {
    py_error(py, "InvalidRequestError", msg)
}

/// A hash: a Python (or numpy) int in `[0, 2**64)`.
fn hash_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    let py = obj.py();
    if obj.is_instance_of::<PyBool>() {
        return Err(type_error(py, format!("{what} must be an int, got bool")));
    }
    match obj.extract::<u64>() {
        Ok(v) => Ok(v),
        Err(_) if obj.is_instance_of::<PyInt>() || obj.extract::<i64>().is_ok() => {
            Err(bad(py, format!("{what} must be in [0, 2**64), got {obj}")))
        }
        Err(_) => Err(type_error(py, format!("{what} must be an int, got {}", type_name(obj)))),
    }
}

/// A position or length: an int in `[0, 2**31)`.
fn u32_field(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u32> {
    let v = int_arg(obj, what, "InvalidRequestError")?;
    u32::try_from(v)
        .ok()
        .filter(|&v| v <= i32::MAX as u32)
        .ok_or_else(|| bad(obj.py(), format!("{what} must be in [0, {}], got {v}", i32::MAX)))
}

/// `encoder_inputs` (None: no inputs): a list or tuple of `(start, num_tokens, hash)` lists or tuples, or an
/// `(m, 3)` integer numpy array.
pub(crate) fn encoder_inputs_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<EncoderInput>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(Vec::new());
    };
    let py = obj.py();
    let shape_error = || {
        type_error(
            py,
            format!("encoder_inputs must be a list of (start, num_tokens, hash), got {}", type_name(obj)),
        )
    };
    let owned;
    let seq: &Bound<'_, PyAny> = if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        obj
    } else if obj.is_instance_of::<PyUntypedArray>() {
        owned = obj.call_method0("tolist")?;
        if !owned.is_instance_of::<PyList>() {
            return Err(shape_error());
        }
        &owned
    } else {
        return Err(shape_error());
    };
    let n = seq.len()?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let item = seq.get_item(i)?;
        let is_seq = item.is_instance_of::<PyList>() || item.is_instance_of::<PyTuple>();
        if !is_seq || item.len()? != 3 {
            return Err(type_error(
                py,
                format!(
                    "encoder_inputs[{i}] must be a (start, num_tokens, hash) triple, got {}",
                    type_name(&item)
                ),
            ));
        }
        let start = u32_field(&item.get_item(0)?, &format!("encoder_inputs[{i}] start"))?;
        let num_tokens = u32_field(&item.get_item(1)?, &format!("encoder_inputs[{i}] num_tokens"))?;
        let hash = hash_arg(&item.get_item(2)?, &format!("encoder_inputs[{i}] hash"))?;
        out.push(EncoderInput { start, num_tokens, hash });
    }
    Ok(out)
}
