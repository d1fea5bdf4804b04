//! `kvsched._core`: thin PyO3 bindings of `kvsched-core`. Conversions and error mapping only.
//!
//! Every Python argument is converted before the scheduler is borrowed, so no Python code (a hostile
//! `__index__`, a generator) can run while the core is mid-call; every core call goes through `guard`, which
//! turns a Rust panic into `kvsched.InternalError` instead of letting `PanicException` escape. The step hot
//! path builds no per-request Python objects: ids are interned once per request (at `add_request`) and reused,
//! arrays are moved into numpy without copying, and list/array views are built lazily on first access.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use kvsched_core as core;
use kvsched_core::{Ragged, RequestParams, SchedError};
use numpy::ndarray::Array2;
use numpy::{
    IntoPyArray, PyArray1, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyInt, PyList, PyString, PyTuple, PyType};

// ---------------------------------------------------------------------------------------------------------
// Errors

fn py_error(py: Python<'_>, class: &str, msg: String) -> PyErr {
    let cls = py
        .import("kvsched._errors")
        .and_then(|m| m.getattr(class))
        .and_then(|c| c.downcast_into::<PyType>().map_err(PyErr::from));
    match cls {
        Ok(cls) => PyErr::from_type(cls, msg),
        Err(e) => e,
    }
}

fn map_err(py: Python<'_>, e: SchedError) -> PyErr {
    let class = match &e {
        SchedError::InvalidConfig(_) => "InvalidConfigError",
        SchedError::InvalidRequest(_) => "InvalidRequestError",
        SchedError::DuplicateRequest(_) => "DuplicateRequestError",
        SchedError::UnknownRequest(_) => "UnknownRequestError",
        SchedError::InvalidOutput(_) => "InvalidOutputError",
        SchedError::Internal(_) => "InternalError",
    };
    py_error(py, class, e.to_string())
}

fn type_error(py: Python<'_>, msg: String) -> PyErr {
    py_error(py, "SchedulerTypeError", msg)
}

/// Runs a core call, mapping its error and catching any panic.
fn guard<T>(py: Python<'_>, f: impl FnOnce() -> core::Result<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(map_err(py, e)),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(py_error(py, "InternalError", format!("kvsched core panicked: {what}")))
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Argument conversion

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

/// An int argument (Python int or numpy integer; not bool). Out-of-range values raise `range_class`.
fn int_arg(obj: &Bound<'_, PyAny>, name: &str, range_class: &str) -> PyResult<i64> {
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

fn opt_int_arg(obj: Option<&Bound<'_, PyAny>>, name: &str, range_class: &str) -> PyResult<Option<i64>> {
    match obj {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) => int_arg(o, name, range_class).map(Some),
    }
}

fn opt_str_arg(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<String>> {
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
fn id_arg(obj: &Bound<'_, PyAny>, class: &str) -> PyResult<String> {
    let s = str_arg(obj, "req_id")?;
    match s.to_str() {
        Ok(v) => Ok(v.to_owned()),
        Err(_) => {
            Err(py_error(obj.py(), class, format!("request id {s} is not valid unicode (lone surrogate)")))
        }
    }
}

fn str_arg<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Bound<'py, PyString>> {
    obj.downcast::<PyString>()
        .cloned()
        .map_err(|_| type_error(obj.py(), format!("{name} must be a str, got {}", type_name(obj))))
}

/// A 1-D integer numpy array as i64 values (copied; any integer dtype, any strides).
fn int_array_values(arr: &Bound<'_, PyUntypedArray>, name: &str, range_class: &str) -> PyResult<Vec<i64>> {
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
fn token_list(obj: &Bound<'_, PyAny>, name: &str, range_class: &str) -> PyResult<Vec<i64>> {
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
enum IntVals<'a> {
    Borrowed(&'a [i64]),
    Owned(Vec<i64>),
}

impl IntVals<'_> {
    fn as_slice(&self) -> &[i64] {
        match self {
            IntVals::Borrowed(s) => s,
            IntVals::Owned(v) => v,
        }
    }
}

fn int_vals<'a>(arr: &'a Bound<'_, PyUntypedArray>, name: impl Fn() -> String) -> PyResult<IntVals<'a>> {
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
enum RaggedInput<'py> {
    Arrays(Bound<'py, PyUntypedArray>, Bound<'py, PyUntypedArray>),
    Lists(Vec<i64>, Vec<i64>),
}

impl<'py> RaggedInput<'py> {
    fn parse(obj: &Bound<'py, PyAny>, name: &'static str) -> PyResult<Self> {
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
            let mut values = Vec::new();
            let mut indptr = Vec::with_capacity(list.len() + 1);
            indptr.push(0);
            for (i, entry) in list.iter().enumerate() {
                values.extend(token_list(&entry, &format!("{name}[{i}]"), "InvalidOutputError")?);
                indptr.push(values.len() as i64);
            }
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

    fn views(&self, name: &'static str) -> PyResult<(IntVals<'_>, IntVals<'_>)> {
        match self {
            RaggedInput::Arrays(v, p) => {
                Ok((int_vals(v, || format!("{name} values"))?, int_vals(p, || format!("{name} indptr"))?))
            }
            RaggedInput::Lists(v, p) => Ok((IntVals::Borrowed(v), IntVals::Borrowed(p))),
        }
    }
}

fn seed_bytes(obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u8>>> {
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

fn config_from_py(cfg: &Bound<'_, PyAny>) -> PyResult<core::SchedulerConfig> {
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
    let policy = core::Policy::parse(&str_field("policy")?).map_err(|e| map_err(py, e))?;
    let algo = core::HashAlgo::parse(&str_field("prefix_hash_algo")?).map_err(|e| map_err(py, e))?;
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
        prefix_hash_algo: algo,
        prefix_hash_seed: seed_bytes(&cfg.getattr("prefix_hash_seed")?)?,
    })
}

// ---------------------------------------------------------------------------------------------------------
// Lazily converted arrays

/// A Rust vector that becomes a numpy array (moved, not copied) the first time Python asks for it.
enum LazyArray<T: numpy::Element> {
    Raw(Vec<T>),
    Py(Py<PyArray1<T>>),
}

impl<T: numpy::Element> LazyArray<T> {
    fn get<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<T>> {
        if let LazyArray::Raw(v) = self {
            let arr = std::mem::take(v).into_pyarray(py);
            *self = LazyArray::Py(arr.clone().unbind());
            return arr;
        }
        match self {
            LazyArray::Py(a) => a.bind(py).clone(),
            LazyArray::Raw(_) => PyArray1::from_vec(py, Vec::new()),
        }
    }
}

fn cached_list<'py>(
    py: Python<'py>,
    cache: &mut Option<Py<PyList>>,
    make: impl FnOnce() -> PyResult<Bound<'py, PyList>>,
) -> PyResult<Bound<'py, PyList>> {
    if let Some(l) = cache {
        return Ok(l.bind(py).clone());
    }
    let l = make()?;
    *cache = Some(l.clone().unbind());
    Ok(l)
}

// ---------------------------------------------------------------------------------------------------------
// SchedulerOutput

/// The caller's id strings of one step's scheduled requests, shareable between consecutive outputs.
type SharedIds = Arc<Vec<Py<PyString>>>;

/// One step's decisions (see docs/semantics.md). Arrays and lists are built on first access.
#[pyclass(module = "kvsched._core", name = "SchedulerOutput")]
struct PySchedulerOutput {
    #[pyo3(get)]
    step_id: u64,
    #[pyo3(get)]
    total_num_scheduled_tokens: u64,
    scheduler_id: u64,
    /// Shared with the next output when the scheduled requests are the same (steady decode).
    ids: SharedIds,
    new_reqs: Vec<u32>,
    resumed_reqs: Vec<u32>,
    preempted_ids: Vec<Py<PyString>>,
    finished_ids: Vec<Arc<str>>,
    num_scheduled_tokens: LazyArray<i32>,
    num_computed_tokens: LazyArray<i32>,
    new_block_ids: LazyArray<i32>,
    new_block_ids_indptr: LazyArray<i32>,
    spec_token_ids: LazyArray<i32>,
    spec_token_ids_indptr: LazyArray<i32>,
    req_ids_cache: Option<Py<PyList>>,
}

#[pymethods]
impl PySchedulerOutput {
    #[getter]
    fn req_ids<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let ids = &self.ids;
        cached_list(py, &mut self.req_ids_cache, || PyList::new(py, ids.iter().map(|s| s.bind(py))))
    }

    #[getter]
    fn num_reqs(&self) -> usize {
        self.ids.len()
    }

    #[getter]
    fn num_scheduled_tokens<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.num_scheduled_tokens.get(py)
    }

    #[getter]
    fn num_computed_tokens<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.num_computed_tokens.get(py)
    }

    #[getter]
    fn new_block_ids<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.new_block_ids.get(py)
    }

    #[getter]
    fn new_block_ids_indptr<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.new_block_ids_indptr.get(py)
    }

    #[getter]
    fn spec_token_ids<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.spec_token_ids.get(py)
    }

    #[getter]
    fn spec_token_ids_indptr<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.spec_token_ids_indptr.get(py)
    }

    #[getter]
    fn new_req_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.new_reqs.iter().map(|&i| self.ids[i as usize].bind(py)))
    }

    #[getter]
    fn resumed_req_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.resumed_reqs.iter().map(|&i| self.ids[i as usize].bind(py)))
    }

    #[getter]
    fn preempted_req_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.preempted_ids.iter().map(|s| s.bind(py)))
    }

    #[getter]
    fn finished_req_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(py, self.finished_ids.iter().map(|s| PyString::new(py, s)))
    }

    /// `{req_id: num_scheduled_tokens}`, built on demand (not for the hot path).
    fn num_scheduled_tokens_by_id<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let counts = self.num_scheduled_tokens.get(py);
        let counts = counts.readonly();
        let d = PyDict::new(py);
        for (id, n) in self.ids.iter().zip(counts.as_array().iter()) {
            d.set_item(id.bind(py), *n)?;
        }
        Ok(d)
    }

    fn __len__(&self) -> usize {
        self.ids.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "SchedulerOutput(step_id={}, num_reqs={}, total_num_scheduled_tokens={}, num_new={}, num_resumed={}, \
             num_preempted={}, num_finished={})",
            self.step_id,
            self.ids.len(),
            self.total_num_scheduled_tokens,
            self.new_reqs.len(),
            self.resumed_reqs.len(),
            self.preempted_ids.len(),
            self.finished_ids.len()
        )
    }
}

// ---------------------------------------------------------------------------------------------------------
// UpdateResult and ModelInputs

/// What applying one step's sampled tokens did.
#[pyclass(module = "kvsched._core", name = "UpdateResult")]
struct PyUpdateResult {
    finished_ids: Vec<Arc<str>>,
    finish_reasons: LazyArray<i8>,
    stop_reasons: LazyArray<i64>,
    num_new_tokens: LazyArray<i32>,
    finished_cache: Option<Py<PyList>>,
}

#[pymethods]
impl PyUpdateResult {
    #[getter]
    fn finished_req_ids<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let ids = &self.finished_ids;
        cached_list(py, &mut self.finished_cache, || {
            PyList::new(py, ids.iter().map(|s| PyString::new(py, s)))
        })
    }

    #[getter]
    fn finish_reasons<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i8>> {
        self.finish_reasons.get(py)
    }

    #[getter]
    fn stop_reasons<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        self.stop_reasons.get(py)
    }

    #[getter]
    fn num_new_tokens<'py>(&mut self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        self.num_new_tokens.get(py)
    }

    fn __repr__(&self) -> String {
        format!("UpdateResult(num_finished={})", self.finished_ids.len())
    }
}

/// The flat int32 batch layout of one step for a paged-attention runner.
#[pyclass(module = "kvsched._core", name = "ModelInputs", frozen)]
struct PyModelInputs {
    #[pyo3(get)]
    input_token_ids: Py<PyArray1<i32>>,
    #[pyo3(get)]
    input_positions: Py<PyArray1<i32>>,
    #[pyo3(get)]
    slot_mapping: Py<PyArray1<i32>>,
    #[pyo3(get)]
    query_start_loc: Py<PyArray1<i32>>,
    #[pyo3(get)]
    seq_lens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    block_table: Py<PyAny>,
    #[pyo3(get)]
    logits_indices: Py<PyArray1<i32>>,
    #[pyo3(get)]
    num_reqs: usize,
    #[pyo3(get)]
    num_tokens: usize,
    #[pyo3(get)]
    max_seq_len: i32,
    #[pyo3(get)]
    max_query_len: i32,
}

#[pymethods]
impl PyModelInputs {
    fn __repr__(&self) -> String {
        format!(
            "ModelInputs(num_reqs={}, num_tokens={}, max_seq_len={}, max_query_len={})",
            self.num_reqs, self.num_tokens, self.max_seq_len, self.max_query_len
        )
    }
}

// ---------------------------------------------------------------------------------------------------------
// Scheduler

/// The Rust scheduler. Use `kvsched.Scheduler` (a thin Python subclass that builds the config).
#[pyclass(module = "kvsched._core", name = "Scheduler", subclass)]
struct PyScheduler {
    core: core::Scheduler,
    /// The caller's id string of each live request, by slot: reused for every step's `req_ids`.
    py_ids: Vec<Option<Py<PyString>>>,
    /// The previous step's scheduled handles and their ids: reused while the batch does not change.
    last_ids: Option<(Vec<core::ReqHandle>, SharedIds)>,
    config: Py<PyAny>,
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

fn warn_preempted(py: Python<'_>, num: usize, total: u64) -> PyResult<()> {
    py.import("kvsched.scheduler")?.getattr("_on_preemption")?.call1((num, total))?;
    Ok(())
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (config, *_args, **_kwargs))]
    fn new(
        config: &Bound<'_, PyAny>,
        _args: &Bound<'_, PyTuple>,
        _kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let py = config.py();
        let cfg = config_from_py(config)?;
        let core = guard(py, || core::Scheduler::new(cfg))?;
        Ok(PyScheduler { core, py_ids: Vec::new(), last_ids: None, config: config.clone().unbind() })
    }

    #[getter]
    fn config(&self, py: Python<'_>) -> Py<PyAny> {
        self.config.clone_ref(py)
    }

    #[pyo3(signature = (req_id, prompt_token_ids, max_tokens=None, min_tokens=None, eos_token_id=None,
        ignore_eos=None, stop_token_ids=None, priority=None, arrival_time=None, cache_salt=None, lora_name=None))]
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
    ) -> PyResult<()> {
        let py = slf.py();
        let bad = |msg: String| py_error(py, "InvalidRequestError", msg);
        let id = str_arg(req_id, "req_id")?;
        let prompt = token_list(prompt_token_ids, "prompt_token_ids", "InvalidRequestError")?;
        // Python ints beyond int64 are still valid limits: a huge max_tokens is capped by max_model_len.
        let huge_positive = |o: Option<&Bound<'_, PyAny>>| -> bool {
            o.is_some_and(|o| o.is_instance_of::<PyInt>() && o.gt(i64::MAX).unwrap_or(false))
        };
        let max_tokens = if huge_positive(max_tokens) {
            Some(u32::MAX)
        } else {
            match opt_int_arg(max_tokens, "max_tokens", "InvalidRequestError")? {
                None => None,
                Some(m) if m < 1 => return Err(bad(format!("max_tokens must be >= 1, got {m}"))),
                Some(m) => Some(u32::try_from(m).unwrap_or(u32::MAX)),
            }
        };
        let min_tokens = match opt_int_arg(min_tokens, "min_tokens", "InvalidRequestError")? {
            None => 0,
            Some(m) if m < 0 => return Err(bad(format!("min_tokens must be >= 0, got {m}"))),
            Some(m) => u32::try_from(m).map_err(|_| {
                bad(format!("min_tokens={m} exceeds what any request can generate (max_model_len)"))
            })?,
        };
        let eos_token_id = match opt_int_arg(eos_token_id, "eos_token_id", "InvalidRequestError")? {
            None => None,
            Some(t) => Some(guard(py, || core::Scheduler::check_token_id("eos_token_id", t))?),
        };
        let ignore_eos = match ignore_eos {
            None => false,
            Some(o) => o
                .downcast::<PyBool>()
                .map(|b| b.is_true())
                .map_err(|_| type_error(py, format!("ignore_eos must be a bool, got {}", type_name(o))))?,
        };
        let mut stops = Vec::new();
        if let Some(s) = stop_token_ids {
            if !s.is_none() {
                for t in token_list(s, "stop_token_ids", "InvalidRequestError")? {
                    stops.push(guard(py, || core::Scheduler::check_token_id("stop_token_ids", t))?);
                }
            }
        }
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
        };
        let id_str = id_arg(req_id, "InvalidRequestError")?;
        let mut this = borrow_mut(slf)?;
        let slot = this.core_next_slot();
        guard(py, || this.core.add_request(&id_str, &prompt, params))?;
        if this.py_ids.len() <= slot {
            this.py_ids.resize_with(slot + 1, || None);
        }
        this.py_ids[slot] = Some(id.unbind());
        Ok(())
    }

    fn schedule(slf: &Bound<'_, Self>) -> PyResult<PySchedulerOutput> {
        let py = slf.py();
        let mut this = borrow_mut(slf)?;
        let out = guard(py, || this.core.schedule())?;
        let id_of = |py_ids: &[Option<Py<PyString>>], h: core::ReqHandle| -> PyResult<Py<PyString>> {
            py_ids
                .get(h.slot as usize)
                .and_then(Option::as_ref)
                .map(|s| s.clone_ref(py))
                .ok_or_else(|| py_error(py, "InternalError", format!("no id for slot {}", h.slot)))
        };
        let reuse = match &this.last_ids {
            Some((handles, ids)) if *handles == out.handles => Some(ids.clone()),
            _ => None,
        };
        let ids = match reuse {
            Some(ids) => ids,
            None => {
                let fresh =
                    out.handles.iter().map(|&h| id_of(&this.py_ids, h)).collect::<PyResult<Vec<_>>>()?;
                let ids = Arc::new(fresh);
                this.last_ids = Some((out.handles.clone(), ids.clone()));
                ids
            }
        };
        let preempted_ids =
            out.preempted.iter().map(|&h| id_of(&this.py_ids, h)).collect::<PyResult<Vec<_>>>()?;
        let num_preempted = preempted_ids.len();
        let total_preemptions = this.core.stats().num_preemptions;
        drop(this);
        if num_preempted > 0 {
            warn_preempted(py, num_preempted, total_preemptions)?;
        }
        Ok(PySchedulerOutput {
            step_id: out.step_id,
            total_num_scheduled_tokens: out.total_num_scheduled_tokens,
            scheduler_id: out.scheduler_id,
            ids,
            new_reqs: out.new_reqs,
            resumed_reqs: out.resumed_reqs,
            preempted_ids,
            finished_ids: out.finished_req_ids,
            num_scheduled_tokens: LazyArray::Raw(out.num_scheduled_tokens),
            num_computed_tokens: LazyArray::Raw(out.num_computed_tokens),
            new_block_ids: LazyArray::Raw(out.new_block_ids),
            new_block_ids_indptr: LazyArray::Raw(out.new_block_ids_indptr),
            spec_token_ids: LazyArray::Raw(out.spec_token_ids),
            spec_token_ids_indptr: LazyArray::Raw(out.spec_token_ids_indptr),
            req_ids_cache: None,
        })
    }

    #[pyo3(signature = (out, sampled_token_ids, draft_token_ids=None))]
    fn update_from_output(
        slf: &Bound<'_, Self>,
        out: &Bound<'_, PyAny>,
        sampled_token_ids: &Bound<'_, PyAny>,
        draft_token_ids: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyUpdateResult> {
        let py = slf.py();
        let (scheduler_id, step_id) = {
            let o = out.downcast::<PySchedulerOutput>().map_err(|_| {
                type_error(
                    py,
                    format!("out must be a SchedulerOutput from schedule(), got {}", type_name(out)),
                )
            })?;
            let o = o.try_borrow().map_err(|_| type_error(py, "out is in use".into()))?;
            (o.scheduler_id, o.step_id)
        };
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
        Ok(PyUpdateResult {
            finished_ids: res.finished_req_ids,
            finish_reasons: LazyArray::Raw(res.finish_reasons.iter().map(|&r| r as i8).collect()),
            stop_reasons: LazyArray::Raw(res.stop_reasons),
            num_new_tokens: LazyArray::Raw(res.num_new_tokens),
            finished_cache: None,
        })
    }

    fn prepare_model_inputs(slf: &Bound<'_, Self>, out: &Bound<'_, PyAny>) -> PyResult<PyModelInputs> {
        let py = slf.py();
        let (scheduler_id, step_id) = {
            let o = out.downcast::<PySchedulerOutput>().map_err(|_| {
                type_error(
                    py,
                    format!("out must be a SchedulerOutput from schedule(), got {}", type_name(out)),
                )
            })?;
            let o = o.try_borrow().map_err(|_| type_error(py, "out is in use".into()))?;
            (o.scheduler_id, o.step_id)
        };
        let this = borrow(slf)?;
        let mi = guard(py, || this.core.prepare_model_inputs(scheduler_id, step_id))?;
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
        guard(py, || this.core.abort_requests(&ids))
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

    fn get_block_ids<'py>(
        slf: &Bound<'py, Self>,
        req_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let py = slf.py();
        let id = id_arg(req_id, "UnknownRequestError")?;
        let this = borrow(slf)?;
        let blocks: Vec<i32> = guard(py, || Ok(this.core.get_request(&id)?.blocks.clone()))?
            .into_iter()
            .map(|b| b as i32)
            .collect();
        Ok(blocks.into_pyarray(py))
    }

    fn get_block_hashes<'py>(
        slf: &Bound<'py, Self>,
        req_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let py = slf.py();
        let id = id_arg(req_id, "UnknownRequestError")?;
        let this = borrow(slf)?;
        let width = match this.core.config().prefix_hash_algo {
            core::HashAlgo::Xxh3_128 => 16,
            core::HashAlgo::Sha256 => 32,
        };
        let hashes = guard(py, || Ok(this.core.get_request(&id)?.block_hashes.clone()))?;
        PyList::new(py, hashes.iter().map(|h| PyBytes::new(py, &h.0[..width])))
    }

    fn get_request_status(slf: &Bound<'_, Self>, req_id: &Bound<'_, PyAny>) -> PyResult<u8> {
        let id = id_arg(req_id, "UnknownRequestError")?;
        let this = borrow(slf)?;
        guard(slf.py(), || Ok(this.core.get_request(&id)?.status as u8))
    }

    fn get_num_computed_tokens(slf: &Bound<'_, Self>, req_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        let id = id_arg(req_id, "UnknownRequestError")?;
        let this = borrow(slf)?;
        guard(slf.py(), || Ok(this.core.get_request(&id)?.num_computed_tokens))
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

    #[pyo3(signature = (prompt_token_ids, cache_salt=None, lora_name=None))]
    fn get_num_cached_tokens(
        slf: &Bound<'_, Self>,
        prompt_token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        lora_name: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u32> {
        let py = slf.py();
        let prompt = token_list(prompt_token_ids, "prompt_token_ids", "InvalidRequestError")?;
        let salt = opt_str_arg(cache_salt, "cache_salt")?;
        let lora = opt_str_arg(lora_name, "lora_name")?;
        let this = borrow(slf)?;
        guard(py, || this.core.get_num_cached_tokens(&prompt, salt.as_deref(), lora.as_deref()))
    }

    fn reset_prefix_cache(slf: &Bound<'_, Self>) -> PyResult<bool> {
        let mut this = borrow_mut(slf)?;
        Ok(this.core.reset_prefix_cache())
    }

    /// The counters as a dict (`kvsched.Scheduler.stats()` wraps it in a dataclass).
    fn _stats_dict<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyDict>> {
        let py = slf.py();
        let s = borrow(slf)?.core.stats();
        let d = PyDict::new(py);
        d.set_item("num_running_reqs", s.num_running_reqs)?;
        d.set_item("num_waiting_reqs", s.num_waiting_reqs)?;
        d.set_item("kv_cache_usage", s.kv_cache_usage)?;
        d.set_item("num_free_blocks", s.num_free_blocks)?;
        d.set_item("prefix_cache_queries", s.prefix_cache_queries)?;
        d.set_item("prefix_cache_hits", s.prefix_cache_hits)?;
        d.set_item("prefix_cache_preempted_queries", s.prefix_cache_preempted_queries)?;
        d.set_item("prefix_cache_preempted_hits", s.prefix_cache_preempted_hits)?;
        d.set_item("num_preemptions", s.num_preemptions)?;
        d.set_item("num_finished_reqs", s.num_finished_reqs)?;
        d.set_item("step_id", s.step_id)?;
        Ok(d)
    }

    fn check_invariants(slf: &Bound<'_, Self>) -> PyResult<()> {
        let py = slf.py();
        let this = borrow(slf)?;
        guard(py, || this.core.check_invariants().map_err(SchedError::Internal))
    }
}

impl PyScheduler {
    fn core_next_slot(&self) -> usize {
        self.core.next_slot() as usize
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyScheduler>()?;
    m.add_class::<PySchedulerOutput>()?;
    m.add_class::<PyUpdateResult>()?;
    m.add_class::<PyModelInputs>()?;
    m.add("MAX_TOKEN_ID", core::MAX_TOKEN_ID)?;
    Ok(())
}
