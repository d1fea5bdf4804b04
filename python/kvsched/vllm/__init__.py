"""kvsched as vLLM's scheduler: ``vllm serve MODEL --scheduler-cls kvsched.vllm.Scheduler``.

Importing this module imports vLLM (``pip install '.[vllm]'`` in kvsched's repository root: vLLM 0.32 or 0.33);
``import kvsched`` does not. The installed vLLM release is checked first: any release not in
``SUPPORTED_VLLM_VERSIONS`` is refused here with :class:`UnsupportedVLLMVersionError` (an ``ImportError``). See
docs/vllm.md for what is supported, what is refused, and how the adapter was verified against vLLM's own scheduler.
"""

from ._compat import RULES, SUPPORTED_VLLM_VERSIONS, UnsupportedVLLMVersionError
from ._config import UnsupportedFeatureError
from .scheduler import Scheduler

__all__ = ["RULES", "SUPPORTED_VLLM_VERSIONS", "Scheduler", "UnsupportedFeatureError", "UnsupportedVLLMVersionError"]
