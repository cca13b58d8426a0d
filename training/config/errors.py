"""The one error type of the command line: raised by every flag check, printed once by the script."""


class ArgumentError(ValueError):
    """Inconsistent command-line values; the message names the flag."""
