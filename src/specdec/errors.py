"""The one exception type users see: a clear, one-line message naming the problem."""


class SpecdecError(ValueError):
    """Bad input or an unusable setup, reported in words rather than a deep stack trace."""


class ModelFault(SpecdecError):
    """The model or its backend failed (NaN logits, every token ruled out, a backend call that
    failed): a fault of the weights, the dtype or the machine, not of the request that met it (the
    server answers 500, not 400)."""
