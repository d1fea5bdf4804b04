//! The `Router` pyclass: `kvsched-router` for `kvsched.router`. Conversions and error mapping only.
//!
//! Arguments are converted before the router is borrowed (a re-entrant call gets `SchedulerError`, not a
//! panic), and every router call runs through `guard_with`, which maps `RouterError` to kvsched's exception
//! classes and catches panics. The Python wrapper (`python/kvsched/router.py`) normalises inputs: block hashes
//! arrive as uint64 arrays, events as flat arrays (a kind, a slice of hashes and a slice of token ids per event).

use kvsched_core::HashAlgo;
use kvsched_router as rt;
use kvsched_router::{KvEvent, LoadReport, PolicyKind, Prompt, RouterError, StepTimeCoefficients};
use numpy::{IntoPyArray, PyArray1, PyArrayMethods, PyUntypedArray};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyList};

use crate::convert::{id_arg, int_arg, opt_str_arg, seed_bytes, str_arg, token_list, type_name};
use crate::errors::{guard_with, py_error, type_error};

fn map_router_err(py: Python<'_>, e: RouterError) -> PyErr {
    let class = match &e {
        RouterError::InvalidConfig(_) => "InvalidConfigError",
        RouterError::InvalidArgument(_) => "InvalidRequestError",
        RouterError::UnknownReplica(_) => "UnknownReplicaError",
        RouterError::DuplicateReplica(_) => "DuplicateReplicaError",
        RouterError::UnknownRequest(_) => "UnknownRequestError",
        RouterError::DuplicateRequest(_) => "DuplicateRequestError",
        RouterError::NoReplica(_) => "NoReplicaAvailableError",
        RouterError::Internal(_) => "InternalError",
    };
    py_error(py, class, e.to_string())
}

fn run<T>(py: Python<'_>, f: impl FnOnce() -> rt::Result<T>) -> PyResult<T> {
    guard_with(py, f, map_router_err)
}

/// Reads a `kvsched.router.RouterConfig` (any object with its attributes); ranges are the crate's to check.
fn config_from_py(cfg: &Bound<'_, PyAny>) -> PyResult<rt::RouterConfig> {
    let py = cfg.py();
    let bad = |msg: String| py_error(py, "InvalidConfigError", msg);
    let uint = |obj: &Bound<'_, PyAny>, name: &str| -> PyResult<u64> {
        let v = int_arg(&obj.getattr(name)?, name, "InvalidConfigError")?;
        u64::try_from(v).map_err(|_| bad(format!("{name} must be >= 0, got {v}")))
    };
    let real = |obj: &Bound<'_, PyAny>, name: &str| -> PyResult<f64> {
        let v = obj.getattr(name)?;
        if v.is_instance_of::<PyBool>() {
            return Err(bad(format!("{name} must be a float, got {v}")));
        }
        v.extract::<f64>().map_err(|_| bad(format!("{name} must be a float, got {v}")))
    };
    let flag = |name: &str| -> PyResult<bool> {
        let v = cfg.getattr(name)?;
        v.downcast::<PyBool>()
            .map(|b| b.is_true())
            .map_err(|_| bad(format!("{name} must be a bool, got {v}")))
    };
    let policy_name: String =
        cfg.getattr("policy")?.extract().map_err(|_| bad("policy must be a str".into()))?;
    let policy = PolicyKind::parse(&policy_name)
        .ok_or_else(|| bad(format!("policy must be one of {:?}, got {policy_name:?}", PolicyKind::NAMES)))?;
    let algo_name: String = cfg
        .getattr("prefix_hash_algo")?
        .extract()
        .map_err(|_| bad("prefix_hash_algo must be a str".into()))?;
    let algo = HashAlgo::parse(&algo_name).map_err(|e| bad(e.to_string()))?;
    let st = cfg.getattr("step_time")?;
    let step_time = StepTimeCoefficients {
        step_s: real(&st, "step_s")?,
        prefill_token_s: real(&st, "prefill_token_s")?,
        prefill_req_s: real(&st, "prefill_req_s")?,
        decode_req_s: real(&st, "decode_req_s")?,
        kv_token_s: real(&st, "kv_token_s")?,
        prefill_attn_s: real(&st, "prefill_attn_s")?,
        prefill_attn_spill_s: real(&st, "prefill_attn_spill_s")?,
        lone_prefill_token_s: real(&st, "lone_prefill_token_s")?,
        attn_spill_pairs: real(&st, "attn_spill_pairs")?,
    };
    let mut c = rt::RouterConfig::new(policy, step_time);
    c.block_size =
        usize::try_from(uint(cfg, "block_size")?).map_err(|_| bad("block_size is too large".into()))?;
    c.prefix_hash_algo = algo;
    c.prefix_hash_seed = seed_bytes(&cfg.getattr("prefix_hash_seed")?)?;
    c.params.cache_threshold = real(cfg, "cache_threshold")?;
    c.params.balance_abs_threshold = uint(cfg, "balance_abs_threshold")?;
    c.params.balance_rel_threshold = real(cfg, "balance_rel_threshold")?;
    c.params.overlap_weight = real(cfg, "overlap_weight")?;
    c.params.queue_weight = real(cfg, "queue_weight")?;
    c.params.kv_usage_weight = real(cfg, "kv_usage_weight")?;
    c.params.max_num_batched_tokens = uint(cfg, "max_num_batched_tokens")?;
    c.sticky_sessions = flag("sticky_sessions")?;
    c.max_sessions =
        usize::try_from(uint(cfg, "max_sessions")?).map_err(|_| bad("max_sessions is too large".into()))?;
    c.record_routed_prefixes = flag("record_routed_prefixes")?;
    Ok(c)
}

fn name_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<String> {
    let s = str_arg(obj, what)?;
    s.to_str()
        .map(str::to_owned)
        .map_err(|_| py_error(obj.py(), "InvalidRequestError", format!("{what} is not valid unicode")))
}

/// A 1-D array of the given numpy element type, copied out (the wrapper hands over exact dtypes).
fn array<T: numpy::Element + Copy>(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<T>> {
    let arr = obj.downcast::<PyArray1<T>>().map_err(|_| {
        let detail = obj.downcast::<PyUntypedArray>().map_or_else(|_| type_name(obj), |a| format!("{a:?}"));
        type_error(obj.py(), format!("{what} must be a 1-D numpy array of the expected dtype, got {detail}"))
    })?;
    Ok(arr.readonly().as_array().to_vec())
}

fn u32_tokens(py: Python<'_>, values: Vec<i64>, what: &str) -> PyResult<Vec<u32>> {
    values
        .into_iter()
        .map(|t| {
            u32::try_from(t).map_err(|_| {
                py_error(py, "InvalidRequestError", format!("{what}: token id {t} is out of range"))
            })
        })
        .collect()
}

/// A prompt's data, owned, so a `Prompt` can borrow it.
enum PromptArgs {
    Tokens { token_ids: Vec<u32>, lora_name: Option<String>, cache_salt: Option<String> },
    Hashes { block_hashes: Vec<u64>, num_tokens: Option<usize> },
}

impl PromptArgs {
    fn parse(
        py: Python<'_>,
        token_ids: Option<&Bound<'_, PyAny>>,
        block_hashes: Option<&Bound<'_, PyAny>>,
        num_prompt_tokens: Option<&Bound<'_, PyAny>>,
        lora_name: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let given = |o: Option<&Bound<'_, PyAny>>| o.is_some_and(|o| !o.is_none());
        match (given(token_ids), given(block_hashes)) {
            (true, false) => {
                let values = token_list(
                    token_ids.unwrap_or_else(|| unreachable_arg()),
                    "prompt_token_ids",
                    "InvalidRequestError",
                )?;
                Ok(PromptArgs::Tokens {
                    token_ids: u32_tokens(py, values, "prompt_token_ids")?,
                    lora_name: opt_str_arg(lora_name, "lora_name")?,
                    cache_salt: opt_str_arg(cache_salt, "cache_salt")?,
                })
            }
            (false, true) => {
                let num_tokens = match num_prompt_tokens {
                    Some(o) if !o.is_none() => {
                        let v = int_arg(o, "num_prompt_tokens", "InvalidRequestError")?;
                        Some(usize::try_from(v).map_err(|_| {
                            py_error(
                                py,
                                "InvalidRequestError",
                                format!("num_prompt_tokens must be >= 0, got {v}"),
                            )
                        })?)
                    }
                    _ => None,
                };
                let hashes = array::<u64>(block_hashes.unwrap_or_else(|| unreachable_arg()), "block_hashes")?;
                Ok(PromptArgs::Hashes { block_hashes: hashes, num_tokens })
            }
            _ => Err(type_error(
                py,
                "give either prompt_token_ids or block_hashes, not both or neither".into(),
            )),
        }
    }

    fn prompt(&self) -> Prompt<'_> {
        match self {
            PromptArgs::Tokens { token_ids, lora_name, cache_salt } => Prompt::Tokens {
                token_ids,
                lora_name: lora_name.as_deref(),
                cache_salt: cache_salt.as_deref(),
            },
            PromptArgs::Hashes { block_hashes, num_tokens } => {
                Prompt::BlockHashes { block_hashes, num_tokens: *num_tokens }
            }
        }
    }
}

#[cold]
#[allow(clippy::panic)]
fn unreachable_arg() -> ! {
    panic!("an argument checked as given was missing")
}

fn names_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<String>>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else { return Ok(None) };
    let list = obj.downcast::<PyList>().map_err(|_| {
        type_error(
            obj.py(),
            format!("candidates must be a list of replica names or None, got {}", type_name(obj)),
        )
    })?;
    list.iter().map(|n| name_arg(&n, "a candidate replica")).collect::<PyResult<Vec<_>>>().map(Some)
}

type DecisionTuple = (String, &'static str, usize, usize, usize, f64);

#[pyclass(module = "kvsched._core", name = "Router")]
pub(crate) struct PyRouter {
    inner: rt::Router,
}

impl PyRouter {
    fn decision(&self, d: &rt::Decision) -> DecisionTuple {
        (
            self.inner.replica_name(d.slot).to_owned(),
            d.reason.name(),
            d.num_overlap_blocks,
            d.num_prompt_blocks,
            d.num_prompt_tokens,
            d.estimated_ttft_s,
        )
    }
}

fn borrow_mut<'py>(slf: &Bound<'py, PyRouter>) -> PyResult<PyRefMut<'py, PyRouter>> {
    slf.try_borrow_mut()
        .map_err(|_| py_error(slf.py(), "SchedulerError", "the router is busy: a call re-entered it".into()))
}

fn borrow<'py>(slf: &Bound<'py, PyRouter>) -> PyResult<PyRef<'py, PyRouter>> {
    slf.try_borrow()
        .map_err(|_| py_error(slf.py(), "SchedulerError", "the router is busy: a call re-entered it".into()))
}

#[pymethods]
impl PyRouter {
    #[new]
    fn new(config: &Bound<'_, PyAny>) -> PyResult<Self> {
        let c = config_from_py(config)?;
        Ok(PyRouter { inner: run(config.py(), || rt::Router::new(c))? })
    }

    fn add_replica(slf: &Bound<'_, Self>, replica: &Bound<'_, PyAny>) -> PyResult<()> {
        let name = name_arg(replica, "replica")?;
        let mut this = borrow_mut(slf)?;
        run(slf.py(), || this.inner.add_replica(&name).map(|_| ()))
    }

    fn remove_replica(slf: &Bound<'_, Self>, replica: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
        let name = name_arg(replica, "replica")?;
        let mut this = borrow_mut(slf)?;
        run(slf.py(), || this.inner.remove_replica(&name))
    }

    fn set_healthy(
        slf: &Bound<'_, Self>,
        replica: &Bound<'_, PyAny>,
        healthy: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let name = name_arg(replica, "replica")?;
        let healthy = healthy.downcast::<PyBool>().map(|b| b.is_true()).map_err(|_| {
            type_error(slf.py(), format!("healthy must be a bool, got {}", type_name(healthy)))
        })?;
        let mut this = borrow_mut(slf)?;
        run(slf.py(), || this.inner.set_healthy(&name, healthy))
    }

    /// `(name, healthy)` of every replica, in slot order.
    fn replicas(slf: &Bound<'_, Self>) -> PyResult<Vec<(String, bool)>> {
        let this = borrow(slf)?;
        Ok(this.inner.replicas().map(|(_, n, h)| (n.to_owned(), h)).collect())
    }

    /// Events as flat arrays: `kinds` (0 stored, 1 removed, 2 cleared); the hashes of event `i` are
    /// `hashes[hashes_indptr[i]:hashes_indptr[i + 1]]`, its token ids likewise; `parents[i]` counts only where
    /// `has_parent[i]`; `block_sizes[i]` only for stored events.
    #[allow(clippy::too_many_arguments)]
    fn apply_events(
        slf: &Bound<'_, Self>,
        replica: &Bound<'_, PyAny>,
        kinds: &Bound<'_, PyAny>,
        hashes: &Bound<'_, PyAny>,
        hashes_indptr: &Bound<'_, PyAny>,
        parents: &Bound<'_, PyAny>,
        has_parent: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        token_ids_indptr: &Bound<'_, PyAny>,
        block_sizes: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let py = slf.py();
        let name = name_arg(replica, "replica")?;
        let kinds = array::<u8>(kinds, "kinds")?;
        let hashes = array::<u64>(hashes, "hashes")?;
        let hashes_indptr = array::<i64>(hashes_indptr, "hashes_indptr")?;
        let parents = array::<u64>(parents, "parents")?;
        let has_parent = array::<bool>(has_parent, "has_parent")?;
        let tokens = u32_tokens(py, array::<i64>(token_ids, "token_ids")?, "token_ids")?;
        let tokens_indptr = array::<i64>(token_ids_indptr, "token_ids_indptr")?;
        let block_sizes = array::<i64>(block_sizes, "block_sizes")?;
        let n = kinds.len();
        let bad = |msg: &str| py_error(py, "InvalidRequestError", format!("apply_events: {msg}"));
        if [parents.len(), has_parent.len(), block_sizes.len()].iter().any(|&l| l != n)
            || hashes_indptr.len() != n + 1
            || tokens_indptr.len() != n + 1
        {
            return Err(bad("the event arrays are not aligned"));
        }
        let range = |indptr: &[i64], i: usize, len: usize| -> PyResult<std::ops::Range<usize>> {
            let (a, b) = (indptr[i], indptr[i + 1]);
            match (usize::try_from(a), usize::try_from(b)) {
                (Ok(a), Ok(b)) if a <= b && b <= len => Ok(a..b),
                _ => Err(bad("an indptr is not a valid offset array")),
            }
        };
        let mut events = Vec::with_capacity(n);
        for i in 0..n {
            let hs = &hashes[range(&hashes_indptr, i, hashes.len())?];
            let ts = &tokens[range(&tokens_indptr, i, tokens.len())?];
            events.push(match kinds[i] {
                0 => KvEvent::Stored {
                    block_hashes: hs,
                    parent_block_hash: has_parent[i].then_some(parents[i]),
                    token_ids: ts,
                    block_size: usize::try_from(block_sizes[i]).map_err(|_| bad("a negative block size"))?,
                },
                1 => KvEvent::Removed { block_hashes: hs },
                2 => KvEvent::AllCleared,
                k => return Err(bad(&format!("unknown event kind {k}"))),
            });
        }
        let mut this = borrow_mut(slf)?;
        run(py, || this.inner.apply_events(&name, &events))
    }

    #[allow(clippy::too_many_arguments)]
    fn update_load(
        slf: &Bound<'_, Self>,
        replica: &Bound<'_, PyAny>,
        num_waiting: &Bound<'_, PyAny>,
        num_running: &Bound<'_, PyAny>,
        num_waiting_tokens: &Bound<'_, PyAny>,
        num_running_tokens: &Bound<'_, PyAny>,
        kv_usage: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let py = slf.py();
        let name = name_arg(replica, "replica")?;
        let count = |o: &Bound<'_, PyAny>, what: &str| -> PyResult<u64> {
            let v = int_arg(o, what, "InvalidRequestError")?;
            u64::try_from(v)
                .map_err(|_| py_error(py, "InvalidRequestError", format!("{what} must be >= 0, got {v}")))
        };
        if kv_usage.is_instance_of::<PyBool>() {
            return Err(type_error(py, "kv_usage must be a float, got bool".into()));
        }
        let report = LoadReport {
            num_waiting: count(num_waiting, "num_waiting")?,
            num_running: count(num_running, "num_running")?,
            num_waiting_tokens: count(num_waiting_tokens, "num_waiting_tokens")?,
            num_running_tokens: count(num_running_tokens, "num_running_tokens")?,
            kv_usage: kv_usage.extract::<f64>().map_err(|_| {
                type_error(py, format!("kv_usage must be a float, got {}", type_name(kv_usage)))
            })?,
        };
        let mut this = borrow_mut(slf)?;
        run(py, || this.inner.update_load(&name, report))
    }

    #[pyo3(signature = (prompt_token_ids, block_hashes, num_prompt_tokens, lora_name, cache_salt, session_id, candidates))]
    #[allow(clippy::too_many_arguments)]
    fn rank(
        slf: &Bound<'_, Self>,
        prompt_token_ids: Option<&Bound<'_, PyAny>>,
        block_hashes: Option<&Bound<'_, PyAny>>,
        num_prompt_tokens: Option<&Bound<'_, PyAny>>,
        lora_name: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        session_id: Option<&Bound<'_, PyAny>>,
        candidates: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(Vec<String>, DecisionTuple)> {
        let py = slf.py();
        let p =
            PromptArgs::parse(py, prompt_token_ids, block_hashes, num_prompt_tokens, lora_name, cache_salt)?;
        let session = opt_str_arg(session_id, "session_id")?;
        let cands = names_arg(candidates)?;
        let cand_refs: Option<Vec<&str>> = cands.as_ref().map(|v| v.iter().map(String::as_str).collect());
        let this = borrow(slf)?;
        let ranking = run(py, || this.inner.rank(&p.prompt(), session.as_deref(), cand_refs.as_deref()))?;
        let names = ranking.slots.iter().map(|&s| this.inner.replica_name(s).to_owned()).collect();
        Ok((names, this.decision(&ranking.decision)))
    }

    #[pyo3(signature = (req_id, prompt_token_ids, block_hashes, num_prompt_tokens, lora_name, cache_salt, session_id, candidates))]
    #[allow(clippy::too_many_arguments)]
    fn route(
        slf: &Bound<'_, Self>,
        req_id: &Bound<'_, PyAny>,
        prompt_token_ids: Option<&Bound<'_, PyAny>>,
        block_hashes: Option<&Bound<'_, PyAny>>,
        num_prompt_tokens: Option<&Bound<'_, PyAny>>,
        lora_name: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        session_id: Option<&Bound<'_, PyAny>>,
        candidates: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<DecisionTuple> {
        let py = slf.py();
        let id = id_arg(req_id, "InvalidRequestError")?;
        let p =
            PromptArgs::parse(py, prompt_token_ids, block_hashes, num_prompt_tokens, lora_name, cache_salt)?;
        let session = opt_str_arg(session_id, "session_id")?;
        let cands = names_arg(candidates)?;
        let cand_refs: Option<Vec<&str>> = cands.as_ref().map(|v| v.iter().map(String::as_str).collect());
        let mut this = borrow_mut(slf)?;
        let d = run(py, || this.inner.route(&id, &p.prompt(), session.as_deref(), cand_refs.as_deref()))?;
        Ok(this.decision(&d))
    }

    #[pyo3(signature = (req_id, replica, prompt_token_ids, block_hashes, num_prompt_tokens, lora_name, cache_salt, session_id))]
    #[allow(clippy::too_many_arguments)]
    fn assign(
        slf: &Bound<'_, Self>,
        req_id: &Bound<'_, PyAny>,
        replica: &Bound<'_, PyAny>,
        prompt_token_ids: Option<&Bound<'_, PyAny>>,
        block_hashes: Option<&Bound<'_, PyAny>>,
        num_prompt_tokens: Option<&Bound<'_, PyAny>>,
        lora_name: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
        session_id: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<DecisionTuple> {
        let py = slf.py();
        let id = id_arg(req_id, "InvalidRequestError")?;
        let name = name_arg(replica, "replica")?;
        let p =
            PromptArgs::parse(py, prompt_token_ids, block_hashes, num_prompt_tokens, lora_name, cache_salt)?;
        let session = opt_str_arg(session_id, "session_id")?;
        let mut this = borrow_mut(slf)?;
        let d = run(py, || this.inner.assign(&id, &name, &p.prompt(), session.as_deref()))?;
        Ok(this.decision(&d))
    }

    fn prefill_done(slf: &Bound<'_, Self>, req_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = id_arg(req_id, "UnknownRequestError")?;
        let mut this = borrow_mut(slf)?;
        run(slf.py(), || this.inner.prefill_done(&id))
    }

    fn finish(slf: &Bound<'_, Self>, req_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = id_arg(req_id, "UnknownRequestError")?;
        let mut this = borrow_mut(slf)?;
        run(slf.py(), || this.inner.finish(&id))
    }

    /// `(num_waiting, num_running, num_waiting_tokens, num_running_tokens, kv_usage)` as the policies see it.
    fn load(slf: &Bound<'_, Self>, replica: &Bound<'_, PyAny>) -> PyResult<(u64, u64, u64, u64, f64)> {
        let name = name_arg(replica, "replica")?;
        let this = borrow(slf)?;
        let l = run(slf.py(), || this.inner.load(&name))?;
        Ok((l.num_waiting, l.num_running, l.num_waiting_tokens, l.num_running_tokens, l.kv_usage))
    }

    fn num_cached_blocks(slf: &Bound<'_, Self>, replica: &Bound<'_, PyAny>) -> PyResult<usize> {
        let name = name_arg(replica, "replica")?;
        let this = borrow(slf)?;
        run(slf.py(), || this.inner.num_cached_blocks(&name))
    }

    #[pyo3(signature = (prompt_token_ids, block_hashes, num_prompt_tokens, lora_name, cache_salt))]
    fn overlaps(
        slf: &Bound<'_, Self>,
        prompt_token_ids: Option<&Bound<'_, PyAny>>,
        block_hashes: Option<&Bound<'_, PyAny>>,
        num_prompt_tokens: Option<&Bound<'_, PyAny>>,
        lora_name: Option<&Bound<'_, PyAny>>,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<(String, usize)>> {
        let py = slf.py();
        let p =
            PromptArgs::parse(py, prompt_token_ids, block_hashes, num_prompt_tokens, lora_name, cache_salt)?;
        let this = borrow(slf)?;
        let o = run(py, || this.inner.overlaps(&p.prompt()))?;
        Ok(o.into_iter().map(|(s, n)| (this.inner.replica_name(s).to_owned(), n)).collect())
    }

    /// The block keys of a token prompt, as the router hashes it (uint64).
    #[pyo3(signature = (prompt_token_ids, lora_name, cache_salt))]
    fn prompt_keys<'py>(
        slf: &Bound<'py, Self>,
        prompt_token_ids: &Bound<'py, PyAny>,
        lora_name: Option<&Bound<'py, PyAny>>,
        cache_salt: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray1<u64>>> {
        let py = slf.py();
        let p = PromptArgs::parse(py, Some(prompt_token_ids), None, None, lora_name, cache_salt)?;
        let this = borrow(slf)?;
        let keys = run(py, || this.inner.prompt_keys(&p.prompt()))?;
        Ok(keys.keys.into_pyarray(py))
    }

    fn in_flight(slf: &Bound<'_, Self>, replica: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
        let name = name_arg(replica, "replica")?;
        let this = borrow(slf)?;
        run(slf.py(), || this.inner.in_flight(&name))
    }

    #[getter]
    fn num_in_flight(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.num_in_flight())
    }

    #[getter]
    fn num_sessions(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.inner.num_sessions())
    }

    fn check_invariants(slf: &Bound<'_, Self>) -> PyResult<()> {
        let this = borrow(slf)?;
        run(slf.py(), || this.inner.check_invariants())
    }

    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        let this = borrow(slf)?;
        let names: Vec<String> = this.inner.replicas().map(|(_, n, _)| format!("{n:?}")).collect();
        Ok(format!(
            "Router(policy={:?}, replicas=[{}], in_flight={})",
            this.inner.config().policy.name(),
            names.join(", "),
            this.inner.num_in_flight()
        ))
    }
}
