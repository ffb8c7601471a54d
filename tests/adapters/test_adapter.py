"""Drafter distillation (adapters/lora.py, training/fit_distilled.py): the divergences, the adapter, offline and online training,
and that a distilled drafter leaves the output exact."""

import pytest
import torch

from specdec import Sampler, autoregressive_generate, speculative_generate
from specdec.adapters.lora import (DraftAdapter, OnlineDistiller, adapted_layers, agreement, attach, divergence, hooked,
                                   load_adapter, load_distilled)
from specdec.training.fit_distilled import DistillConfig, distill_drafter
from specdec.drafters import ModelDrafter
from specdec.errors import SpecdecError

from conftest import tiny_model
from test_sampling_exactness import ALPHA, REAL_PROMPT, REAL_RUNS, _real_joint, chi_square_pvalue


def _laws(n=5, v=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(n, v, generator=g) * 2, -1)
    logits = torch.randn(n, v, generator=g) * 2
    return p, logits


def test_tvd_over_every_id_is_one_minus_the_acceptance_rate():
    p, logits = _laws()
    q = torch.softmax(logits, -1)
    top_probs, top_ids = p.topk(p.shape[-1], dim=-1)
    got = divergence(logits, top_ids, top_probs, "tvd")
    assert torch.allclose(got, 0.5 * (p - q).abs().sum(-1), atol=1e-6)
    assert torch.allclose(1 - got, torch.minimum(p, q).sum(-1), atol=1e-6)


def test_tvd_keeps_the_rest_of_the_mass_and_unscored_ids_have_q_zero():
    p, logits = _laws(n=1, v=4)
    q = torch.softmax(logits, -1)[0]
    ids = torch.tensor([[2, 0]])  # the target's top two ids; the drafter scores id 2 at place 3, not id 0
    slots = torch.tensor([[3, -1]])
    top = p[0, [2, 0]].view(1, 2)
    want = 0.5 * ((top[0, 0] - q[3]).abs() + top[0, 1] + ((1 - top.sum()) - (1 - q[3])).abs())
    assert torch.allclose(divergence(logits, slots, top, "tvd"), want.view(1), atol=1e-6)
    assert ids.shape == slots.shape


def test_fkl_is_the_cross_entropy_against_p_renormalised_over_its_top_ids():
    p, logits = _laws(n=3, v=6)
    top_probs, top_ids = p.topk(3, dim=-1)
    renormalised = top_probs / top_probs.sum(-1, keepdim=True)
    want = -(renormalised * torch.log_softmax(logits, -1).gather(-1, top_ids)).sum(-1)
    assert torch.allclose(divergence(logits, top_ids, top_probs, "fkl"), want, atol=1e-6)
    with pytest.raises(SpecdecError, match="unknown divergence"):
        divergence(logits, top_ids, top_probs, "kl")


def test_agreement_compares_the_greedy_tokens():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    assert agreement(logits, torch.tensor([[1, 0], [2, 0]])).tolist() == [True, False]


def _drafter(seed=1, vocab=64):
    return tiny_model(seed, vocab=vocab, layers=1, role="drafter")


def _perturbed(model, scale=0.5, seed=0) -> DraftAdapter:
    torch.manual_seed(seed)
    adapter = DraftAdapter(adapted_layers(model), 4)
    with torch.no_grad():
        for b in adapter.b.values():
            b.copy_(torch.randn(b.shape) * scale)
    return adapter.to(model.device)


def test_an_untrained_adapter_leaves_the_drafters_logits_bit_for_bit():
    drafter = _drafter()
    ids = [3, 5, 7, 9]
    plain = drafter.forward(ids, None, num_logits=4)
    attach(drafter, DraftAdapter(adapted_layers(drafter), 8))
    assert torch.equal(drafter.forward(ids, None, num_logits=4), plain)
    attach(drafter, _perturbed(drafter))
    assert not torch.allclose(drafter.forward(ids, None, num_logits=4), plain)
    attach(drafter, None)
    assert torch.equal(drafter.forward(ids, None, num_logits=4), plain)


def test_the_merged_adapter_computes_what_its_training_hooks_compute():
    drafter, adapter = _drafter(), _perturbed(_drafter())
    ids = torch.tensor([[3, 5, 7, 9, 11]], device=drafter.device)
    with torch.no_grad(), hooked(drafter, adapter):
        trained = drafter._decoder(input_ids=ids, use_cache=False).last_hidden_state
    attach(drafter, adapter)
    with torch.no_grad():
        merged = drafter._decoder(input_ids=ids, use_cache=False).last_hidden_state
        assert torch.allclose(merged, trained, atol=1e-4)
        other = _perturbed(drafter, seed=1)  # hooks over a merged adapter compute as if `other` were merged alone
        with hooked(drafter, other):
            over = drafter._decoder(input_ids=ids, use_cache=False).last_hidden_state
        attach(drafter, other)
        assert torch.allclose(drafter._decoder(input_ids=ids, use_cache=False).last_hidden_state, over, atol=1e-4)
    plain = _drafter()
    with torch.no_grad():
        assert not torch.allclose(plain._decoder(input_ids=ids, use_cache=False).last_hidden_state, trained, atol=1e-2)


def test_an_adapter_attaches_to_drafters_of_its_shapes_only():
    target = tiny_model(0, vocab=64)
    with pytest.raises(SpecdecError, match="attaches to a drafter"):
        attach(target, _perturbed(_drafter()))
    two_layers = tiny_model(1, vocab=64, layers=2, role="drafter")
    with pytest.raises(SpecdecError, match="other layers"):
        attach(two_layers, _perturbed(_drafter()))


@pytest.mark.parametrize("loss", ["tvd", "fkl"])
def test_distillation_raises_held_out_acceptance_and_saves_a_checkpoint(tmp_path, loss):
    target, drafter = tiny_model(0, vocab=64), _drafter()
    ids = torch.randint(0, 64, (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    config = DistillConfig(tokens=1500, context=16, continuation=16, rank=4, epochs=3, batch=4, lr=1e-2, loss=loss)
    made = distill_drafter(target, drafter, ids, tmp_path, config, say=lambda m: None)
    before, after = made.info["heldout_before"], made.info["heldout_after"]
    assert after["acceptance"] > before["acceptance"] + 0.02
    assert after["acceptance_on_policy"] > before["acceptance_on_policy"]
    assert made.info["continuation"] == 16 and made.info["heldout_tokens"] > 0
    assert {p.name for p in tmp_path.iterdir()} == {"adapter.safetensors", "adapter.json"}  # resumption files gone
    assert drafter.adapter is None  # training left the drafter's own weights as they were
    # the checkpoint names its drafter; weights other than the ones it was trained on are refused
    same = load_distilled(tmp_path, lambda name: _drafter())
    assert torch.equal(same.adapter.b[next(iter(same.adapter.b))].cpu(), made.adapter.b[next(iter(made.adapter.b))].cpu())
    assert same.name.endswith("+distilled")
    with pytest.raises(SpecdecError, match="does not have"):
        load_distilled(tmp_path, lambda name: _drafter(seed=2))


def test_distillation_refuses_bad_settings(tmp_path):
    target, drafter = tiny_model(0, vocab=64), _drafter()
    with pytest.raises(SpecdecError, match="rank must be >= 1"):
        distill_drafter(target, drafter, list(range(64)) * 4, tmp_path, DistillConfig(rank=0))
    with pytest.raises(SpecdecError, match="fewer than two contexts"):
        distill_drafter(target, drafter, list(range(20)), tmp_path, DistillConfig(context=16))


def test_a_missing_checkpoint_names_the_command_that_makes_one(tmp_path):
    with pytest.raises(SpecdecError, match="specdec distill-drafter"):
        load_adapter(tmp_path)


def test_a_drafter_distilled_for_another_target_is_refused():
    target, drafter = tiny_model(0, vocab=64), _drafter()
    attach(drafter, _perturbed(drafter))
    drafter.adapter_target = "0" * 64
    with pytest.raises(SpecdecError, match="another target"):
        speculative_generate([3, 4, 5], target, drafter, max_new_tokens=4)


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_output_with_a_distilled_drafter_is_the_targets(gamma):
    target, drafter = tiny_model(0, vocab=64), _drafter()
    attach(drafter, _perturbed(drafter))
    for prompt in ([3, 4, 5], [9, 8, 7, 6, 5]):
        want = autoregressive_generate(prompt, target, max_new_tokens=24).tokens
        assert speculative_generate(prompt, target, drafter, gamma=gamma, max_new_tokens=24).tokens == want


def test_online_distillation_learns_from_rejections_between_requests_and_stays_exact():
    target, drafter = tiny_model(0, vocab=64), _drafter()
    online = OnlineDistiller(drafter, rank=4, steps=4, lr=1e-2, min_records=4)
    assert drafter.online is online and drafter.adapter is None  # nothing merged before the first update
    updates = []
    for seed in range(6):
        prompt = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        want = autoregressive_generate(prompt, target, max_new_tokens=20).tokens
        assert speculative_generate(prompt, target, drafter, gamma=3, max_new_tokens=20).tokens == want
        assert online.pending == {}  # each finished sequence handed its records on
        updates.append(online.update())
    assert online.buffered > 4 and online.updates >= 1
    assert updates[-1]["records"] == online.buffered and updates[-1]["loss"] == updates[-1]["loss"]
    assert drafter.adapter is not None and any(float(b.abs().sum()) > 0 for b in drafter.adapter.b.values())


def test_online_buffer_keeps_the_newest_positions():
    target, drafter = tiny_model(0, vocab=64), _drafter()
    online = OnlineDistiller(drafter, rank=4, capacity=10, min_records=1)
    for key in range(4):
        for position in (3, 4, 5, 6):
            online.record(key, position, torch.randn(64))
        online.finish(key, list(range(10)))
    assert online.update() is not None
    assert online.buffered == 12  # whole sequences go: the oldest left once the rest held the capacity
    assert online.update() is None  # nothing new


def test_online_distillation_refuses_a_target_model():
    with pytest.raises(SpecdecError, match="attaches to a drafter"):
        OnlineDistiller(tiny_model(0, vocab=64))


@pytest.mark.slow
def test_sampled_output_follows_the_target_law_while_the_drafter_learns_between_requests():
    """The joint law of 4 tokens on test_sampling_exactness's tiny transformer target (its power
    checks use as many runs) with a drafter whose adapter is updated after every 50 generations:
    the law stays the target's (chi-square, 1e-4) although q keeps changing."""
    target, drafter = tiny_model(0, vocab=4, name="tiny-target"), tiny_model(1, vocab=4, layers=1, role="drafter")
    online = OnlineDistiller(drafter, rank=4, steps=2, lr=2e-2, min_records=1)
    wrapped = ModelDrafter(drafter)
    samples, weights = [], []
    for seed in range(REAL_RUNS):
        out = speculative_generate(REAL_PROMPT, target, wrapped, gamma=3, sampler=Sampler(1.0), max_new_tokens=4,
                                   seed=seed, seed_rule="stream", first_target=False, eos_token_ids=[])
        samples.append(tuple(out.tokens))
        if seed % 50 == 49:
            online.update()
            weights.append(torch.cat([b.flatten() for b in drafter.adapter.b.values()]))
    assert online.updates >= 3 and not torch.equal(weights[0], weights[-1])
    assert chi_square_pvalue(samples, _real_joint(target, Sampler(1.0))) > ALPHA


def test_a_distilled_drafter_is_loaded_by_name_and_refused_as_a_target(tmp_path):
    from specdec import load

    with pytest.raises(SpecdecError, match="make one with `specdec distill-drafter`"):
        load(f"distilled:{tmp_path}", role="drafter")
    with pytest.raises(SpecdecError, match="is a drafter"):
        load(f"distilled:{tmp_path}", role="target")
    with pytest.raises(SpecdecError, match="transformers' weights"):
        load(f"distilled:{tmp_path}", dtype="gguf", role="drafter")


def test_gradients_pass_through_every_kind_of_drafter_linear():
    """An adapter trained on a drafter's outputs (online distillation: sequences of a few tokens)
    needs gradients through its int8 layers too, whose short paths have none."""
    from torch import nn

    from specdec.backends.kernels import (Int8Linear, PackedBf16Linear, differentiable_linears, dynamic_int8_supported,
                                         int8_supported, packed_bf16_supported, int8_kernel_supported)

    if not int8_supported(torch.device("cpu")):
        pytest.skip("no CPU int8 kernel in this torch")
    torch.manual_seed(0)
    dense = nn.Linear(64, 32).bfloat16().requires_grad_(False)
    long = PackedBf16Linear(dense.weight, dense.bias) if packed_bf16_supported() else dense
    # torch's weight-only op, fbgemm's, and our kernel (where each runs)
    layers = [Int8Linear(dense.weight, dense.bias, long, short_rows=8, vnni=False)]
    if dynamic_int8_supported():
        layers.append(Int8Linear(dense.weight, dense.bias, long, short_rows=8, dynamic=True, vnni=False))
    if int8_kernel_supported():
        layers.append(Int8Linear(dense.weight, dense.bias, long, short_rows=8, vnni=True))
    for layer in layers:
        model = nn.Sequential(layer)
        x = torch.randn(2, 64, dtype=torch.bfloat16, requires_grad=True)  # 2 rows: the short path outside
        with differentiable_linears(model):
            model(x).float().sum().backward()
        assert x.grad is not None and torch.allclose(x.grad.float(), dense.weight.float().sum(0).expand(2, -1), atol=0.1)
        assert "forward" not in vars(layer)  # the class's own forward again


def test_set_dense_weight_rebuilds_each_kind_of_linear_in_place():
    from torch import nn

    from specdec.backends.kernels import (Int8Linear, PackedLinear, dense_weight, dynamic_int8_supported, int8_supported,
                                         set_dense_weight, int8_kernel_supported)

    torch.manual_seed(0)
    old, new, x = torch.randn(32, 64), torch.randn(32, 64), torch.randn(3, 64)

    def linear(weight):
        layer = nn.Linear(64, 32, bias=False, dtype=weight.dtype)
        layer.weight.data.copy_(weight)
        return layer

    kinds = [linear, lambda w: PackedLinear(w), lambda w: PackedLinear(w.bfloat16(), dense_rows=4)]
    if int8_supported(torch.device("cpu")):
        kinds.append(lambda w: Int8Linear(w.bfloat16(), None, linear(w.bfloat16()), short_rows=8, vnni=False))
    if dynamic_int8_supported():
        kinds.append(lambda w: Int8Linear(w.bfloat16(), None, linear(w.bfloat16()), short_rows=8, dynamic=True,
                                          vnni=False))
        bias = torch.full((32,), 5.0)  # fbgemm packs the bias with the weight: packed anew, it must stay
        kinds.append(lambda w: Int8Linear(w.bfloat16(), bias, linear(w.bfloat16()), short_rows=8, dynamic=True,
                                          vnni=False))
    if int8_kernel_supported():  # our kernel: weights packed anew in its tiles
        kinds.append(lambda w: Int8Linear(w.bfloat16(), None, linear(w.bfloat16()), short_rows=8, vnni=True))
    for made in kinds:
        layer = made(old)
        set_dense_weight(layer, new.to(dense_weight(layer).dtype))
        fresh = made(new)
        with torch.no_grad():
            assert torch.equal(layer(x.to(dense_weight(fresh).dtype)), fresh(x.to(dense_weight(fresh).dtype)))


def test_online_records_rejections_from_the_engines_batched_passes():
    from specdec import Engine, Request

    target = tiny_model(0, vocab=64, exact_rows=True)
    drafter = tiny_model(1, vocab=64, layers=1, role="drafter", exact_rows=True)
    online = OnlineDistiller(drafter, rank=4, min_records=1)
    prompts = [torch.randint(0, 64, (5,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(4)]
    engine = Engine(target, max_batch=4)
    ids = [engine.add(Request(p, drafter, max_new_tokens=12, eos_token_ids=[], gamma=3)) for p in prompts]
    results = engine.run()
    for prompt, request_id in zip(prompts, ids):
        assert results[request_id].tokens == autoregressive_generate(prompt, target, max_new_tokens=12,
                                                                     eos_token_ids=[]).tokens
    assert len(online.buffer) == 4 and online.pending == {}
    assert online.update() is not None and drafter.adapter is not None


def test_the_servers_worker_updates_the_drafter_only_while_no_request_runs():
    import threading

    from specdec import Engine, Request
    from specdec.server.worker import Worker

    target = tiny_model(0, vocab=64, exact_rows=True)
    engine = Engine(target, max_batch=2)
    calls, done = [], threading.Event()

    class Sink:
        def tokens(self, ids, logprobs):
            pass

        def done(self, result):
            done.set()

        def failed(self, error):
            done.set()

    worker = Worker(engine, between=lambda: calls.append(engine.busy))
    worker.start()
    try:
        worker.submit(Request([3, 4, 5], None, max_new_tokens=8, eos_token_ids=[]), Sink())
        assert done.wait(30)
        deadline = 50
        while len(calls) < 2 and deadline:
            threading.Event().wait(0.1)
            deadline -= 1
    finally:
        worker.stop(timeout=10)
    assert calls and not any(calls)  # called, and never while the engine held a request


def test_the_bench_runs_sd_distilled_and_sd_online_on_drafters_of_their_own(tmp_path):
    from specdec.bench.runners import OWN_DRAFTERS, Settings, load_own_drafters, online_summary, run_method

    target = tiny_model(0, vocab=64)
    ids = torch.randint(0, 64, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
    distill_drafter(target, _drafter(), ids, tmp_path, DistillConfig(tokens=600, context=16, continuation=16, rank=4,
                                                                     epochs=1), say=lambda m: None)
    settings = Settings(max_new_tokens=12, distilled=str(tmp_path))
    run_drafter = _drafter()
    load_own_drafters(["sd-distilled", "sd-online"], settings,
                      lambda name: load_distilled(tmp_path, lambda _: _drafter()) if name else _drafter())
    assert OWN_DRAFTERS["sd-distilled"].adapter is not None and OWN_DRAFTERS["sd-online"].online is not None
    prompt = [3, 4, 5, 6]
    want = autoregressive_generate(prompt, target, max_new_tokens=12).tokens
    for _ in range(3):
        for method in ("sd-distilled", "sd-online"):
            record = run_method(method, prompt, target, run_drafter, settings, Sampler(0.0))
            assert record.tokens == want
    assert run_drafter.adapter is None and run_drafter.online is None  # the run's own drafter is untouched
    assert online_summary()["buffered"] > 0
    OWN_DRAFTERS.clear()


def test_the_commands_defaults_are_the_librarys():
    import inspect

    from specdec.cli import distill_drafter_command

    parameters = inspect.signature(distill_drafter_command).parameters
    for name in ("tokens", "context", "continuation", "rank", "loss", "epochs", "batch", "lr", "seed"):
        assert parameters[name].default.default == getattr(DistillConfig(), name), name


def test_generate_prompts_online_runs_them_one_by_one_and_learns_between_them(capsys, monkeypatch):
    import json

    from specdec import cli
    from specdec.decoding.speculation import Parts, build
    from specdec.decoding.config import SpecConfig

    target = tiny_model(0, vocab=64, exact_rows=True)
    drafter = tiny_model(1, vocab=64, layers=1, role="drafter", exact_rows=True)
    monkeypatch.setattr(target, "encode", lambda text, chat=False: [int(t) for t in text.split()])
    monkeypatch.setattr(target, "decode", lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    online = OnlineDistiller(drafter, min_records=1, lr=1e-2)
    prompts = ["3 4 5", "9 8 7 6", "1 2 3", "4 4 4"]
    rows = [{"prompt": p, "sampler": Sampler(0.0), "max_new_tokens": 12} for p in prompts]
    speculation = build(SpecConfig("chain", schedule="fixed"), Parts(target, drafter))
    cli._generate_batch(target, speculation, rows, 1, True, False, online=online)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for prompt, line in zip(prompts, lines):
        ids = [int(t) for t in prompt.split()]
        assert line["tokens"] == autoregressive_generate(ids, target, max_new_tokens=12).tokens
    assert len(lines) == 4 and online.updates >= 1
