"""Small enums shared by both scheduler implementations."""

from __future__ import annotations

import enum

__all__ = ["FinishReason", "RequestStatus"]


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Values match the Rust core's codes."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(enum.IntEnum):
    """Why a request finished (the codes in ``UpdateResult.finish_reasons``)."""

    STOP = 1  # EOS or a stop token id
    LENGTH = 2  # max_tokens or max_model_len
    ABORT = 3  # abort_requests()

    def __str__(self) -> str:
        return self.name.lower()
