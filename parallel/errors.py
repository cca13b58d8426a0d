"""The parallel layout's error, below every module that checks a layout (layout.py and the
pipeline partition both raise it)."""


class LayoutError(ValueError):
    """An impossible parallel layout; the message names the flag to change."""
