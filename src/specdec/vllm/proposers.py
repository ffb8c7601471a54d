"""Our model-free drafters behind vLLM 0.32's `custom_class` proposer interface.

vLLM builds `Class(vllm_config)`, calls `load_model(model)` once, and after every engine step
`propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)`: for each row
of its batch, the tokens the step produced (none for a row still in prefill), how many tokens the
row holds, and the rows' tokens [max_num_reqs, max_model_len]. It wants one list of draft ids a
row back (empty: no draft), at most `num_speculative_tokens` long. vLLM verifies them as one-hot
proposals, which is exact for any draft that does not depend on the target's random draws: every
proposer here keeps vLLM's output distribution (greedy: vLLM's own greedy output).

vLLM names rows, not requests (rows move as requests end), so `Requests` follows each request
from call to call by the first tokens of its prompt, its latest tokens and its length
(`Requests.find`). A request
that no row holds for `GRACE` calls has ended: its drafter's `finish` sees its text (suffix
drafting adds its output to the shared cache of earlier outputs).

Draft lengths are our cost-aware rule (`schedules.CostAware`), one schedule a request: it learns
from how many of its tokens came back (acceptance, per request) and is given the batch's costs,
fitted from vLLM's own steps: the time between two calls over the tokens the step scored
(`StepCosts`), as our engine's batch policy does with its passes. A token is drafted while the
chance that the draft so far survives pays for one more scored token at the batch's rate.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np
import torch

from ..errors import SpecdecError
from ..core.samplers import GREEDY
from ..sizing.schedules import CostAware, WidthFit

KEY_TOKENS = 64  # prompt tokens that identify a request from call to call
TAIL = 16  # and its latest tokens (requests with one prompt part where their outputs do)
GRACE = 2  # calls a request may miss (a step that did not schedule it) before it counts as ended
WARMUP = 4  # timed steps before the fitted costs replace the starting threshold
STALL = 4.0  # a gap over this many times the mean step is an idle engine, not a step: not timed


@dataclass
class Request:
    """One request as the proposer follows it."""

    key: bytes  # its first prompt tokens
    length: int  # tokens it held at the last call
    drafter: object
    schedule: CostAware
    text: list[int] = field(default_factory=list)  # prompt and output so far
    drafted: int = 0  # length of its last draft
    missed: int = 0  # calls since a row last held it


def _key(tokens: np.ndarray, count: int) -> bytes:
    return np.ascontiguousarray(tokens[:count], dtype=np.int32).tobytes()


class Requests:
    """The requests behind vLLM's rows, followed from call to call (`begin_call`, `find` a row,
    `end_call`)."""

    def __init__(self, new_drafter: Callable[[], object], gamma: int):
        self.new_drafter, self.gamma = new_drafter, gamma
        self.rows: dict[int, Request] = {}  # by the row that held it at the last call
        self.missing: list[Request] = []  # held by no row at the last call (at most GRACE calls)
        self.claimed: dict[int, Request] = {}

    def begin_call(self) -> None:
        self.claimed, self._claimed_ids = {}, set()

    def find(self, row: int, tokens: np.ndarray, length: int, produced: int) -> tuple[Request, bool]:
        """The request in `row` (tokens [≥ length]: `length` after this step, `produced` of them
        new) -> (request, whether it is new). The one that row held last is tried first; a known
        request continues where its first prompt tokens and its last `TAIL` tokens are in the row
        and its length grew by at least what the step produced (more where vLLM skipped calls)."""
        def continues(request: Request | None) -> bool:
            if request is None or id(request) in self._claimed_ids or request.length + produced > length:
                return False
            tail = min(TAIL, request.length)
            return (_key(tokens, len(request.key) // 4) == request.key
                    and np.array_equal(tokens[request.length - tail:request.length], request.text[-tail:]))

        if continues(self.rows.get(row)):  # most calls: every request where it was
            return self._claim(row, self.rows[row]), False
        for request in [*self.rows.values(), *self.missing]:
            if continues(request):
                return self._claim(row, request), False
        prompt = length - produced
        request = Request(_key(tokens, min(KEY_TOKENS, prompt)), prompt, self.new_drafter(),
                          CostAware(gamma_max=self.gamma))
        request.text = [int(t) for t in tokens[:prompt]]
        request.drafter.start(request.text)
        return self._claim(row, request), True

    def _claim(self, row: int, request: Request) -> Request:
        self.claimed[row] = request
        self._claimed_ids.add(id(request))
        request.missed = 0
        return request

    def end_call(self) -> list[Request]:
        """Rows now hold what this call found in them; a request no row held for more than
        `GRACE` calls has ended -> those."""
        ended, missing = [], []
        for request in [*self.rows.values(), *self.missing]:
            if id(request) not in self._claimed_ids:
                request.missed += 1
                (ended if request.missed > GRACE else missing).append(request)
        self.rows, self.missing = dict(self.claimed), missing
        return ended


class StepCosts:
    """The batch's costs, fitted from vLLM's steps: a step's seconds (from one call to the next)
    over the tokens it scored, t ≈ base + slope·width, and the tokens it produced."""

    def __init__(self, decay: float = 0.98):
        self.fit, self.decay = WidthFit(decay), decay
        self.tokens = self.seconds = self.widths = self.steps = 0.0  # decayed sums of the timed steps
        self.began: float | None = None

    def step(self, now: float, produced: int, width: int, clean: bool) -> None:
        """A call at `now`: the step since the last call scored `width` tokens and produced
        `produced`; `clean`: it ran no prefill and every row's draft is known (else its width is not)."""
        if self.began is not None and clean and width > 0:
            seconds = now - self.began
            if not self.steps or seconds < STALL * self.seconds / self.steps * max(1.0, width * self.steps / self.widths):
                self.fit.add(width, seconds)
                self.tokens = self.tokens * self.decay + produced
                self.seconds = self.seconds * self.decay + seconds
                self.widths = self.widths * self.decay + width
                self.steps = self.steps * self.decay + 1
        self.began = now

    def costs(self) -> tuple[float, float, float, float] | None:
        """(rate, drafter pass, slope, one-token pass) as `CostAware.impose` takes them; None
        until `WARMUP` steps with varied widths are timed. The rate is at least what the batch
        would make drafting nothing (every row one token a step)."""
        fitted = self.fit.fit() if self.fit.samples >= WARMUP else None
        if fitted is None or self.seconds <= 0:
            return None
        slope, base = fitted
        rows = max(1.0, self.widths / self.steps)  # the mean width: at least the rows
        plain = rows / (base + slope * rows) if base + slope * rows > 0 else 0.0
        return max(self.tokens / self.seconds, plain), 0.0, slope, base + slope


class Proposer:
    """A vLLM `custom_class` proposer over one of our chain drafters (`new_drafter`), one drafter
    and one cost-aware schedule per request."""

    clock = staticmethod(time.perf_counter)  # what a step is timed by

    def __init__(self, vllm_config):
        config = vllm_config.speculative_config
        self.gamma = int(config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.vllm_config = vllm_config
        self.target = SimpleNamespace(vocab_size=int(vllm_config.model_config.get_vocab_size()), tokenizer=None)
        self.generator = torch.Generator()
        self.reset()

    def reset(self) -> None:
        """Forget every request, what was learnt across them and the fitted costs: as built (a
        benchmark calls it between runs of the same prompts, through vLLM's `collective_rpc`)."""
        self.requests = Requests(self.new_drafter, self.gamma)
        self.costs = StepCosts()
        self.drafted = self.accepted = 0  # over every request: drafted, and what came back of it

    def new_drafter(self):
        """A drafter for one new request."""
        raise NotImplementedError

    def load_model(self, *args, **kwargs) -> None:
        """vLLM calls this once with its model: these drafters need none."""

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings=None, **_) -> list[list[int]]:
        """One draft a row of vLLM's batch: sampled_token_ids (a list a row: what the step
        produced, [] for a row in prefill), num_tokens_no_spec [≥ rows] (tokens a row holds),
        token_ids_cpu [≥ rows, max_model_len] (its tokens) -> a list of draft ids a row."""
        now = self.clock()
        self.requests.begin_call()
        costs = self.costs.costs()
        drafts: list[list[int]] = []
        clean, width = True, 0  # whether the step that just ended ran no prefill; the tokens it scored
        for row, sampled in enumerate(sampled_token_ids):
            if not len(sampled):
                drafts.append([])
                clean = False
                continue
            length = int(num_tokens_no_spec[row])
            request, new = self.requests.find(row, token_ids_cpu[row], length, len(sampled))
            clean = clean and not new and request.length + len(sampled) == length
            width += 1 + request.drafted
            drafts.append(self._draft(request, token_ids_cpu[row], length, len(sampled), costs))
        self.costs.step(now, sum(len(s) for s in sampled_token_ids), width, clean)
        for request in self.requests.end_call():
            request.drafter.finish(request.text)
        return drafts

    def _draft(self, request: Request, tokens: np.ndarray, length: int, produced: int, costs) -> list[int]:
        """Tell `request`'s drafter what came back of its last draft; its next draft."""
        if request.length + produced != length:  # vLLM skipped calls: what its drafts became is unknown
            request.drafted = 0
        accepted = min(produced - 1, request.drafted)
        if request.drafted:
            request.drafter.rollback(request.length + accepted)
            request.schedule.update(request.drafted, accepted)
            self.drafted += request.drafted
            self.accepted += accepted
        request.text.extend(int(t) for t in tokens[request.length:length])
        request.length = length
        room = min(self.gamma, self.max_model_len - length - 1)
        if room < 1:
            request.drafted = 0
            return []
        request.schedule.impose(True, costs, room)
        draft = request.drafter.propose(request.text, room, GREEDY, self.generator,
                                        request.schedule.keep_going)
        tokens_out = [int(t) for t in draft.tokens][:room]
        request.drafted = len(tokens_out)
        return tokens_out


class SuffixProposer(Proposer):
    """SuffixDecoding: each request's prompt and output, and every ended request's output (a
    cache shared by the requests of this vLLM worker). Reads vLLM's own suffix settings from the
    speculative config (`suffix_decoding_max_tree_depth`, `_max_spec_factor`, `_min_token_prob`)."""

    cache_tokens = 100_000  # earlier outputs held, the oldest dropped beyond it

    def __init__(self, vllm_config):
        config = vllm_config.speculative_config
        self.depth = int(getattr(config, "suffix_decoding_max_tree_depth", 24) or 24)
        self.factor = float(getattr(config, "suffix_decoding_max_spec_factor", 1.0) or 1.0)
        self.min_prob = float(getattr(config, "suffix_decoding_min_token_prob", 0.1) or 0.1)
        super().__init__(vllm_config)

    def reset(self) -> None:
        from ..drafters.suffix import SuffixCache

        self.cache = SuffixCache(self.cache_tokens, self.depth)  # earlier outputs forgotten too
        super().reset()

    def new_drafter(self):
        from ..drafters.suffix import SuffixDrafter

        return SuffixDrafter(self.cache, depth=self.depth, min_prob=self.min_prob, factor=self.factor)


class LookupProposer(Proposer):
    """Prompt lookup: what followed the latest earlier occurrence of the text's last 3, 2 or 1
    tokens."""

    max_ngram, min_ngram = 3, 1

    def new_drafter(self):
        from ..drafters.lookup import LookupDrafter

        return LookupDrafter(self.max_ngram, self.min_ngram)


class NgramProposer(Proposer):
    """NASD: next-token counts after every context of 1..n−1 tokens of the request's text, the
    most frequent drafted (vLLM verifies one-hot drafts)."""

    n = 4

    def new_drafter(self):
        from ..drafters.ngram import NgramDrafter

        drafter = NgramDrafter(self.n)
        drafter.check_target(self.target)
        return drafter


class RetrievalProposer(Proposer):
    """REST: the longest suffix of the text found in a datastore (`specdec datastore build`),
    whose folder $SPECDEC_DATASTORE names (or a subclass's `datastore`); checked against the
    target's tokenizer when vLLM builds the proposer."""

    datastore: str | None = None

    def __init__(self, vllm_config):
        from ..drafters.datastore import Datastore

        folder = self.datastore or os.environ.get("SPECDEC_DATASTORE")
        if not folder:
            raise SpecdecError("RetrievalProposer needs a datastore: set SPECDEC_DATASTORE to a folder built by "
                               "`specdec datastore build`")
        self.store = Datastore(folder)
        super().__init__(vllm_config)
        self.store.check_tokenizer(self._tokenizer(vllm_config), self.target.vocab_size)

    @staticmethod
    def _tokenizer(vllm_config):
        from transformers import AutoTokenizer

        config = vllm_config.model_config
        return AutoTokenizer.from_pretrained(config.tokenizer, trust_remote_code=config.trust_remote_code)

    def new_drafter(self):
        from ..drafters.suffix import SuffixDrafter

        return SuffixDrafter(datastore=self.store)
