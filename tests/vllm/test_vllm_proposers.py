"""Our drafters as vLLM `custom_class` proposers (specdec/vllm), driven here as vLLM's model
runner drives them: rows that move as requests end, rows in prefill, acceptance read from what
each step produced; and vLLM's CPU build itself running them (marked `vllm`: `make test-vllm`)."""

from types import SimpleNamespace

import numpy as np
import pytest

from specdec.errors import SpecdecError
from specdec.vllm import LookupProposer, NgramProposer, RetrievalProposer, SuffixProposer
from specdec.vllm.proposers import GRACE, StepCosts

V, MAX_LEN = 100, 512


def vllm_config(k: int = 4, max_model_len: int = MAX_LEN):
    spec = SimpleNamespace(num_speculative_tokens=k, suffix_decoding_max_tree_depth=24,
                           suffix_decoding_max_spec_factor=1.0, suffix_decoding_min_token_prob=0.1)
    model = SimpleNamespace(max_model_len=max_model_len, get_vocab_size=lambda: V, tokenizer="none",
                            trust_remote_code=False)
    return SimpleNamespace(speculative_config=spec, model_config=model)


class FakeRunner:
    """vLLM's batch as its model runner keeps it: a row a request, the last row moved into a hole
    when a request ends (vLLM's `condense`), prefill in chunks (a step of a row in prefill produces
    nothing), and each draft verified against the request's fixed greedy text (`texts`: prompt
    length and the whole text), the longest agreeing prefix and one token more kept."""

    def __init__(self, proposer, max_rows: int = 8, chunk: int | None = None):
        self.proposer, self.chunk = proposer, chunk
        self.seconds = 0.0  # a step takes 0.1 s and 0.02 s a scored token (a CPU's slope)
        proposer.clock = lambda: self.seconds
        self.tokens = np.zeros((max_rows, MAX_LEN), dtype=np.int32)
        self.rows: list[dict] = []  # per row: name, text, prompt, length (tokens committed), prefilled
        self.drafts: list[list[int]] = []
        self.outputs: dict[str, list[int]] = {}
        self.steps = self.drafted = self.accepted = 0

    def add(self, name: str, text: list[int], prompt: int) -> None:
        row = len(self.rows)
        self.tokens[row, :prompt] = text[:prompt]
        self.rows.append({"name": name, "text": text, "prompt": prompt, "length": 0})
        self.drafts.append([])

    def swap(self, a: int, b: int) -> None:
        """vLLM's batch reordered: rows a and b trade places."""
        self.tokens[[a, b]] = self.tokens[[b, a]]
        self.rows[a], self.rows[b] = self.rows[b], self.rows[a]
        self.drafts[a], self.drafts[b] = self.drafts[b], self.drafts[a]

    def step(self, propose: bool = True) -> None:
        """One engine step; `propose` False: vLLM skips the proposer this step (no drafts next)."""
        sampled, counts = [], []
        for row, (state, draft) in enumerate(zip(self.rows, self.drafts)):
            if state["length"] < state["prompt"]:  # prefill, in chunks
                state["length"] = min(state["prompt"], state["length"] + (self.chunk or state["prompt"]))
                if state["length"] < state["prompt"]:
                    sampled.append([])
                    counts.append(state["length"])
                    continue
                produced = [state["text"][state["length"]]]
            else:
                # as vLLM, a step produces the kept drafts and one token more, also past a request's
                # end (its scheduler cuts the output afterwards): past its text, the fake's text is 0s
                at, text = state["length"], state["text"] + [0] * (self.proposer.gamma + 1)
                kept = 0
                while kept < len(draft) and draft[kept] == text[at + kept]:
                    kept += 1
                produced = text[at:at + kept + 1]
                self.drafted += len(draft)
                self.accepted += kept
            self.tokens[row, state["length"]:state["length"] + len(produced)] = produced
            state["length"] += len(produced)
            sampled.append(list(produced))
            counts.append(state["length"])
        self.steps += 1
        self.seconds += 0.1 + 0.02 * sum(1 + len(d) for d in self.drafts)
        if not propose:
            self.drafts = [[] for _ in self.rows]
            return
        self.drafts = self.proposer.propose(sampled, np.array(counts + [0] * 3), self.tokens)
        assert len(self.drafts) == len(self.rows)
        for row, request in self.proposer.requests.rows.items():  # each request's text is its row's
            assert request.text == list(self.tokens[row, :request.length]), row
        assert all(len(d) <= self.proposer.gamma for d in self.drafts)
        for row in reversed(range(len(self.rows))):  # ended requests leave; the last row fills the hole
            state = self.rows[row]
            if state["length"] >= len(state["text"]):
                self.outputs[state["name"]] = list(self.tokens[row, state["prompt"]:len(state["text"])])
                last = len(self.rows) - 1
                self.tokens[row] = self.tokens[last]
                self.rows[row], self.drafts[row] = self.rows[last], self.drafts[last]
                self.rows.pop()
                self.drafts.pop()

    def run(self, limit: int = 2000) -> None:
        for _ in range(limit):
            if not self.rows:
                return
            self.step()
        raise AssertionError("the fake runner did not finish")


def repetitive(seed: int, length: int = 120) -> list[int]:
    """A text that repeats a few phrases (what suffix and lookup drafting feed on)."""
    rng = np.random.default_rng(seed)
    phrases = [list(rng.integers(1, V, size=int(rng.integers(4, 9)))) for _ in range(4)]
    text: list[int] = []
    while len(text) < length:
        text += phrases[int(rng.integers(0, len(phrases)))]
    return [int(t) for t in text[:length]]


@pytest.mark.parametrize("cls", [SuffixProposer, LookupProposer, NgramProposer])
def test_requests_are_followed_across_moving_rows_and_drafts_are_accepted(cls):
    proposer = cls(vllm_config())
    runner = FakeRunner(proposer, chunk=16)
    texts = {f"r{i}": repetitive(i, 80 + 15 * i) for i in range(6)}
    for name, text in texts.items():
        runner.add(name, text, 40)
    runner.run()
    assert runner.outputs == {name: text[40:] for name, text in texts.items()}
    assert runner.drafted > 0 and runner.accepted > 0.5 * runner.drafted
    # what the proposer counted as accepted is what the runner kept: each request was followed
    assert (proposer.drafted, proposer.accepted) == (runner.drafted, runner.accepted)
    # fewer target passes than tokens: the drafts paid
    assert runner.steps < max(len(t) - 40 for t in texts.values()) + 3 * 2
    assert runner.accepted / runner.steps > (1.5 if cls is not NgramProposer else 0.5)


def test_a_request_is_told_apart_from_another_with_the_same_prompt():
    proposer = LookupProposer(vllm_config())
    runner = FakeRunner(proposer)
    prompt = repetitive(1, 30)
    first, second = prompt + repetitive(2, 40), prompt + repetitive(3, 60)
    runner.add("a", first, 30)
    runner.add("b", second, 30)
    runner.run()
    assert (proposer.drafted, proposer.accepted) == (runner.drafted, runner.accepted)
    assert runner.outputs == {"a": first[30:], "b": second[30:]}


def test_requests_with_one_long_prompt_are_told_apart_when_their_rows_trade_places():
    proposer = SuffixProposer(vllm_config())
    runner = FakeRunner(proposer)
    prompt = repetitive(7, 100)  # longer than the key: both requests have the same one
    texts = {"a": prompt + repetitive(8, 60), "b": prompt + repetitive(9, 60)}
    for name, text in texts.items():
        runner.add(name, text, 100)
    for i in range(40):
        runner.step()
        if i % 3 == 1 and len(runner.rows) == 2:
            runner.swap(0, 1)
    runner.run()
    assert runner.outputs == {name: text[100:] for name, text in texts.items()}
    assert (proposer.drafted, proposer.accepted) == (runner.drafted, runner.accepted)


def test_a_call_vllm_skips_leaves_every_request_followed():
    proposer = LookupProposer(vllm_config())
    runner = FakeRunner(proposer)
    for i in range(3):
        runner.add(f"r{i}", repetitive(i, 90), 30)
    for _ in range(3):
        runner.step()
    followed = [id(r) for r in proposer.requests.rows.values()]
    runner.step(propose=False)  # vLLM skipped the proposer (a row near max_model_len)
    runner.step()
    assert [id(r) for r in proposer.requests.rows.values()] == followed
    runner.run()
    assert runner.outputs == {f"r{i}": repetitive(i, 90)[30:] for i in range(3)}


def test_an_ended_requests_output_drafts_for_the_next_ones():
    proposer = SuffixProposer(vllm_config(k=8))
    runner = FakeRunner(proposer)
    answer = list(range(10, 70))  # no repeats inside it: only an earlier output predicts it
    runner.add("first", [1, 2, 3, 4] + answer, 4)
    runner.run()
    for _ in range(GRACE + 1):  # vLLM calls on with other rows; the ended request leaves then
        runner.add("filler", [5, 6, 7, 8, 9], 4)
        runner.run()
    assert proposer.cache.index.held > len(answer)
    before = proposer.accepted
    runner.add("second", [90, 91, 92, 93] + answer, 4)
    runner.run()
    assert proposer.accepted - before > 0.8 * (len(answer) - 2)


def test_a_reset_forgets_earlier_outputs_and_requests():
    proposer = SuffixProposer(vllm_config(k=8))
    runner = FakeRunner(proposer)
    answer = list(range(10, 70))
    for name in ("first", "filler", "filler again", "and again"):
        runner.add(name, [1, 2, 3, 4] + answer if name == "first" else [5, 6, 7, 8, 9], 4)
        runner.run()
    assert proposer.cache.index.held > len(answer)
    runner.add("second", [90, 91, 92, 93] + answer, 4)
    runner.step()
    runner.step()
    assert proposer.requests.rows and proposer.drafted
    proposer.reset()
    assert not proposer.requests.rows and proposer.cache.index.held == 0 and proposer.drafted == 0
    runner.run()  # the request in flight is met afresh, as a new one, with nothing to copy from
    assert runner.outputs["second"] == answer and proposer.accepted == 0


def test_a_request_whose_drafts_fail_drafts_shorter():
    proposer = LookupProposer(vllm_config(k=8))
    runner = FakeRunner(proposer)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(1, 10, size=60)]  # lookup finds matches that the text then breaks
    text = prompt + [int(t) for t in rng.integers(1, 10, size=200)]
    runner.add("noisy", text, 60)
    lengths = []
    while runner.rows:
        runner.step()
        lengths += [len(d) for d in runner.drafts]
    assert np.mean(lengths[-50:]) < 1.5  # it learns the request's acceptance
    assert runner.outputs["noisy"] == text[60:]


def test_no_draft_runs_past_the_models_length():
    proposer = LookupProposer(vllm_config(k=8, max_model_len=70))
    runner = FakeRunner(proposer)
    text = [1, 2, 3, 4] * 17
    runner.add("a", text, 20)
    while runner.rows:
        for state, draft in zip(runner.rows, runner.drafts):
            assert state["length"] + len(draft) <= 69
        runner.step()


def test_step_costs_fit_the_batch_and_ignore_an_idle_engine():
    costs = StepCosts(decay=1.0)
    clock = 0.0
    assert costs.costs() is None
    costs.step(clock, produced=2, width=0, clean=True)
    for width in [1, 5, 2, 8, 3, 6] * 3:
        clock += 0.1 + 0.02 * width
        costs.step(clock, produced=2, width=width, clean=True)
    rate, drafter, slope, one = costs.costs()
    assert slope == pytest.approx(0.02, rel=1e-6) and one == pytest.approx(0.12, rel=1e-6) and drafter == 0
    costs.step(clock + 1000.0, produced=2, width=4, clean=True)  # the engine sat idle: not a step
    assert costs.costs()[2] == pytest.approx(0.02, rel=1e-6)
    steps = costs.steps
    costs.step(clock + 1000.2, produced=2, width=4, clean=False)  # a prefill ran in it: its width is unknown
    assert costs.steps == steps


def test_retrieval_needs_a_datastore(monkeypatch):
    monkeypatch.delenv("SPECDEC_DATASTORE", raising=False)
    with pytest.raises(SpecdecError, match="SPECDEC_DATASTORE"):
        RetrievalProposer(vllm_config())
    monkeypatch.setenv("SPECDEC_DATASTORE", "/no/such/datastore")
    with pytest.raises(SpecdecError, match="no meta.json"):
        RetrievalProposer(vllm_config())


@pytest.mark.vllm
@pytest.mark.real
@pytest.mark.skipif(not __import__("specdec.bench.vllm_peer", fromlist=["x"]).vllm_python().exists(),
                    reason="vLLM's CPU build is not built (`make vllm`)")
def test_each_proposer_drafts_inside_vllm_and_keeps_its_greedy_output(smollm2, tmp_path):
    """vLLM's CPU build on SmolLM2-135M with each of our proposers, two summarization prompts two
    in flight: drafts proposed and accepted (fewer target passes), every output equal to vLLM's
    plain output. In float32: in bf16 vLLM's own rows drift apart between the batch shapes that
    drafts make (1 of 2 outputs differed from its plain one, whatever the proposer)."""
    from specdec.bench.concurrency import run_load_benchmark
    from specdec.bench.datasets import load_prompts
    from specdec.bench.runners import Settings
    from specdec.bench.vllm_peer import PROPOSERS
    from specdec.drafters.datastore import build_from_corpus

    corpus = tmp_path / "articles.txt"  # the datastore holds the articles the summaries copy from
    corpus.write_text("\n\n".join(p.text for p in load_prompts("spec-bench", 2, tasks=["summarization"])))
    build_from_corpus(str(corpus), smollm2.tokenizer, smollm2.vocab_size, tmp_path / "store")
    methods = ["vllm", *PROPOSERS]
    result = run_load_benchmark(["spec-bench"], 2, methods, [2], "smollm2-135m", "smollm2-135m",
                                Settings(max_new_tokens=48, datastore=str(tmp_path / "store"), vllm_eager=True,
                                         vllm_dtype="float32"),
                                tasks=["summarization"])
    rows = {s["method"]: s for s in result["levels"]}
    for method in PROPOSERS:
        row = rows[method]
        assert row["identical_vllm"] == 2 and row["acceptance_rate"], (method, row)
        assert row["target_passes"] < rows["vllm"]["target_passes"], (method, row, rows["vllm"])
