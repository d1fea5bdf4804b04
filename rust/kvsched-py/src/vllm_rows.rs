//! `extend_lists_by_rows`: a step's sampled tokens appended to the requests' token lists in one call, for
//! `kvsched.vllm`'s steady decoding (vLLM's `Request` keeps each token in two lists); `int_list`: a step's
//! columns of counts as the lists of ints vLLM's step output holds.

use std::sync::Mutex;

use numpy::{PyArray1, PyArrayMethods};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

/// Appends the items of `rows[i]` to `first[i]` and to `second[i]`, for every `i`. Returns False and changes
/// nothing when the three are not lists of the same length or one of their entries is not exactly a list (the
/// caller then extends them its own way).
#[pyfunction]
pub(crate) fn extend_lists_by_rows<'py>(
    py: Python<'py>,
    first: &Bound<'py, PyAny>,
    second: &Bound<'py, PyAny>,
    rows: &Bound<'py, PyAny>,
) -> PyResult<bool> {
    let (Ok(first), Ok(second), Ok(rows)) =
        (first.downcast::<PyList>(), second.downcast::<PyList>(), rows.downcast::<PyList>())
    else {
        return Ok(false);
    };
    let n = rows.len();
    if first.len() != n || second.len() != n {
        return Ok(false);
    }
    let (first, second, rows) = (first.as_ptr(), second.as_ptr(), rows.as_ptr());
    let mut entries: Vec<[*mut ffi::PyObject; 3]> = Vec::with_capacity(n);
    // SAFETY: the three pointers are lists kept alive by the borrowed arguments, and the GIL is held throughout.
    // Every index read is below the length checked above. The entries are read first (`PyList_GetItem`:
    // borrowed references, checked to be exact lists by their type, which runs no code); then the lists only
    // grow (`PyList_Append`, which runs no Python code and releases no reference), so every entry read, and
    // every item of a row, stays alive, held by its list, even where a list is also one of the rows or the outer
    // lists. A row's length (`Py_SIZE`, inline) is read once, before its items are appended anywhere.
    unsafe {
        let list_type = std::ptr::addr_of_mut!(ffi::PyList_Type);
        for i in 0..n as ffi::Py_ssize_t {
            let entry =
                [ffi::PyList_GetItem(first, i), ffi::PyList_GetItem(second, i), ffi::PyList_GetItem(rows, i)];
            if entry.iter().any(|&e| e.is_null() || ffi::Py_TYPE(e) != list_type) {
                drop(PyErr::take(py));
                return Ok(false);
            }
            entries.push(entry);
        }
        for [a, b, row] in entries {
            for j in 0..ffi::Py_SIZE(row) {
                let token = ffi::PyList_GetItem(row, j);
                if token.is_null() || ffi::PyList_Append(a, token) < 0 || ffi::PyList_Append(b, token) < 0 {
                    return Err(PyErr::fetch(py));
                }
            }
        }
    }
    Ok(true)
}

/// The Python ints `0..len` that `int_list` hands out, shared by every call (grown on demand up to
/// `MAX_SHARED_INT`, never shrunk).
static SHARED_INTS: Mutex<Vec<Py<PyAny>>> = Mutex::new(Vec::new());

/// Values from here on get a fresh int each time (the shared ones stay within a few MiB).
const MAX_SHARED_INT: i32 = 1 << 17;

/// `values.tolist()` for a 1-D int32 array, with an int object shared between calls for each value in
/// `0..MAX_SHARED_INT`: a step's columns of token counts (computed tokens, output tokens) become lists without
/// allocating an int for every entry. Any other array (or object) goes through its own `tolist()`.
#[pyfunction]
pub(crate) fn int_list<'py>(py: Python<'py>, values: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let Ok(arr) = values.downcast::<PyArray1<i32>>() else {
        return values.call_method0("tolist");
    };
    let arr = arr.readonly();
    let Ok(values) = arr.as_slice() else {
        return arr.as_array().to_vec().into_pyobject(py).map(Bound::into_any);
    };
    let mut shared = SHARED_INTS.lock().unwrap_or_else(|e| e.into_inner());
    let top = values.iter().fold(-1, |m, &v| if v < MAX_SHARED_INT { m.max(v) } else { m });
    if top >= 0 && top as usize >= shared.len() {
        // Grow to the next power of two past the largest value (at most MAX_SHARED_INT).
        let want = (top as usize + 1).next_power_of_two().min(MAX_SHARED_INT as usize);
        for v in shared.len()..want {
            shared.push(v.into_pyobject(py)?.into_any().unbind());
        }
    }
    let n = ffi::Py_ssize_t::try_from(values.len())
        .map_err(|_| pyo3::exceptions::PyOverflowError::new_err("int_list: too many values"))?;
    // SAFETY: the GIL is held. `PyList_New` returns a new list of `n` empty slots (or null with an exception
    // set), owned by `list` from here on; each slot is filled exactly once with a new reference
    // (`PyList_SetItem` steals it): a shared int with its count raised, or a fresh int. Nothing here runs
    // Python code.
    unsafe {
        let list = ffi::PyList_New(n);
        if list.is_null() {
            return Err(PyErr::fetch(py));
        }
        let list = Bound::from_owned_ptr(py, list);
        for (i, &v) in (0..n).zip(values) {
            let item = match shared.get(v as u32 as usize) {
                Some(obj) => {
                    ffi::Py_IncRef(obj.as_ptr());
                    obj.as_ptr()
                }
                None => {
                    let obj = ffi::PyLong_FromLong(std::os::raw::c_long::from(v));
                    if obj.is_null() {
                        return Err(PyErr::fetch(py));
                    }
                    obj
                }
            };
            ffi::PyList_SetItem(list.as_ptr(), i, item);
        }
        Ok(list)
    }
}
