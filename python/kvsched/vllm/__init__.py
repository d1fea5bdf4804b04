"""kvsched as vLLM's scheduler: ``vllm serve MODEL --scheduler-cls kvsched.vllm.Scheduler``.

Importing this module imports vLLM (``pip install '.[vllm]'`` in kvsched's repository root, vLLM 0.33);
``import kvsched`` does not.
See docs/vllm.md for what is supported, what is refused, and how the adapter was verified against vLLM's own
scheduler.
"""

from ._config import UnsupportedFeatureError
from .scheduler import Scheduler

__all__ = ["Scheduler", "UnsupportedFeatureError"]
