//! Argument conversion: Python ints, ids, token lists, ragged `(values, indptr)` inputs and hash seeds to Rust.
//!
//! Every argument is converted before the scheduler is borrowed, so no Python code (a hostile `__index__`, a
//! generator) can run while the core is mid-call. Bools are never accepted as ints; ints beyond int64 raise the
//! caller-chosen range class; anything else of the wrong type raises `SchedulerTypeError`. Integer arrays that
//! are aligned, C-contiguous int64 are borrowed from numpy without copying; everything else is converted once.

use numpy::{PyArray1, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList, PyString, PyTuple};

use crate::errors::{py_error, type_error};

pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

/// An int argument (Python int or numpy integer; not bool). Out-of-range values raise `range_class`.
pub(crate) fn int_arg(obj: &Bound<'_, PyAny>, name: &str, range_class: &str) -> PyResult<i64> {
    let py = obj.py();
    if obj.is_instance_of::<PyBool>() {
        return Err(type_error(py, format!("{name} must be an int, got bool")));
    }
    match obj.extract::<i64>() {
        Ok(v) => Ok(v),
        Err(_) if obj.is_instance_of::<PyInt>() => {
            Err(py_error(py, range_class, format!("{name} is out of the int64 range: {obj}")))
        }
        Err(_) => Err(type_error(py, format!("{name} must be an int, got {}", type_name(obj)))),
    }
}

/// Two list arguments of equal length, taken in pairs (`hash_lists` with `req_ids` or `token_lists`): not a list
/// raises `SchedulerTypeError`, unequal lengths `InvalidRequestError`.
pub(crate) fn paired_lists<'a, 'py>(
    a: &'a Bound<'py, PyAny>,
    a_name: &str,
    b: &'a Bound<'py, PyAny>,
    b_name: &str,
) -> PyResult<(&'a Bound<'py, PyList>, &'a Bound<'py, PyList>)> {
    let py = a.py();
    let a = a
        .downcast::<PyList>()
        .map_err(|_| type_error(py, format!("{a_name} must be a list, got {}", type_name(a))))?;
    let b = b
        .downcast::<PyList>()
        .map_err(|_| type_error(py, format!("{b_name} must be a list, got {}", type_name(b))))?;
    if a.len() != b.len() {
        return Err(py_error(
            py,
            "InvalidRequestError",
            format!("{a_name} has {} entries but {b_name} {}", a.len(), b.len()),
        ));
    }
    Ok((a, b))
}

/// A block size argument: an int above 0 (`InvalidRequestError` otherwise).
pub(crate) fn positive_block_size(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    let block_size = int_arg(obj, "block_size", "InvalidRequestError")?;
    usize::try_from(block_size).ok().filter(|&b| b > 0).ok_or_else(|| {
        py_error(obj.py(), "InvalidRequestError", format!("block_size must be positive, got {block_size}"))
    })
}

/// A float argument (a Python float or int, not bool). An int beyond the float range becomes infinity, which
/// the core's range check refuses with a clear message.
pub(crate) fn float_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<f64> {
    let py = obj.py();
    if obj.is_instance_of::<PyBool>() {
        return Err(type_error(py, format!("{name} must be a float, got bool")));
    }
    match obj.extract::<f64>() {
        Ok(v) => Ok(v),
        Err(_) if obj.is_instance_of::<PyInt>() => Ok(f64::INFINITY),
        Err(_) => Err(type_error(py, format!("{name} must be a float, got {}", type_name(obj)))),
    }
}

pub(crate) fn opt_int_arg(
    obj: Option<&Bound<'_, PyAny>>,
    name: &str,
    range_class: &str,
) -> PyResult<Option<i64>> {
    match obj {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) => int_arg(o, name, range_class).map(Some),
    }
}

pub(crate) fn opt_str_arg(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<String>> {
    match obj {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) => match o.downcast::<PyString>() {
            Ok(s) => s.to_str().map(|v| Some(v.to_owned())).map_err(|_| {
                py_error(
                    o.py(),
                    "InvalidRequestError",
                    format!("{name} is not valid unicode (lone surrogate)"),
                )
            }),
            Err(_) => Err(type_error(o.py(), format!("{name} must be a str or None, got {}", type_name(o)))),
        },
    }
}

/// A request id as a Rust string; ids that are not valid UTF-8 (lone surrogates) raise `class`.
pub(crate) fn id_arg(obj: &Bound<'_, PyAny>, class: &str) -> PyResult<String> {
    let s = str_arg(obj, "req_id")?;
    match s.to_str() {
        Ok(v) => Ok(v.to_owned()),
        Err(_) => {
            Err(py_error(obj.py(), class, format!("request id {s} is not valid unicode (lone surrogate)")))
        }
    }
}

pub(crate) fn str_arg<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Bound<'py, PyString>> {
    obj.downcast::<PyString>()
        .cloned()
        .map_err(|_| type_error(obj.py(), format!("{name} must be a str, got {}", type_name(obj))))
}

/// A 1-D integer numpy array as i64 values (copied; any integer dtype, any strides).
pub(crate) fn int_array_values(
    arr: &Bound<'_, PyUntypedArray>,
    name: &str,
    range_class: &str,
) -> PyResult<Vec<i64>> {
    let py = arr.py();
    if arr.ndim() != 1 {
        return Err(type_error(py, format!("{name} must be a 1-D array, got {} dimensions", arr.ndim())));
    }
    let kind = arr.dtype().kind();
    if kind != b'i' && kind != b'u' {
        return Err(type_error(py, format!("{name} must have an integer dtype, got {}", arr.dtype())));
    }
    if let Ok(a) = arr.downcast::<PyArray1<i64>>() {
        return Ok(a.readonly().as_array().to_vec());
    }
    if let Ok(a) = arr.downcast::<PyArray1<i32>>() {
        return Ok(a.readonly().as_array().iter().map(|&x| i64::from(x)).collect());
    }
    if let Ok(a) = arr.downcast::<PyArray1<u64>>() {
        let a = a.readonly();
        let mut out = Vec::with_capacity(a.len());
        for &x in a.as_array().iter() {
            match i64::try_from(x) {
                Ok(v) => out.push(v),
                Err(_) => {
                    return Err(py_error(py, range_class, format!("{name}: {x} is out of the int64 range")))
                }
            }
        }
        return Ok(out);
    }
    // Other widths: let numpy widen them.
    let wide = arr.call_method1("astype", ("int64",))?;
    let a = wide.downcast::<PyArray1<i64>>()?;
    Ok(a.readonly().as_array().to_vec())
}

/// A sequence of token ids: a 1-D integer numpy array, or a list/tuple of ints.
pub(crate) fn token_list(obj: &Bound<'_, PyAny>, name: &str, range_class: &str) -> PyResult<Vec<i64>> {
    let py = obj.py();
    if let Ok(arr) = obj.downcast::<PyUntypedArray>() {
        return int_array_values(arr, name, range_class);
    }
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(type_error(py, format!("{name} must be a list of ints, got {}", type_name(obj))));
    }
    if let Ok(list) = obj.downcast::<PyList>() {
        let mut out = Vec::with_capacity(list.len());
        for item in list.iter() {
            out.push(int_arg(&item, name, range_class)?);
        }
        return Ok(out);
    }
    if let Ok(tuple) = obj.downcast::<PyTuple>() {
        let mut out = Vec::with_capacity(tuple.len());
        for item in tuple.iter() {
            out.push(int_arg(&item, name, range_class)?);
        }
        return Ok(out);
    }
    Err(type_error(
        py,
        format!("{name} must be a list/tuple of ints or a 1-D integer array, got {}", type_name(obj)),
    ))
}

/// An integer array's values: borrowed straight from numpy when it is aligned, C-contiguous int64 (the hot
/// path: no copy, no numpy borrow bookkeeping), converted otherwise.
pub(crate) enum IntVals<'a> {
    Borrowed(&'a [i64]),
    Owned(Vec<i64>),
}

impl IntVals<'_> {
    pub(crate) fn as_slice(&self) -> &[i64] {
        match self {
            IntVals::Borrowed(s) => s,
            IntVals::Owned(v) => v,
        }
    }
}

pub(crate) fn int_vals<'a>(
    arr: &'a Bound<'_, PyUntypedArray>,
    name: impl Fn() -> String,
) -> PyResult<IntVals<'a>> {
    let dtype = arr.dtype();
    if arr.ndim() == 1 && dtype.kind() == b'i' && dtype.itemsize() == 8 && arr.is_c_contiguous() {
        // SAFETY: the array object is alive for 'a (we hold a reference to it), it is one-dimensional,
        // C-contiguous, of int64 items, and its data pointer is checked for alignment below. The GIL is held
        // and no Python code runs while the slice is in use, so nothing can resize or free the buffer.
        unsafe {
            let raw = &*arr.as_array_ptr();
            let ptr = raw.data as *const i64;
            let len = arr.len();
            if len == 0 {
                return Ok(IntVals::Borrowed(&[]));
            }
            if !ptr.is_null() && (ptr as usize) % std::mem::align_of::<i64>() == 0 {
                return Ok(IntVals::Borrowed(std::slice::from_raw_parts(ptr, len)));
            }
        }
    }
    int_array_values(arr, &name(), "InvalidOutputError").map(IntVals::Owned)
}

/// Ragged token lists, aligned with a step's scheduled requests: `(values, indptr)` arrays or a list of lists.
pub(crate) enum RaggedInput<'py> {
    Arrays(Bound<'py, PyUntypedArray>, Bound<'py, PyUntypedArray>),
    Lists(Vec<i64>, Vec<i64>),
}

impl<'py> RaggedInput<'py> {
    pub(crate) fn parse(obj: &Bound<'py, PyAny>, name: &'static str) -> PyResult<Self> {
        let py = obj.py();
        if let Ok(t) = obj.downcast::<PyTuple>() {
            if t.len() == 2 {
                let (v, p) = (t.get_item(0)?, t.get_item(1)?);
                if let (Ok(v), Ok(p)) =
                    (v.downcast_into::<PyUntypedArray>(), p.downcast_into::<PyUntypedArray>())
                {
                    return Ok(RaggedInput::Arrays(v, p));
                }
            }
            return Err(type_error(
                py,
                format!("{name}: a tuple must be (values, indptr), two 1-D integer arrays"),
            ));
        }
        if let Ok(list) = obj.downcast::<PyList>() {
            let (values, indptr) = ragged_from_lists(list, name)?;
            return Ok(RaggedInput::Lists(values, indptr));
        }
        Err(type_error(
            py,
            format!(
                "{name} must be a (values, indptr) pair of integer arrays or a list of lists, got {}",
                type_name(obj)
            ),
        ))
    }

    pub(crate) fn views(&self, name: &'static str) -> PyResult<(IntVals<'_>, IntVals<'_>)> {
        match self {
            RaggedInput::Arrays(v, p) => {
                Ok((int_vals(v, || format!("{name} values"))?, int_vals(p, || format!("{name} indptr"))?))
            }
            RaggedInput::Lists(v, p) => Ok((IntVals::Borrowed(v), IntVals::Borrowed(p))),
        }
    }
}

/// A list of token lists flattened into `(values, indptr)`.
///
/// vLLM's `sampled_token_ids` is exact lists of exact ints: `lists_fast` reads those with borrowed list items and
/// one C call per int, building no per-row object, vector or name string. Anything else in the list (a tuple, a
/// list subclass, a numpy array, a bool, a numpy integer, an int beyond int64) sends the whole input to the
/// general conversion, which accepts or rejects it exactly as before, with the same messages.
fn ragged_from_lists(list: &Bound<'_, PyList>, name: &str) -> PyResult<(Vec<i64>, Vec<i64>)> {
    if let Some(ragged) = lists_fast(list) {
        return Ok(ragged);
    }
    // The fast path leaves no exception set, but make sure none leaks into the general path.
    drop(PyErr::take(list.py()));
    let mut values = Vec::new();
    let mut indptr = Vec::with_capacity(list.len() + 1);
    indptr.push(0);
    for (i, entry) in list.iter().enumerate() {
        values.extend(token_list(&entry, &format!("{name}[{i}]"), "InvalidOutputError")?);
        indptr.push(values.len() as i64);
    }
    Ok((values, indptr))
}

/// The fast path of `ragged_from_lists`: `None` as soon as an entry is not an exact list or an item is not an
/// exact int in the int64 range.
fn lists_fast(list: &Bound<'_, PyList>) -> Option<(Vec<i64>, Vec<i64>)> {
    let num_rows = ffi::Py_ssize_t::try_from(list.len()).ok()?;
    let mut values = Vec::with_capacity(list.len());
    let mut indptr = Vec::with_capacity(list.len() + 1);
    indptr.push(0);
    // SAFETY: the GIL is held (we hold `list`, a live list). Nothing below can run Python code (type checks,
    // `Py_SIZE`, `PyList_GetItem` within bounds, `PyLong_AsLongLongAndOverflow` on an exact int), so no list
    // changes while we read it and the borrowed item pointers stay valid: their lists keep them alive.
    unsafe {
        let list_type = std::ptr::addr_of_mut!(ffi::PyList_Type);
        let int_type = std::ptr::addr_of_mut!(ffi::PyLong_Type);
        for i in 0..num_rows {
            let row = ffi::PyList_GetItem(list.as_ptr(), i);
            if row.is_null() || ffi::Py_TYPE(row) != list_type {
                return None;
            }
            // A list's `ob_size` is its length (`Py_SIZE` is inline; `PyList_Size` would be a call per row).
            for j in 0..ffi::Py_SIZE(row) {
                let item = ffi::PyList_GetItem(row, j);
                if item.is_null() || ffi::Py_TYPE(item) != int_type {
                    return None;
                }
                let mut overflow: std::os::raw::c_int = 0;
                let v = ffi::PyLong_AsLongLongAndOverflow(item, &mut overflow);
                // Beyond int64 (`overflow` set), or -1 with an error: let the general path raise its error.
                if overflow != 0 || (v == -1 && !ffi::PyErr_Occurred().is_null()) {
                    return None;
                }
                values.push(v);
            }
            indptr.push(values.len() as i64);
        }
    }
    Some((values, indptr))
}

pub(crate) fn seed_bytes(obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u8>>> {
    if obj.is_none() {
        return Ok(None);
    }
    let mut out = Vec::new();
    if let Ok(b) = obj.downcast::<PyBytes>() {
        out.extend_from_slice(b"b:");
        out.extend_from_slice(b.as_bytes());
    } else if let Ok(s) = obj.downcast::<PyString>() {
        out.extend_from_slice(b"s:");
        let v = s.to_str().map_err(|_| {
            py_error(obj.py(), "InvalidConfigError", "prefix_hash_seed is not valid unicode".into())
        })?;
        out.extend_from_slice(v.as_bytes());
    } else if obj.is_instance_of::<PyInt>() && !obj.is_instance_of::<PyBool>() {
        out.extend_from_slice(b"i:");
        out.extend_from_slice(obj.str()?.to_str()?.as_bytes());
    } else {
        return Err(py_error(
            obj.py(),
            "InvalidConfigError",
            format!("prefix_hash_seed must be None, an int, a str or bytes, got {}", type_name(obj)),
        ));
    }
    Ok(Some(out))
}
