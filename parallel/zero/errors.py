"""The optimizer configuration's error (its own module: the config and the optimizers' settings,
muon.py and qk_clip.py, all raise it)."""


class ZeroConfigError(ValueError):
    """A bad optimizer configuration; the message names the flag and the fix."""
