//! `extend_lists_by_rows`: a step's sampled tokens appended to the requests' token lists in one call, for
//! `kvsched.vllm`'s steady decoding (vLLM's `Request` keeps each token in two lists).

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyList;

/// Appends the items of `rows[i]` to `first[i]` and to `second[i]`, for every `i`. Returns False and changes
/// nothing when the three are not lists of the same length or one of their entries is not a list (the caller
/// then extends them its own way).
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
    // SAFETY: the three pointers are lists kept alive by the borrowed arguments, and the GIL is held throughout.
    // Every index read is below the length checked above, and the lists only grow here (`PyList_Append`, which
    // runs no Python code and releases no reference, so even a list that is also one of the rows or the outer
    // lists keeps each item read from it alive). `PyList_GetItem` returns borrowed references that are used
    // before anything could drop them; `PyList_Append` takes its own reference to the token.
    unsafe {
        for i in 0..n as ffi::Py_ssize_t {
            if ffi::PyList_Check(ffi::PyList_GetItem(first, i)) == 0
                || ffi::PyList_Check(ffi::PyList_GetItem(second, i)) == 0
                || ffi::PyList_Check(ffi::PyList_GetItem(rows, i)) == 0
            {
                return Ok(false);
            }
        }
        for i in 0..n as ffi::Py_ssize_t {
            let a = ffi::PyList_GetItem(first, i);
            let b = ffi::PyList_GetItem(second, i);
            let row = ffi::PyList_GetItem(rows, i);
            for j in 0..ffi::PyList_Size(row) {
                let token = ffi::PyList_GetItem(row, j);
                if ffi::PyList_Append(a, token) < 0 || ffi::PyList_Append(b, token) < 0 {
                    return Err(PyErr::fetch(py));
                }
            }
        }
    }
    Ok(true)
}
