"""Each kernel fallback is logged once per process, not once per call (a layer calls its kernel
every microbatch)."""
from __future__ import annotations

import functools
import logging


@functools.lru_cache(maxsize=None)
def log_choice_once(logger_name: str, message: str) -> None:
    """Log `message` at INFO on `logger_name` the first time this pair is seen."""
    logging.getLogger(logger_name).info(message)
