"""The engine: many sequences, one target pass per step. A sequence's output must not depend on what
shares its passes: greedy output token-identical to that prompt's AR alone, a seeded sampled one to
the same seed alone, at every batch size; and the batched sampled law is the target's."""

import copy

import pytest
import torch

from specdec import (Engine, Request, Sampler, SpecdecError, autoregressive_generate, generate_many,
                     speculative_generate)
from specdec.drafters import (LookaheadDrafter, LookupDrafter, MixedDrafter, NgramDrafter, SidesDrafter,
                              make_tree_drafter)
from specdec.sizing.schedules import TreeCost
from specdec.core.verify import verify_ragged
from specdec.engine import StepOutput

from conftest import tiny_model
from test_rows import _ids, qwen_like
from test_sampling_exactness import ALPHA, chi_square_pvalue, exact_joint

VOCAB = 4096


@pytest.fixture(scope="module")
def pair():
    """A bf16 row-exact target, a drafter that agrees with it (its copy) and one that mostly does not."""
    target = qwen_like(torch.bfloat16, exact_rows=True, layers=1)
    same = copy.deepcopy(target)
    other = qwen_like(torch.bfloat16, exact_rows=True, layers=1, seed=1)
    return target, same, other


def _recorded(engine: Engine) -> StepOutput:
    """Every step's output of `engine` from now on, merged (`run`'s own included), so that a test
    reads what finished and failed after `run` raised."""
    total, step = StepOutput(), engine.step

    def recording():
        out = step()
        total.merge(out)
        return out

    engine.step = recording
    return total


def _prompts():
    # mostly repetitive, so prompt lookup finds matches; different lengths
    return [(_ids(6, VOCAB, i) * 3)[: 5 + 4 * i] for i in range(5)]


@pytest.mark.parametrize("max_batch", [1, 2, 5])
@pytest.mark.slow
def test_greedy_outputs_equal_each_ar_alone_at_every_batch_size(pair, max_batch):
    target, same, other = pair
    prompts = _prompts()
    reference = [autoregressive_generate(p, target, max_new_tokens=12, eos_token_ids=[]).tokens for p in prompts]
    drafters = [None, same, other, LookupDrafter, lambda: NgramDrafter(3), lambda: make_tree_drafter("sides", other),
                lambda: LookaheadDrafter(3, 3, 2, policy=TreeCost(warmup=10**9))]
    for drafter in drafters:
        results = generate_many(prompts, target, drafter, max_batch=max_batch, max_new_tokens=12, eos_token_ids=[])
        assert [r.tokens for r in results] == reference, drafter


def test_requests_with_different_methods_share_passes(pair):
    target, same, other = pair
    prompts = _prompts()
    reference = [autoregressive_generate(p, target, max_new_tokens=10, eos_token_ids=[]).tokens for p in prompts]
    engine = Engine(target, max_batch=5)
    methods = [None, same, LookupDrafter, lambda: make_tree_drafter("mixed", other), other]
    ids = [engine.add(Request(p, m, max_new_tokens=10, eos_token_ids=[])) for p, m in zip(prompts, methods)]
    results = engine.run()
    assert [results[i].tokens for i in ids] == reference
    # the copy drafts what the target says: its sequence needed fewer passes than plain decoding
    assert results[ids[1]].stats.target_passes < results[ids[0]].stats.target_passes


@pytest.mark.parametrize("drafter", ["none", "model", "tree", "lookahead"])
def test_a_seeded_sampled_sequence_equals_the_same_seed_alone(pair, drafter):
    target, _, other = pair
    prompts, sampler = _prompts(), Sampler(temperature=1.0, top_k=50)
    make = {"none": None, "model": other, "tree": lambda: make_tree_drafter("sides", other),
            "lookahead": lambda: LookaheadDrafter(3, 3, 2, policy=TreeCost(warmup=10**9))}[drafter]
    seeds = [11, 12, 13, 14, 15]
    batched = generate_many(prompts, target, make, max_batch=3, seeds=seeds, sampler=sampler, max_new_tokens=10,
                            eos_token_ids=[], gamma=3)
    for prompt, seed, result in zip(prompts, seeds, batched):
        if make is None:
            alone = autoregressive_generate(prompt, target, sampler, max_new_tokens=10, eos_token_ids=[], seed=seed)
        else:
            drafter_alone = make() if drafter in ("tree", "lookahead") else other
            alone = speculative_generate(prompt, target, drafter_alone, gamma=3, sampler=sampler, max_new_tokens=10,
                                         eos_token_ids=[], seed=seed)
        assert result.tokens == alone.tokens


def test_one_verification_call_a_step_over_the_greedy_and_seeded_chains(pair, monkeypatch):
    """Greedy and seeded chains (and plain sequences) are verified together, one `verify_ragged`
    call a step (`verifier.decide_batch`); unseeded sampling and trees verify alone. Every output as alone."""
    import specdec.decoding.verifier as verifier_module

    target, same, other = pair
    prompts, sampler = _prompts(), Sampler(temperature=1.0, top_k=50)
    calls = []

    def counted(targets, drafts):
        calls.append(len(drafts))
        return verify_ragged(targets, drafts)

    monkeypatch.setattr(verifier_module, "verify_ragged", counted)
    requests = [Request(prompts[0], other, max_new_tokens=10, eos_token_ids=[], gamma=3),
                Request(prompts[1], same, sampler, max_new_tokens=10, eos_token_ids=[], gamma=3, seed=5),
                Request(prompts[2], None, sampler, max_new_tokens=10, eos_token_ids=[], seed=6),
                Request(prompts[3], other, sampler, max_new_tokens=10, eos_token_ids=[], gamma=3),  # unseeded
                Request(prompts[4], lambda: make_tree_drafter("sides", other), max_new_tokens=10, eos_token_ids=[])]
    engine = Engine(target, max_batch=5)
    ids = [engine.add(r) for r in requests]
    seen, steps = _recorded(engine), 0
    while engine.busy:
        engine.step()
        steps += 1
    assert len(calls) == steps and max(calls) == 3  # the greedy chain, the seeded chain, the seeded plain one
    greedy = autoregressive_generate(prompts[0], target, max_new_tokens=10, eos_token_ids=[]).tokens
    seeded = speculative_generate(prompts[1], target, same, gamma=3, sampler=sampler, max_new_tokens=10,
                                  eos_token_ids=[], seed=5).tokens
    plain = autoregressive_generate(prompts[2], target, sampler, max_new_tokens=10, eos_token_ids=[], seed=6).tokens
    tree = autoregressive_generate(prompts[4], target, max_new_tokens=10, eos_token_ids=[]).tokens
    assert [seen.finished[ids[i]].tokens for i in (0, 1, 2, 4)] == [greedy, seeded, plain, tree]


def test_steps_stream_each_requests_tokens_and_admission_waits_at_max_batch(pair):
    target, same, _ = pair
    prompts = _prompts()
    engine = Engine(target, max_batch=2)
    ids = [engine.add(Request(p, same, max_new_tokens=8, eos_token_ids=[])) for p in prompts]
    streamed, seen = {i: [] for i in ids}, _recorded(engine)
    first = engine.step().emitted
    assert len(engine.scheduler.running) == 2 and len(engine.waiting) == 3 and set(first) == set(ids[:2])
    for i, tokens in first.items():
        streamed[i] += tokens
    while engine.busy:
        assert len(engine.scheduler.running) <= 2
        for i, tokens in engine.step().emitted.items():
            streamed[i] += tokens
    assert all(streamed[i] == seen.finished[i].tokens for i in ids)


def test_a_cancelled_request_frees_its_cache_and_the_others_go_on(pair):
    target, _, other = pair
    prompts = _prompts()
    reference = [autoregressive_generate(p, target, max_new_tokens=12, eos_token_ids=[]).tokens for p in prompts]
    engine = Engine(target, max_batch=5)
    ids = [engine.add(Request(p, other, max_new_tokens=12, eos_token_ids=[])) for p in prompts]
    engine.step()
    decoding = engine.scheduler.running[ids[2]]
    assert decoding.cache is not None
    assert engine.cancel(ids[2]) and ids[2] not in engine.scheduler.running and decoding.cache is None
    assert not engine.cancel(ids[2])  # gone
    results = engine.run()
    assert ids[2] not in results
    assert [results[i].tokens for i in ids if i != ids[2]] == [r for i, r in zip(ids, reference) if i != ids[2]]


def test_nan_logits_of_one_sequence_in_a_batched_pass_end_it_alone(pair, monkeypatch):
    """The batched greedy argmax (`samplers.greedy_rows`, one copy to the host a step) finds one
    sequence's NaN rows and ends that request alone, the others exact."""
    from specdec.errors import ModelFault

    target, _, _ = pair
    prompts = _prompts()
    reference = [autoregressive_generate(p, target, max_new_tokens=8, eos_token_ids=[]).tokens for p in prompts]
    forward_batch = type(target).forward_batch

    def failing(self, segments):  # the second prompt's sequence gets NaN logits on its second step
        victim = engine.scheduler.running.get(ids[1])
        broken = victim is not None and victim.stats.target_passes >= 1
        return [rows * float("nan") if broken and s.cache is victim.cache else rows
                for s, rows in zip(segments, forward_batch(self, segments))]

    monkeypatch.setattr(type(target), "forward_batch", failing)
    engine = Engine(target, max_batch=5)
    ids = [engine.add(Request(p, max_new_tokens=8, eos_token_ids=[])) for p in prompts]
    seen = _recorded(engine)
    with pytest.raises(ModelFault, match="NaN"):
        engine.run()
    assert list(seen.failed) == [ids[1]]
    assert [seen.finished[i].tokens for i in ids if i != ids[1]] == [r for i, r in zip(ids, reference) if i != ids[1]]


def test_a_drafter_that_raises_ends_its_request_alone(pair):
    """A bug in one request's drafter (here its third proposal raises) ends that request alone;
    the others, drafting in the same steps, finish exactly; `run` raises it once they have."""
    target, _, _ = pair
    prompts = _prompts()
    reference = [autoregressive_generate(p, target, max_new_tokens=10, eos_token_ids=[]).tokens for p in prompts]

    class Failing(LookupDrafter):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def propose(self, *args, **kwargs):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("a drafter bug")
            return super().propose(*args, **kwargs)

    engine = Engine(target, max_batch=5, steer=False)
    ids = [engine.add(Request(p, Failing if i == 3 else LookupDrafter, max_new_tokens=10, eos_token_ids=[]))
           for i, p in enumerate(prompts)]
    seen = _recorded(engine)
    with pytest.raises(RuntimeError, match="a drafter bug"):
        engine.run()
    assert list(seen.failed) == [ids[3]] and not engine.busy and not engine.scheduler.reserved
    assert [seen.finished[i].tokens for i in ids if i != ids[3]] == [r for i, r in zip(ids, reference) if i != ids[3]]


def test_a_failed_batched_drafter_pass_is_made_again_one_sequence_at_a_time(pair, monkeypatch):
    target, _, other = pair
    prompts = _prompts()
    reference = [autoregressive_generate(p, target, max_new_tokens=10, eos_token_ids=[]).tokens for p in prompts]
    batched, calls = other.forward_batch, []

    def failing_once(segments):  # the pass breaks after writing into the caches, as a real fault may
        calls.append(len(segments))
        out = batched(segments)
        if len(calls) == 2:
            raise RuntimeError("device fault")
        return out

    monkeypatch.setattr(other, "forward_batch", failing_once)
    results = generate_many(prompts, target, other, max_batch=5, max_new_tokens=10, eos_token_ids=[], gamma=3)
    assert len(calls) > 2 and calls[1] > 1  # the second batched drafter pass failed; later ones ran
    assert [r.tokens for r in results] == reference


def test_a_requests_own_error_ends_it_alone_and_run_raises_it_after_the_others(pair, monkeypatch):
    from specdec.decoding.sequence import Decoding

    target, _, other = pair
    prompts = _prompts()
    reference = [autoregressive_generate(p, target, max_new_tokens=8, eos_token_ids=[]).tokens for p in prompts]
    commit = Decoding.apply

    def failing(self, logits, seconds, decided=None, timed=True):  # the third prompt's sequence fails on its second step
        if self.sequence[:len(prompts[2])] == prompts[2] and self.stats.target_passes >= 1:
            raise SpecdecError("model produced NaN logits")
        return commit(self, logits, seconds, decided, timed)

    monkeypatch.setattr(Decoding, "apply", failing)
    engine = Engine(target, max_batch=5)
    ids = [engine.add(Request(p, other, max_new_tokens=8, eos_token_ids=[])) for p in prompts]
    seen = _recorded(engine)
    with pytest.raises(SpecdecError, match="NaN"):
        engine.run()
    assert list(seen.failed) == [ids[2]] and not engine.busy and not engine.scheduler.reserved
    assert [seen.finished[i].tokens for i in ids if i != ids[2]] == [r for i, r in zip(ids, reference) if i != ids[2]]


def test_a_finished_request_lets_its_cache_go(pair):
    target, _, _ = pair
    engine = Engine(target, max_batch=2)
    short, long = engine.add(Request(_prompts()[0], max_new_tokens=2)), engine.add(Request(_prompts()[1], max_new_tokens=6))
    engine.step()
    finished = engine.step().finished
    assert short in finished and short not in engine.scheduler.running and long in engine.scheduler.running


@pytest.mark.slow
def test_batched_sampling_follows_the_target_law():
    """Many unseeded-looking (distinct seeds) sampled sequences, 16 per pass, drafted by another
    model: the joint law of their first four tokens is the target's (chi-square)."""
    target = tiny_model(0, vocab=4, name="tiny-target", exact_rows=True)
    drafter = tiny_model(1, vocab=4, layers=1, name="tiny-drafter", exact_rows=True)  # its passes batched too
    prompt, length, runs = [2, 3, 1], 4, 600

    class Reference:  # cache-free conditionals of the target
        def next_probs(self, context, sampler):
            return sampler.probs(target.forward(context, None, 1)[-1])

    sampler = Sampler(1.0)
    joint = exact_joint(Reference(), prompt, length, sampler)
    results = generate_many([prompt], target, drafter, max_batch=16, samples=runs, seeds=list(range(runs)),
                            seed_rule="stream",
                            sampler=sampler, max_new_tokens=length, eos_token_ids=[], gamma=3)
    samples = [tuple(r.tokens) for r in results]
    assert sum(s.num_accepted < len(s.draft_tokens) for r in results for s in r.steps) > runs  # rejections happened
    assert chi_square_pvalue(samples, joint) > ALPHA


@pytest.mark.parametrize("method", ["chain", "sides", "mixed"])
def test_sequences_sharing_a_drafter_model_draft_in_one_pass_per_round(pair, method):
    """The drafter model's passes, a chain's or a tree's, are batched across sequences (lock step),
    and every output is still its AR alone."""
    target, _, other = pair
    prompts = _prompts()
    widths = []
    batched = other.forward_batch

    def counting(segments):
        widths.append(len(segments))
        return batched(segments)

    # unsteered, a tree in its warm-up drafts at every step
    tree = {"sides": SidesDrafter, "mixed": MixedDrafter}.get(method)
    drafter = other if tree is None else lambda: tree(other, policy=TreeCost(warmup=10**9, max_nodes=8))
    other.forward_batch = counting
    try:
        reference = [autoregressive_generate(p, target, max_new_tokens=10, eos_token_ids=[]).tokens for p in prompts]
        engine = Engine(target, max_batch=5, steer=False)
        ids = [engine.add(Request(p, drafter, max_new_tokens=10, eos_token_ids=[], gamma=3)) for p in prompts]
        results = engine.run()
        assert [results[i].tokens for i in ids] == reference
        assert widths and max(widths) == 5
    finally:
        del other.forward_batch


def test_an_int8_drafter_batches_only_where_its_rounding_cannot_change_an_output(pair):
    """An int8 drafter rounds a row otherwise in a wide pass than alone: greedy and seeded
    (coupled) sequences still share its passes (their outputs do not hang on draft values) and
    equal the seeded AR output; one seeded under the "stream" rule drafts alone, and equals the
    same seed's run alone."""
    from specdec import TransformersModel
    from specdec.backends.kernels import int8_supported

    target, _, other = pair
    if not int8_supported(torch.device("cpu")) or target.device.type != "cpu":
        pytest.skip("no int8 kernel on this CPU, or models on CUDA")
    int8 = TransformersModel(copy.deepcopy(other.hf), None, "int8-drafter", role="drafter", exact_rows=True, int8=True)
    assert not int8.rows_invariant and other.rows_invariant
    prompts, sampler, seeds = _prompts(), Sampler(temperature=1.0, top_k=50), [21, 22, 23, 24, 25]
    widths = []
    batched = int8.forward_batch
    int8.forward_batch = lambda segments: widths.append(len(segments)) or batched(segments)
    reference = [autoregressive_generate(p, target, max_new_tokens=10, eos_token_ids=[]).tokens for p in prompts]
    greedy = generate_many(prompts, target, int8, max_batch=5, max_new_tokens=10, eos_token_ids=[], gamma=3)
    assert [r.tokens for r in greedy] == reference and max(widths) == 5
    widths.clear()
    coupled = generate_many(prompts, target, int8, max_batch=5, seeds=seeds, sampler=sampler, max_new_tokens=10,
                            eos_token_ids=[], gamma=3)
    assert max(widths) == 5
    for prompt, seed, result in zip(prompts, seeds, coupled):
        ar = autoregressive_generate(prompt, target, sampler, max_new_tokens=10, eos_token_ids=[], seed=seed)
        assert result.tokens == ar.tokens
    widths.clear()
    seeded = generate_many(prompts, target, int8, max_batch=5, seeds=seeds, sampler=sampler, max_new_tokens=10,
                           eos_token_ids=[], gamma=3, seed_rule="stream")
    assert not widths  # each stream-seeded sequence drafted alone
    for prompt, seed, result in zip(prompts, seeds, seeded):
        alone = speculative_generate(prompt, target, int8, gamma=3, sampler=sampler, max_new_tokens=10,
                                     eos_token_ids=[], seed=seed, seed_rule="stream")
        assert result.tokens == alone.tokens


def test_a_long_prompt_is_fed_a_chunk_a_step_while_the_others_decode(pair, monkeypatch):
    import specdec.decoding.loop

    monkeypatch.setattr(specdec.decoding.sequence, "PREFILL_CHUNK", 8)
    target, same, _ = pair
    short, long = _ids(5, VOCAB, 40), _ids(41, VOCAB, 41)
    reference = [autoregressive_generate(p, target, max_new_tokens=12, eos_token_ids=[]).tokens for p in (short, long)]
    engine = Engine(target, max_batch=2)
    first = engine.add(Request(short, None, max_new_tokens=12, eos_token_ids=[]))  # a token a step
    engine.step()
    second = engine.add(Request(long, same, max_new_tokens=12, eos_token_ids=[]))
    chunks = 0
    while second not in engine.scheduler.running:
        emitted = engine.step().emitted
        chunks += 1
        assert emitted.get(first), "the running sequence stalled while a prompt was fed"
    assert chunks == 5  # 40 tokens before the last, 8 a step
    results = engine.run()
    assert [results[first].tokens, results[second].tokens] == reference


def test_prompts_ride_in_the_running_sequences_pass_one_target_pass_a_step(pair):
    """Prompts that come while others run are fed in the pass that scores the running sequences
    (`prefill_batch` with segments): one target pass a step, none of the prompts' own, and every
    output the same as alone: greedy ones AR's, a seeded sampled one the same seed's alone. A long
    prompt rides too where its chunks may share a pass (`shared_chunks`), else it is fed alone."""
    target, same, _ = pair
    if not target.shared_prefill:
        pytest.skip("our attention kernel is not built here: prompts are fed alone")
    sampler = Sampler(temperature=1.0, top_k=50)
    first, short, drafted, sampled = (_ids(n, VOCAB, 50 + n) for n in (5, 9, 30, 17))
    long = _ids(300, VOCAB, 60)  # two chunks: the first rides and leaves it prefilling
    reference = [autoregressive_generate(p, target, max_new_tokens=10, eos_token_ids=[]).tokens
                 for p in (first, short, drafted, long)]
    seeded = autoregressive_generate(sampled, target, sampler, max_new_tokens=10, eos_token_ids=[], seed=7).tokens
    passes, prefill_batch, forward_batch, prefill = [], target.prefill_batch, target.forward_batch, target.prefill

    def spy(name, call):
        def counted(*args, **kwargs):
            passes.append(name)
            return call(*args, **kwargs)
        return counted

    target.prefill_batch, target.forward_batch = spy("prefill_batch", prefill_batch), spy("forward_batch", forward_batch)
    target.prefill = spy("prefill", prefill)
    try:
        engine = Engine(target, max_batch=8)
        ids = [engine.add(Request(first, None, max_new_tokens=10, eos_token_ids=[]))]
        engine.step()
        ids += [engine.add(Request(short, None, max_new_tokens=10, eos_token_ids=[])),
                engine.add(Request(drafted, same, max_new_tokens=10, eos_token_ids=[])),
                engine.add(Request(long, None, max_new_tokens=10, eos_token_ids=[])),
                engine.add(Request(sampled, None, sampler, max_new_tokens=10, eos_token_ids=[], seed=7))]
        finished, rode = {}, 0
        while engine.busy:
            passes.clear()
            out = engine.step()
            finished.update(out.finished)
            alone = passes.count("prefill")
            assert len(passes) - alone == 1, passes  # the prompts rode in the scoring pass
            assert alone <= (0 if target.shared_chunks else 1), passes  # a long prompt's own chunk
            rode += passes == ["prefill_batch"]
    finally:
        target.prefill_batch, target.forward_batch, target.prefill = prefill_batch, forward_batch, prefill
    assert rode >= (2 if target.shared_chunks else 1)  # the long prompt's chunks rode a step each
    assert [finished[i].tokens for i in ids[:4]] == reference and finished[ids[4]].tokens == seeded


def test_admission_waits_at_the_kv_memory_budget(pair):
    target, same, _ = pair
    prompts = _prompts()
    per_token = target.kv_bytes_per_token + same.kv_bytes_per_token
    room = (len(prompts[-1]) + 8 + 64) * per_token  # the longest prompt's need, drafts included
    engine = Engine(target, max_batch=5, kv_memory=2 * room)
    ids = [engine.add(Request(p, same, max_new_tokens=8, eos_token_ids=[])) for p in prompts]
    most, seen = 0, _recorded(engine)
    while engine.busy:
        engine.step()
        most = max(most, len(engine.scheduler.running))
        assert sum(engine.scheduler.reserved.values()) <= 2 * room
    assert most == 2 and set(seen.finished) == set(ids) and not seen.failed  # every request ran, none failed
    with pytest.raises(SpecdecError, match="more than the whole budget"):
        Engine(target, kv_memory=room // 2).add(Request(prompts[-1], same, max_new_tokens=8))


def test_engine_errors_are_clear(pair):
    target = pair[0]
    with pytest.raises(SpecdecError, match="max_batch"):
        Engine(target, max_batch=0)
    with pytest.raises(SpecdecError, match="row-exact"):
        Engine(tiny_model(0, exact_rows=False))
    engine = Engine(target)
    with pytest.raises(SpecdecError, match="empty prompt"):
        engine.add(Request([]))
    with pytest.raises(SpecdecError, match="holds one sequence's state"):
        engine.add(Request([1, 2], LookupDrafter()))  # one object shared by every request would mix their states
    with pytest.raises(SpecdecError, match="samples"):
        generate_many([[1]], target, samples=0)
    with pytest.raises(SpecdecError, match="one per generated sequence"):
        generate_many([[1], [2]], target, seeds=[1])


def test_a_failed_batched_pass_is_retried_one_sequence_at_a_time_and_only_a_repeat_offender_ends():
    """Where the target's batched pass fails, each sequence is scored again alone from its cache as
    it was: outputs stay the AR outputs token for token; a sequence whose own pass fails again
    ends alone, the others go on. Without the retry every sequence of the step would end."""
    target = tiny_model(0, vocab=32, exact_rows=True)
    drafter = tiny_model(1, vocab=32, layers=1, exact_rows=True)
    prompts = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14], [15, 16]]
    expected = [autoregressive_generate(p, target, max_new_tokens=12, eos_token_ids=[]).tokens for p in prompts]
    batch, alone, calls = target.forward_batch, target.forward, [0]

    def flaky(segments):  # every third batched pass fails, after writing part of its rows
        calls[0] += 1
        if calls[0] % 3 == 0:
            batch(segments[:1])
            raise RuntimeError("injected pass fault")
        return batch(segments)

    def poisoned(input_ids, cache, *args, **kwargs):  # the sequence holding id 15 fails whenever alone
        if cache is poisoned.cache:
            raise RuntimeError("its own fault")
        return alone(input_ids, cache, *args, **kwargs)

    target.forward_batch, target.forward = flaky, poisoned
    poisoned.cache = None
    engine = Engine(target, max_batch=4)
    ids = [engine.add(Request(p, drafter, max_new_tokens=12, eos_token_ids=[])) for p in prompts]
    seen = _recorded(engine)
    engine.step()  # admits and prefills all four
    poisoned.cache = engine.scheduler.running[ids[3]].cache
    while engine.busy:
        engine.step()
    assert calls[0] >= 3  # the fault fired
    assert [seen.finished[i].tokens for i in ids[:3]] == expected[:3]
    assert ids[3] not in seen.finished and "its own fault" in str(seen.failed[ids[3]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_prompt_shares_prompt_passes_by_its_length_where_the_target_lets_it(dtype):
    """`Decoding.shares_prefill`: a prompt of at most `shared_prefill` ids until it is in; a longer
    one only where its chunks may share (`shared_chunks`); none on a target without row-exact passes."""
    from specdec.decoding.sequence import Decoding

    model = qwen_like(dtype, exact_rows=True, vocab=512)
    limit = model.shared_prefill
    if not limit:
        pytest.skip("our attention kernel is not built here: prompts are fed alone")
    short, long = Decoding(_ids(limit, 512, 1), model), Decoding(_ids(limit + 1, 512, 2), model)
    for decoding in (short, long):
        decoding.begin()
    assert short.shares_prefill and long.shares_prefill == model.shared_chunks
    assert short.prefill_step() and not short.shares_prefill  # in: nothing left to share
    plain = Decoding(_ids(5, 512, 3), qwen_like(dtype, exact_rows=False, vocab=512))
    plain.begin()
    assert not plain.shares_prefill


def test_prompts_riding_in_a_pass_that_fails_are_fed_alone_and_every_output_stays_exact():
    """Where the pass the prompts ride in fails part way (every cache of the pass grown in its first
    layer only), the running sequences are scored again alone and each prompt fed alone, every cache
    first put back as it was, layer by layer."""
    target = tiny_model(0, vocab=32, exact_rows=True)
    if not target.shared_prefill:
        pytest.skip("our attention kernel is not built here: prompts are fed alone")
    prompts = [[3, 4, 5, 6], [7, 8, 9, 10, 11], [12, 13]]
    expected = [autoregressive_generate(p, target, max_new_tokens=8, eos_token_ids=[]).tokens for p in prompts]
    prefill_batch, faults = target.prefill_batch, []

    def failing(riding, segments=()):
        if segments and not faults:  # the first pass with prompts riding breaks after its first layer
            caches = [cache for _, cache in riding] + [s.cache for s in segments]
            before = [c.get_seq_length() for c in caches]
            faults.append(len(riding))
            prefill_batch(riding, segments)
            for cache, length in zip(caches, before):
                for layer in cache.layers[1:]:
                    layer.crop(length - layer.get_seq_length())
            raise RuntimeError("injected pass fault")
        return prefill_batch(riding, segments)

    target.prefill_batch = failing
    engine = Engine(target, max_batch=4)
    ids = [engine.add(Request(prompts[0], None, max_new_tokens=8, eos_token_ids=[]))]
    seen = _recorded(engine)
    engine.step()
    ids += [engine.add(Request(p, None, max_new_tokens=8, eos_token_ids=[])) for p in prompts[1:]]
    while engine.busy:
        engine.step()
    assert faults == [2] and not seen.failed
    assert [seen.finished[i].tokens for i in ids] == expected


def test_generate_many_takes_the_machines_batched_pass_costs(pair):
    """With a profile in which no draft can pay at any batch size (drafter rounds dearer than the
    target's pass), `generate_many` decodes plainly from the first step; without it, the same
    run drafts to learn that. The outputs are AR's either way."""
    from specdec.sizing.pass_costs import LoadCosts
    from specdec.sizing.schedules import CostAware

    target, same, _ = pair
    prompts = _prompts()
    reference = [autoregressive_generate(p, target, max_new_tokens=10, eos_token_ids=[]).tokens for p in prompts]
    dear = LoadCosts({(b, r): 0.01 * b * r for b in (1, 2, 4) for r in (1, 2, 4)}, {b: 1.0 for b in (1, 2, 4)})
    drafted = {}
    for profile in (None, dear):
        results = generate_many(prompts, target, same, max_batch=5, max_new_tokens=10, eos_token_ids=[],
                                schedule=CostAware, load_costs=profile)
        assert [r.tokens for r in results] == reference
        drafted[profile is None] = sum(r.stats.drafted for r in results)
    assert drafted[True] > 0 and drafted[False] == 0
