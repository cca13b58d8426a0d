"""The errors of megazoo checkpoints, raised by every reader and writer (training/checkpoint/
format.py re-exports them): one line naming the file and what to do."""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and what to do."""


class IntegrityError(CheckpointError):
    """A damaged checkpoint (missing, truncated or altered bytes): an earlier one may serve."""
