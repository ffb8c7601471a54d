"""One sequence: the speculation (a `SpecConfig` and what it builds), the sequence's state,
its results, and the loops (autoregressive, speculative, beam search).
"""
