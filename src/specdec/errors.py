"""The one exception type users see: a clear, one-line message naming the problem."""


class SpecdecError(ValueError):
    """Bad input or an unusable setup, reported in words rather than a deep stack trace."""
