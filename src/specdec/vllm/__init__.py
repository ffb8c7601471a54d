"""specdec inside vLLM: our model-free drafters as vLLM's `custom_class` proposers.

    vllm serve TARGET --speculative-config \\
        '{"method": "custom_class", "model": "specdec.vllm.SuffixProposer", "num_speculative_tokens": 8}'

`SuffixProposer` (SuffixDecoding, per-request and cross-request), `LookupProposer` (prompt
lookup), `NgramProposer` (NASD), `RetrievalProposer` (a REST datastore built by `specdec
datastore build`, named by $SPECDEC_DATASTORE). specdec installs into vLLM's environment without
its own dependencies (`pip install --no-deps specdec`): vLLM's torch, numpy and transformers are
all these need. docs/scaling.md has the whole story.
"""

from .proposers import LookupProposer, NgramProposer, RetrievalProposer, SuffixProposer

__all__ = ["LookupProposer", "NgramProposer", "RetrievalProposer", "SuffixProposer"]
