"""kvsched.vllm supports vLLM 0.32 and 0.33, chosen by the installed release; any other release is refused by name.

Needs vLLM (either supported release); skipped otherwise. The differential (``tests/test_vllm_differential.py``)
checks that the adapter follows the installed release's scheduler field for field; this file checks the choice.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is optional: pip install 'kvsched[vllm]'")

import kvsched
import vllm
from kvsched.vllm import RULES, SUPPORTED_VLLM_VERSIONS, UnsupportedVLLMVersionError
from kvsched.vllm._compat import VLLM_RULES, rules_for
from kvsched.vllm.testing import make_scheduler, make_vllm_config

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(
    ("version", "release"),
    [
        ("0.32.0", "0.32"),
        ("0.32.3", "0.32"),
        ("0.32.0+cpu", "0.32"),
        ("0.33.0", "0.33"),
        ("0.33.1.dev7+g1a2b3c", "0.33"),
    ],
)
def test_patch_releases_and_local_builds_of_a_supported_release_are_accepted(version: str, release: str) -> None:
    assert rules_for(version) is VLLM_RULES[release]


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "0.330.0", "1.0.0", "3", "", "unknown"])
def test_other_releases_are_refused_by_name_with_the_supported_list(version: str) -> None:
    with pytest.raises(UnsupportedVLLMVersionError) as info:
        rules_for(version)
    # An ImportError (raised when kvsched.vllm is imported) and a kvsched error.
    assert isinstance(info.value, ImportError) and isinstance(info.value, kvsched.SchedulerError)
    assert repr(version) in str(info.value) and "0.32 and 0.33" in str(info.value)
    assert SUPPORTED_VLLM_VERSIONS == ("0.32", "0.33")


def test_importing_kvsched_vllm_under_an_unsupported_release_fails_before_touching_vllms_internals() -> None:
    code = "import vllm; vllm.__version__ = '0.34.0'; import kvsched.vllm"
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo / "python"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "UnsupportedVLLMVersionError: kvsched.vllm supports vLLM 0.32 and 0.33" in proc.stderr
    assert "'0.34.0'" in proc.stderr
    # The check comes first: nothing of vLLM's scheduler was imported.
    assert "vllm/v1/core" not in proc.stderr


def test_the_installed_release_picks_its_rules_and_the_core_gets_them() -> None:
    assert RULES is rules_for(vllm.__version__)
    s = make_scheduler("kvsched", make_vllm_config(prefill_schedule_interval=4))
    config = s.core.config
    assert config.max_loras_counts_unscheduled is RULES.max_loras_counts_unscheduled
    assert config.continue_after_self_preemption is RULES.continue_after_self_preemption
    assert config.skip_encoder_blocked_admissions is RULES.skip_encoder_blocked_admissions
    assert config.exact_encoder_cut_and_release is RULES.exact_encoder_cut_and_release
    assert config.skip_lookahead_cut_admissions is RULES.skip_lookahead_cut_admissions
    assert config.cache_drafts_at_update is RULES.cache_drafts_at_update
    assert config.trim_computed_on_stop is RULES.trim_computed_on_stop
    assert config.mamba_defer_new_states_only is RULES.mamba_defer_new_states_only
    assert config.cache_upto_in_flight is RULES.cache_upto_in_flight
    # vLLM 0.32 applies the prefill cadence only through its data-parallel engine core.
    assert config.prefill_schedule_interval == (4 if RULES.local_prefill_cadence else 1)
    out = s.schedule()
    assert hasattr(out, "skip_drafts") is RULES.skip_drafts


def test_eagle_drafters_get_the_releases_prefix_cache_rules() -> None:
    """vLLM 0.33: look-ahead hashes with prefix caching and no KV connector, else the trailing-block drop; vLLM
    0.32: always the drop; neither with disable_eagle_block_drop; the same with a window or several groups."""
    eagle = {"num_speculative_tokens": 2, "speculative_method": "eagle"}
    config = make_scheduler("kvsched", make_vllm_config(**eagle, eagle_block_drop=True)).core.config
    lookahead = RULES.version != "0.32"
    assert (config.hash_lookahead_tokens, config.drop_trailing_hit_block) == (int(lookahead), not lookahead)
    config = make_scheduler(
        "kvsched", make_vllm_config(**eagle, eagle_block_drop=True, kv_connector_seed=1)
    ).core.config
    assert (config.hash_lookahead_tokens, config.drop_trailing_hit_block) == (0, True)
    config = make_scheduler("kvsched", make_vllm_config(**eagle)).core.config
    assert (config.hash_lookahead_tokens, config.drop_trailing_hit_block) == (0, False)
    # The same rules over a sliding window and several KV cache groups.
    for layout in ({"sliding_window": 8}, {"kv_cache_groups": (None, 8)}):
        config = make_scheduler("kvsched", make_vllm_config(**eagle, eagle_block_drop=True), **layout).core.config
        assert (config.hash_lookahead_tokens, config.drop_trailing_hit_block) == (int(lookahead), not lookahead)
