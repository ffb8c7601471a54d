"""Decoding loops: greedy speculative == greedy autoregressive, EOS handling, limits, stats."""

import pytest
import torch

from specdec import GREEDY, Sampler, autoregressive_generate, speculative_generate

from conftest import TableModel, tiny_model


@pytest.fixture(scope="module")
def tiny_pair():
    return tiny_model(0, vocab=64, layers=2, name="tiny-target"), tiny_model(1, vocab=64, layers=1, name="tiny-drafter")


PROMPTS = [[3, 7, 9], [5], [10, 11, 12, 13, 14, 15, 16, 17]]


@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
@pytest.mark.parametrize("first_target", [True, False])
def test_greedy_speculative_equals_greedy_autoregressive_on_tiny_models(tiny_pair, gamma, first_target):
    target, drafter = tiny_pair
    for prompt in PROMPTS:
        ar = autoregressive_generate(prompt, target, max_new_tokens=30, eos_token_ids=[])
        sd = speculative_generate(prompt, target, drafter, gamma=gamma, max_new_tokens=30, eos_token_ids=[],
                                  first_target=first_target)
        assert sd.tokens == ar.tokens
        assert len(sd.tokens) == 30 and sd.stop_reason == "max_new_tokens"


def test_a_perfect_drafter_is_always_accepted_and_saves_target_passes(tiny_pair):
    target, _ = tiny_pair
    ar = autoregressive_generate([3, 4], target, max_new_tokens=25, eos_token_ids=[])
    sd = speculative_generate([3, 4], target, target, gamma=4, max_new_tokens=25, eos_token_ids=[])
    assert sd.tokens == ar.tokens
    assert sd.stats.acceptance_rate == 1.0
    # 1 prompt pass, then 24 tokens in steps of 4 drafts + 1 target token; the last step has
    # only 4 tokens left, so gamma shrinks to 3 there
    assert sd.stats.target_passes == 1 + 5
    assert sd.stats.accepted_per_step == [4, 4, 4, 4, 3]
    assert sd.stats.accepted == sd.stats.drafted == 19


def test_eos_inside_an_accepted_draft_stops_there(tiny_pair):
    target, _ = tiny_pair
    ar = autoregressive_generate([3, 4], target, max_new_tokens=25, eos_token_ids=[])
    # a token first emitted 3rd or later: after the target's first token, a perfect drafter's
    # 4-token drafts carry it
    eos = next(t for i, t in enumerate(ar.tokens) if i >= 2 and t not in ar.tokens[:i])
    expected = ar.tokens[: ar.tokens.index(eos) + 1]
    sd = speculative_generate([3, 4], target, target, gamma=4, max_new_tokens=25, eos_token_ids=[eos])
    assert sd.tokens == expected and sd.stop_reason == "eos"
    last = sd.steps[-1]
    assert eos in last.draft_tokens[: last.num_accepted] and last.emitted[-1] == eos
    ar_eos = autoregressive_generate([3, 4], target, max_new_tokens=25, eos_token_ids=[eos])
    assert ar_eos.tokens == expected and ar_eos.stop_reason == "eos"


def test_several_eos_ids_any_one_stops(tiny_pair):
    target, drafter = tiny_pair
    ar = autoregressive_generate([8], target, max_new_tokens=20, eos_token_ids=[])
    eos_ids = [ar.tokens[9], ar.tokens[4], 63]
    first = min(ar.tokens.index(t) for t in eos_ids if t in ar.tokens)
    sd = speculative_generate([8], target, drafter, gamma=3, max_new_tokens=20, eos_token_ids=eos_ids)
    assert sd.tokens == ar.tokens[: first + 1]


@pytest.mark.parametrize("max_new", [1, 2, 3, 6, 11])
def test_gamma_shrinks_near_max_new_tokens(tiny_pair, max_new):
    target, drafter = tiny_pair
    ar = autoregressive_generate([1, 2], target, max_new_tokens=max_new, eos_token_ids=[])
    sd = speculative_generate([1, 2], target, drafter, gamma=5, max_new_tokens=max_new, eos_token_ids=[])
    assert sd.tokens == ar.tokens and len(sd.tokens) == max_new
    # never drafts a token it could not emit
    assert all(len(s.draft_tokens) <= max_new - 1 for s in sd.steps)


def test_generation_stops_at_the_context_limit():
    target = tiny_model(0, vocab=64, max_positions=20, name="short-target")
    drafter = tiny_model(1, vocab=64, layers=1, max_positions=20, name="short-drafter")
    prompt = list(range(2, 16))  # 14 tokens: room for 6 more
    ar = autoregressive_generate(prompt, target, max_new_tokens=50, eos_token_ids=[])
    sd = speculative_generate(prompt, target, drafter, gamma=4, max_new_tokens=50, eos_token_ids=[])
    assert len(ar.tokens) == 6 and ar.stop_reason == "context"
    assert sd.tokens == ar.tokens and sd.stop_reason == "context"


def test_stats_add_up(tiny_pair):
    target, drafter = tiny_pair
    sd = speculative_generate([4, 5, 6], target, drafter, gamma=3, max_new_tokens=40, eos_token_ids=[])
    st = sd.stats
    assert st.new_tokens == 40 == sum(len(s.emitted) for s in sd.steps)
    assert st.drafted == sum(len(s.draft_tokens) for s in sd.steps)
    assert st.accepted == sum(st.accepted_per_step) == sum(s.num_accepted for s in sd.steps)
    assert st.target_passes == len(sd.steps)
    assert st.drafter_passes == st.drafted  # one drafter pass per drafted token
    assert 0 <= st.acceptance_rate <= 1 and st.tokens_per_second > 0 and st.wall_seconds > 0
    d = st.to_dict()
    for key in ("target_passes", "drafter_passes", "drafted", "accepted", "acceptance_rate",
                "wall_seconds", "tokens_per_second", "tokens_per_target_pass"):
        assert key in d


def test_seeded_sampling_is_reproducible(tiny_pair):
    target, drafter = tiny_pair
    sampler = Sampler(temperature=1.0)
    a = speculative_generate([4, 5], target, drafter, sampler=sampler, max_new_tokens=20, seed=3, eos_token_ids=[])
    b = speculative_generate([4, 5], target, drafter, sampler=sampler, max_new_tokens=20, seed=3, eos_token_ids=[])
    assert a.tokens == b.tokens


SMOLLM2_PROMPTS = ["def fibonacci(n):", "import numpy as np\n\ndef softmax(x):"]


@pytest.fixture(scope="module")
def smollm2_reference(smollm2):
    return {p: autoregressive_generate(smollm2.encode(p), smollm2, max_new_tokens=32).tokens for p in SMOLLM2_PROMPTS}


@pytest.mark.parametrize("drafter_index,gamma", [(0, 2), (1, 1), (1, 3), (1, 6)])
def test_greedy_identical_on_real_smollm2(smollm2, smollm2_drafters, smollm2_reference, drafter_index, gamma):
    drafter = smollm2_drafters[drafter_index]
    for prompt, expected in smollm2_reference.items():
        sd = speculative_generate(smollm2.encode(prompt), smollm2, drafter, gamma=gamma, max_new_tokens=32)
        assert sd.tokens == expected, f"{drafter.name}, gamma={gamma}, prompt={prompt!r}"
        assert 0 < sd.stats.accepted < sd.stats.drafted  # both accepts and rejections were exercised


def test_real_smollm2_chat_eos_stops_generation(smollm2, smollm2_drafters):
    ids = smollm2.encode("Say hello.", chat=True)
    ar = autoregressive_generate(ids, smollm2, max_new_tokens=200)
    assert ar.stop_reason == "eos"  # the instruct model ends its turn on its own
    sd = speculative_generate(ids, smollm2, smollm2_drafters[1], gamma=4, max_new_tokens=200)
    assert sd.tokens == ar.tokens and sd.stop_reason == "eos"


def test_greedy_identical_on_the_default_pair(default_pair, default_pair_greedy):
    target, drafter = default_pair
    ids, expected = default_pair_greedy
    sd = speculative_generate(ids, target, drafter, gamma=5, max_new_tokens=len(expected))
    assert sd.tokens == expected
    assert sd.stats.target_passes < len(expected) / 2  # the pair really speculates


def test_lenience_is_validated_and_greedy_output_ignores_it(tiny_pair):
    from specdec import SpecdecError

    target, drafter = tiny_pair
    ar = autoregressive_generate([3, 4], target, max_new_tokens=12, eos_token_ids=[])
    sd = speculative_generate([3, 4], target, drafter, gamma=3, max_new_tokens=12, eos_token_ids=[], lenience=0.3)
    assert sd.tokens == ar.tokens  # one-hot p: p/l accepts exactly what p accepts
    assert not sd.stats.lossy and sd.stats.greedy  # so a greedy run is exact, whatever the lenience
    sampled = speculative_generate([3, 4], target, drafter, gamma=3, sampler=Sampler(1.0), max_new_tokens=12, seed=0,
                                   eos_token_ids=[], lenience=0.3)
    assert sampled.stats.lossy and sampled.stats.greedy is False and sampled.stats.to_dict()["lossy"]
    with pytest.raises(SpecdecError, match="lenience"):
        speculative_generate([3, 4], target, drafter, lenience=1.5)


def test_greedy_runs_with_lenience_below_one_are_not_labelled_lossy():
    from specdec.ui.display import summary_line
    from specdec.decoding.results import GenerationStats

    greedy = GenerationStats(new_tokens=4, wall_seconds=1.0, lenience=0.5, greedy=True)
    sampled = GenerationStats(new_tokens=4, wall_seconds=1.0, lenience=0.5, greedy=False)
    assert not greedy.lossy and "LOSSY" not in summary_line(greedy, "sd")
    assert sampled.lossy and "LOSSY" in summary_line(sampled, "sd")
    assert not GenerationStats(lenience=1.0, greedy=False).lossy


def test_debug_records_p_q_u_per_draft_token(tiny_pair):
    target, drafter = tiny_pair
    sd = speculative_generate([3, 4], target, drafter, gamma=3, sampler=Sampler(1.0), max_new_tokens=12, seed=0,
                              eos_token_ids=[], debug=True, seed_rule="stream")
    for step in sd.steps:
        if step.draft_tokens:
            p, q, u = step.info["p"], step.info["q"], step.info["u"]
            assert len(p) == len(q) == len(u) == len(step.draft_tokens)
            # the verdicts agree with the recorded numbers: accepted iff u·q < p
            assert all((u[i] * q[i] < p[i]) == (i < step.num_accepted) for i in range(step.num_accepted + 1)
                       if i < len(step.draft_tokens))


def _hf_beam(model, ids, num_beams, max_new_tokens, length_penalty, early_stopping=False):
    eos = model.eos_token_ids
    inputs = torch.tensor([ids])
    with torch.inference_mode():
        out = model.hf.generate(inputs, attention_mask=torch.ones_like(inputs), num_beams=num_beams, do_sample=False,
                                max_new_tokens=max_new_tokens, length_penalty=length_penalty,
                                early_stopping=early_stopping, repetition_penalty=1.0, temperature=None, top_p=None,
                                top_k=None, eos_token_id=eos, pad_token_id=eos[0])
    tokens = out[0, len(ids):].tolist()
    cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:cut]


@pytest.mark.parametrize("num_beams,length_penalty", [(2, 1.0), (3, 0.5), (4, 2.0)])
def test_beam_search_matches_transformers_on_real_smollm2(smollm2, num_beams, length_penalty):
    from specdec import beam_search_generate

    for prompt, chat, max_new in [("def fibonacci(n):", False, 16), ("Say hello.", True, 40)]:
        ids = smollm2.encode(prompt, chat=chat)
        ours = beam_search_generate(ids, smollm2, num_beams=num_beams, length_penalty=length_penalty,
                                    max_new_tokens=max_new)
        assert ours.tokens == _hf_beam(smollm2, ids, num_beams, max_new, length_penalty), (prompt, num_beams)
    assert ours.stop_reason == "eos"  # the chat prompt ends its turn: finished hypotheses were exercised


def test_beam_search_with_one_beam_is_greedy(tiny_pair):
    from specdec import beam_search_generate

    target, _ = tiny_pair
    ar = autoregressive_generate([3, 4], target, max_new_tokens=15, eos_token_ids=[])
    assert beam_search_generate([3, 4], target, num_beams=1, max_new_tokens=15, eos_token_ids=[]).tokens == ar.tokens
    with pytest.raises(Exception, match="num_beams"):
        beam_search_generate([3, 4], target, num_beams=0)


def test_a_slow_on_step_callback_is_not_counted_in_the_timings():
    """Rendering runs outside the timed region: wall_seconds leaves out the time spent in on_step."""
    import time

    target, drafter = TableModel(5, 0), TableModel(5, 1)
    runs = {"ar": lambda cb: autoregressive_generate([1, 2], target, max_new_tokens=5, eos_token_ids=[], on_step=cb),
            "sd": lambda cb: speculative_generate([1, 2], target, drafter, gamma=2, max_new_tokens=8, eos_token_ids=[],
                                                  on_step=cb)}
    for name, run in runs.items():
        slept = []

        def slow(step):
            begin = time.perf_counter()
            time.sleep(0.05)
            slept.append(time.perf_counter() - begin)

        begin = time.perf_counter()
        out = run(slow)
        outside = time.perf_counter() - begin
        assert len(slept) == len(out.steps) >= 4, name
        # the call took `outside` seconds, `sum(slept)` of them in the callback
        assert out.stats.wall_seconds <= outside - sum(slept), name
        assert 0 < out.stats.first_token_seconds <= out.stats.wall_seconds, name


def test_the_stats_split_the_wall_clock_between_target_drafter_and_loop():
    """target_seconds / drafter_seconds hold the time inside each model's passes, and the loop's
    own time is the rest: a target made 20 ms slower per pass moves 20 ms a pass into
    target_seconds and none into the loop's; likewise a slower drafter."""
    import time

    class Slow(TableModel):
        def forward(self, *args, **kwargs):
            time.sleep(0.02)
            return super().forward(*args, **kwargs)

    fast_target, fast_drafter = TableModel(5, 0), TableModel(5, 1)
    slow_target, slow_drafter = Slow(5, 0), Slow(5, 1)
    ar = autoregressive_generate([1, 2], slow_target, max_new_tokens=6, eos_token_ids=[])
    assert ar.stats.target_seconds >= 0.02 * ar.stats.target_passes and ar.stats.drafter_seconds == 0
    assert ar.stats.loop_ms_per_step < 10 and ar.stats.loop_seconds <= ar.stats.wall_seconds
    for target, drafter in ((slow_target, fast_drafter), (fast_target, slow_drafter)):
        sd = speculative_generate([1, 2], target, drafter, gamma=2, max_new_tokens=8, eos_token_ids=[])
        s = sd.stats
        passes = s.target_passes if target is slow_target else s.drafter_passes
        slow_seconds = s.target_seconds if target is slow_target else s.drafter_seconds
        assert passes >= 3 and slow_seconds >= 0.02 * passes
        assert s.loop_ms_per_step < 10, s  # the sleeps were not counted as the loop's
        assert abs(s.target_seconds + s.drafter_seconds + s.loop_seconds - s.wall_seconds) < 1e-9
        d = s.to_dict()
        assert d["loop_seconds"] == s.loop_seconds and d["target_seconds"] == s.target_seconds


def test_an_on_step_callback_with_flush_is_flushed_once_at_the_end():
    """StepPrinter holds back a character split over tokens; the loops flush it when they end."""
    calls = []

    class Printer:
        def __call__(self, step):
            calls.append("step")

        def flush(self):
            calls.append("flush")

    target, drafter = TableModel(5, 0), TableModel(5, 1)
    autoregressive_generate([1, 2], target, max_new_tokens=3, eos_token_ids=[], on_step=Printer())
    assert calls == ["step"] * 3 + ["flush"]
    calls.clear()
    out = speculative_generate([1, 2], target, drafter, gamma=2, max_new_tokens=6, eos_token_ids=[], on_step=Printer())
    assert calls == ["step"] * len(out.steps) + ["flush"]

def test_accepted_counts_only_the_drafts_that_were_emitted():
    """An EOS inside an accepted draft ends the output: the accepted drafts after it were never
    emitted and must not count as accepted."""
    target = TableModel(vocab=8, seed=0)
    # a prompt whose greedy output has a new token at index 2: with first_target, the first draft
    # of a perfect drafter (the target itself) is tokens 1..4, and that token is its 2nd
    for prompt in ([a, b] for a in range(8) for b in range(8)):
        ar = autoregressive_generate(prompt, target, max_new_tokens=6, eos_token_ids=[])
        if ar.tokens[2] not in ar.tokens[:2]:
            break
    sd = speculative_generate(prompt, target, target, gamma=4, max_new_tokens=6, eos_token_ids=[ar.tokens[2]])
    assert sd.tokens == ar.tokens[:3] and sd.stop_reason == "eos"
    last = sd.steps[-1]
    assert last.num_accepted == len(last.draft_tokens) == 4 and last.emitted == ar.tokens[1:3]
    assert sd.stats.accepted == 2 and sd.stats.accepted_per_step == [2] and sd.stats.drafted == 4
    assert sd.stats.acceptance_rate == 0.5


class _BeamCache:
    """The token rows of a _BeamTable, with the batched-cache calls beam search makes."""

    def __init__(self):
        self.rows: list[list[int]] = [[]]

    def get_seq_length(self) -> int:
        return len(self.rows[0])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.rows = [list(row) for row in self.rows for _ in range(repeats)]

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self.rows = [list(self.rows[i]) for i in beam_idx.tolist()]


class _BeamTable(TableModel):
    """A TableModel that beam search can drive (logits = table[previous two tokens], per row)."""

    def new_cache(self):
        return _BeamCache()

    def _next_logits(self, row: list[int]) -> torch.Tensor:
        context = [self.vocab_size, self.vocab_size] + row
        return self.table[context[-2], context[-1]]

    def prefill(self, prompt, cache):
        cache.rows[0] += list(prompt)[:-1]
        return list(prompt)[-1:]

    def forward(self, input_ids, cache=None, num_logits=1):
        row = cache.rows[0] if cache is not None else []
        row += [int(t) for t in input_ids]
        return torch.stack([self._next_logits(row[:len(row) - k]) for k in reversed(range(num_logits))])

    def forward_rows(self, input_ids: torch.Tensor, cache) -> torch.Tensor:
        for row, new in zip(cache.rows, input_ids.tolist()):
            row += new
        return torch.stack([self._next_logits(row) for row in cache.rows])


def test_beam_search_builds_its_tensors_on_the_models_device():
    """Every tensor beam search makes must live on the logits' device (CUDA for a CUDA model).
    Without a GPU, torch's default device is set to `meta` while the model computes on the CPU:
    a tensor made without device= then lands on meta, and mixing it with the CPU logits or
    reading it back fails, as a CPU tensor would next to CUDA logits."""
    from specdec import beam_search_generate

    model = _BeamTable(vocab=6, seed=0)
    model.eos_token_ids = [3]
    expected = beam_search_generate([1, 2], model, num_beams=3, max_new_tokens=8)
    assert len(expected.tokens) == 3 and expected.stop_reason == "eos"  # beams ran on and finished
    previous = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        out = beam_search_generate([1, 2], model, num_beams=3, max_new_tokens=8)
    finally:
        torch.set_default_device(previous)
    assert out.tokens == expected.tokens


def test_typical_acceptance_is_greedy_exact_lossy_under_sampling_and_chains_only(tiny_pair):
    from specdec import SpecdecError
    from specdec.ui.display import summary_line
    from specdec.drafters import LookupTreeDrafter
    from specdec.core.verify import Typical

    target, drafter = tiny_pair
    ar = autoregressive_generate([3, 4], target, max_new_tokens=16, eos_token_ids=[])
    sd = speculative_generate([3, 4], target, drafter, gamma=3, max_new_tokens=16, eos_token_ids=[],
                              typical=Typical())
    assert sd.tokens == ar.tokens and not sd.stats.lossy  # greedy verification is by argmax either way
    sampled = speculative_generate([3, 4], target, drafter, gamma=3, sampler=Sampler(1.0), max_new_tokens=16,
                                   seed=0, eos_token_ids=[], typical=Typical(0.2, 0.5))
    assert sampled.stats.lossy and sampled.stats.to_dict()["typical"] == "typical acceptance ε=0.2, δ=0.5"
    assert summary_line(sampled.stats, "sd").startswith("LOSSY (typical acceptance ε=0.2, δ=0.5")
    with pytest.raises(SpecdecError, match="chain drafts only"):
        speculative_generate([3, 4], target, LookupTreeDrafter(), typical=Typical())
    with pytest.raises(SpecdecError, match="not both"):
        speculative_generate([3, 4], target, drafter, typical=Typical(), lenience=0.5)
