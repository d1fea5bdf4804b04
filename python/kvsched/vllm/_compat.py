"""The vLLM releases ``kvsched.vllm`` supports, and where their schedulers differ.

``kvsched.vllm.Scheduler`` follows the scheduler of the installed vLLM release field for field. The releases
differ in a few rules (which requests count against ``max_loras``, what a priority preemption of the request being
scheduled does, when blocks completed by accepted drafts are cached) and in the shape of a few output objects.
:data:`RULES` is the installed release's entry of :data:`VLLM_RULES`; any release not listed there is refused
when ``kvsched.vllm`` is imported, with :class:`UnsupportedVLLMVersionError`.

This module reads only ``vllm.__version__`` (it imports no vLLM internals), so the check runs before anything
that could fail on an unknown release.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvsched._errors import SchedulerError

__all__ = ["RULES", "SUPPORTED_VLLM_VERSIONS", "VLLM_RULES", "UnsupportedVLLMVersionError", "VllmRules", "rules_for"]


class UnsupportedVLLMVersionError(SchedulerError, ImportError):
    """The installed vLLM is not a release ``kvsched.vllm`` supports (raised when ``kvsched.vllm`` is imported)."""


@dataclass(frozen=True)
class VllmRules:
    """What one vLLM release's scheduler does where the supported releases differ."""

    version: str
    # SchedulerOutput.skip_drafts: model runner V2 skips drafting in a step whose drafts nobody can use.
    skip_drafts: bool
    # EngineCoreOutput.error: a request finished by a grammar that failed to compile carries a RequestError.
    output_error: bool
    # prefill_schedule_interval is applied by the scheduler itself when there is no data parallelism (else only
    # the data-parallel engine core applies it, through schedule(throttle_prefills=True)).
    local_prefill_cadence: bool
    # The scheduler's defer_async_loads gate (registration of an asynchronous KV load deferred behind the steps in
    # flight); a release without it has no such attribute, and setting one on the adapter changes nothing.
    defer_async_loads: bool
    # The core's flags of the same names (kvsched.SchedulerConfig, docs/semantics.md). trim_computed_on_stop also
    # decides the request's mirrored counts: with it, a stop inside a step's tokens cuts num_computed_tokens back
    # to the tokens kept and every returned token resolves an output placeholder; without it the count stays and
    # only the kept tokens resolve one.
    max_loras_counts_unscheduled: bool
    continue_after_self_preemption: bool
    skip_encoder_blocked_admissions: bool
    exact_encoder_cut_and_release: bool
    cache_drafts_at_update: bool
    trim_computed_on_stop: bool
    cache_upto_in_flight: bool
    # Align-mode Mamba prefix caching: only states cached in the step defer a same-step hit (0.33); 0.32 also
    # defers hits on the state at the prompt's checkpoint whenever an allocation re-caches it there.
    mamba_defer_new_states_only: bool
    # EAGLE/MTP's trailing-block drop with sparse retention and several KV cache groups: the groups that take the
    # drop's rules also keep what a hit one block below a shared-prefix junction needs (0.33; 0.32 at the junction
    # only).
    drop_junction_below: bool
    # Multi-module MTP: an admission whose chunk the prefill lookahead cuts to nothing is skipped, keeping its
    # place (0.33); 0.32 ends the admission pass there (the core's skip_lookahead_cut_admissions).
    skip_lookahead_cut_admissions: bool


VLLM_RULES: dict[str, VllmRules] = {
    "0.32": VllmRules(
        version="0.32",
        skip_drafts=False,
        output_error=False,
        local_prefill_cadence=False,
        defer_async_loads=False,
        trim_computed_on_stop=False,
        cache_upto_in_flight=False,
        max_loras_counts_unscheduled=False,
        continue_after_self_preemption=False,
        skip_encoder_blocked_admissions=False,
        exact_encoder_cut_and_release=False,
        cache_drafts_at_update=False,
        mamba_defer_new_states_only=False,
        drop_junction_below=False,
        skip_lookahead_cut_admissions=False,
    ),
    "0.33": VllmRules(
        version="0.33",
        skip_drafts=True,
        output_error=True,
        local_prefill_cadence=True,
        defer_async_loads=True,
        trim_computed_on_stop=True,
        cache_upto_in_flight=True,
        max_loras_counts_unscheduled=True,
        continue_after_self_preemption=True,
        skip_encoder_blocked_admissions=True,
        exact_encoder_cut_and_release=True,
        cache_drafts_at_update=True,
        mamba_defer_new_states_only=True,
        drop_junction_below=True,
        skip_lookahead_cut_admissions=True,
    ),
}

SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = tuple(VLLM_RULES)


def rules_for(vllm_version: str) -> VllmRules:
    """The rules of the vLLM release ``vllm_version`` (``"0.33.0"``, ``"0.32.1.dev3+g0123abc"``: patch releases
    and local builds of a supported ``major.minor`` are accepted); raises :class:`UnsupportedVLLMVersionError`
    for any other release."""
    match = re.match(r"(\d+)\.(\d+)(?:\.|$|[^0-9])", str(vllm_version).strip())
    rules = VLLM_RULES.get(f"{match[1]}.{match[2]}") if match else None
    if rules is None:
        raise UnsupportedVLLMVersionError(
            f"kvsched.vllm supports vLLM {' and '.join(SUPPORTED_VLLM_VERSIONS)}; the installed vLLM is "
            f"{vllm_version!r}. Install a supported release (pip install 'kvsched[vllm]'), or run vLLM's own "
            "scheduler (drop --scheduler-cls). docs/vllm.md says how a new release gets supported."
        )
    return rules


def _installed_rules() -> VllmRules:
    import vllm

    return rules_for(getattr(vllm, "__version__", "unknown"))


RULES: VllmRules = _installed_rules()
