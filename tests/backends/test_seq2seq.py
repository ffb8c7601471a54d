"""Encoder-decoder targets (T5, BART): the encoder once, drafts and verification on the decoders."""

import copy

import pytest
import torch

from specdec import Sampler, Seq2SeqModel, SpecdecError, speculative_generate, speculative_generate_encoder_decoder
from specdec.drafters import LookupDrafter, make_tree_drafter

from test_sampling_exactness import ALPHA, chi_square_pvalue, exact_joint


def tiny_t5(seed: int, vocab: int = 24, layers: int = 2, factor: float = 20.0) -> Seq2SeqModel:
    """A random T5 with large initial weights (`initializer_factor`), so that its outputs depend on
    the source and the prefix rather than repeating one token from the start."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_decoder_layers=layers,
                      num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0,
                      pad_token_id=0, eos_token_id=1, tie_word_embeddings=False, initializer_factor=factor)
    return Seq2SeqModel(T5ForConditionalGeneration(config), name=f"t5-{seed}")


def tiny_bart(seed: int, vocab: int = 24) -> Seq2SeqModel:
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(seed)
    config = BartConfig(vocab_size=vocab, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128,
                        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, dropout=0.0,
                        attention_dropout=0.0, activation_dropout=0.0, forced_eos_token_id=None, init_std=1.0)
    return Seq2SeqModel(BartForConditionalGeneration(config), name=f"bart-{seed}")


def _near_copy(model: Seq2SeqModel, noise: float, seed: int = 7) -> Seq2SeqModel:
    """A drafter that agrees with `model` often but not always: its copy with noise on the head."""
    hf = copy.deepcopy(model.hf)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head = hf.get_output_embeddings().weight
        head.add_(noise * torch.randn(head.shape, generator=generator))
    return Seq2SeqModel(hf, name=model.name + "-near")


SOURCES = [[5, 9, 3, 12, 7, 1], [4, 4, 8, 15, 16, 23, 2, 1], [11, 1]]


def _hf_greedy(model: Seq2SeqModel, source: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([source])
    with torch.inference_mode():
        out = model.hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, num_beams=1, min_length=0)
    tokens = out[0, 1:].tolist()  # after the decoder's start token
    cut = next((i + 1 for i, t in enumerate(tokens) if t in model.eos_token_ids), len(tokens))
    return tokens[:cut]


def test_the_bound_decoder_decodes_as_transformers_generate_does():
    target = tiny_t5(0)
    for source in SOURCES:
        ours = speculative_generate_encoder_decoder(source, target, max_new_tokens=20)
        assert ours.tokens == _hf_greedy(target, source, 20)


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_greedy_speculative_decoding_equals_greedy_ar_on_tiny_encoder_decoders(family):
    target = tiny_t5(0) if family == "t5" else tiny_bart(0)
    drafters = [_near_copy(target, 0.3), tiny_t5(1, layers=1) if family == "t5" else tiny_bart(1), LookupDrafter()]
    accepted = rejected = 0
    for source in SOURCES:
        expected = speculative_generate_encoder_decoder(source, target, max_new_tokens=30, eos_token_ids=[]).tokens
        assert len(expected) == 30
        for drafter in drafters:
            out = speculative_generate_encoder_decoder(source, target, drafter, gamma=4, max_new_tokens=30,
                                                       eos_token_ids=[])
            assert out.tokens == expected, (drafter, source)
            accepted += out.stats.accepted
            rejected += out.stats.drafted - out.stats.accepted
    assert accepted > 20 and rejected > 5  # the caches were rolled back after rejections and kept after acceptances


class _Law:
    """The target's next-token law over decoder prefixes, computed without a cache (the reference)."""

    def __init__(self, bound):
        self.bound = bound

    def next_probs(self, context, sampler):
        return sampler.probs(self.bound.forward(context, None, 1)[-1])


@pytest.mark.parametrize("bug", [False, True], ids=["exact", "drafts-always-kept"])
@pytest.mark.slow
def test_sampled_speculative_decoding_follows_the_target_law(bug):
    """The joint law of the first 3 decoder tokens against the enumerated law (chi-square, 1e-4);
    drafts kept whatever the target says (lenience near 0) fail the same test (its power)."""
    target = tiny_t5(0, vocab=5, layers=1, factor=0.3)  # laws well spread over 5 ids
    drafter = tiny_t5(3, vocab=5, layers=1, factor=0.3)
    source, sampler, length, runs = [3, 2, 4], Sampler(1.5), 3, 3000
    bound_target, bound_drafter = target.bind(source), drafter.bind(source)
    prompt = [target.decoder_start_token_id]
    joint = exact_joint(_Law(bound_target), prompt, length, sampler)
    samples, rejected = [], 0
    for seed in range(runs):
        out = speculative_generate(prompt, bound_target, bound_drafter, gamma=3, sampler=sampler,
                                   max_new_tokens=length, eos_token_ids=[], seed=seed,
                                   seed_rule="stream", first_target=False,
                                   lenience=1e-6 if bug else 1.0)
        samples.append(tuple(out.tokens))
        rejected += out.stats.drafted - out.stats.accepted
    assert rejected > runs // 5 or bug  # rejections (and so rollbacks) happened
    pvalue = chi_square_pvalue(samples, joint)
    assert pvalue < ALPHA if bug else pvalue > ALPHA


def test_encoder_decoder_errors_are_clear():
    target = tiny_t5(0)
    with pytest.raises(SpecdecError, match="must be an encoder-decoder model"):
        speculative_generate_encoder_decoder([3], object())
    with pytest.raises(SpecdecError, match="source text encodes to no tokens"):
        speculative_generate_encoder_decoder([], target)
    with pytest.raises(SpecdecError, match="source ids must lie in"):
        speculative_generate_encoder_decoder([3, 99], target)
    with pytest.raises(SpecdecError, match="decoder starts with id 2"):
        speculative_generate_encoder_decoder([3], target, tiny_bart(1))
    with pytest.raises(SpecdecError, match="token trees are not supported"):
        speculative_generate_encoder_decoder([3], target, make_tree_drafter("lookup"))
    with pytest.raises(SpecdecError, match="vocabularies differ"):
        speculative_generate_encoder_decoder([3], target, tiny_t5(1, vocab=30))


def _saved_t5(directory) -> Seq2SeqModel:
    """A tiny T5 saved as a Hugging Face directory, with a word-level tokenizer (w3 .. w23)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, 24)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    model = tiny_t5(0)
    model.hf.save_pretrained(directory)
    fast.save_pretrained(directory)
    return model


def test_a_saved_encoder_decoder_loads_with_its_tokenizer_and_load_points_to_it(tmp_path):
    from specdec import load
    from specdec.models.loading import load_seq2seq

    original = _saved_t5(tmp_path)
    loaded = load_seq2seq(tmp_path)
    source = loaded.encode("w5 w9 w3 w12")
    assert source == [5, 9, 3, 12]
    out = speculative_generate_encoder_decoder(source, loaded, loaded, max_new_tokens=10)
    assert out.tokens == speculative_generate_encoder_decoder(source, original, max_new_tokens=10).tokens
    assert loaded.decode(out.tokens).split() == [f"w{t}" for t in out.tokens if t >= 3]
    with pytest.raises(SpecdecError, match="encoder-decoder model .*load_seq2seq"):
        load(str(tmp_path))
    with pytest.raises(SpecdecError, match="no config.json"):
        load_seq2seq(tmp_path / "nowhere")


def test_generate_runs_an_encoder_decoder_target_from_the_command_line(tmp_path):
    import json

    from typer.testing import CliRunner

    from specdec.cli import app

    _saved_t5(tmp_path / "t5")
    common = ["generate", "w5 w9 w3 w12", "--target", str(tmp_path / "t5"), "--max-new-tokens", "12", "--json"]
    runner = CliRunner()
    outputs = {}
    for name, extra in [("ar", ["--method", "ar"]), ("self", ["--drafter", str(tmp_path / "t5")]),
                        ("lookup", ["--drafter", "lookup"])]:
        result = runner.invoke(app, common + extra)
        assert result.exit_code == 0, result.output
        outputs[name] = json.loads(result.stdout.strip().splitlines()[-1])
    assert outputs["ar"]["tokens"] == outputs["self"]["tokens"] == outputs["lookup"]["tokens"]
    assert outputs["self"]["stats"]["accepted"] > 0  # the target drafting for itself: drafts were accepted
    for extra, message in [(["--tree", "lookup"], "chain drafts"), (["--drafter", "qwen2.5-coder-0.5b"],
                                                                     "or not at all (--method ar)")]:
        result = runner.invoke(app, common + extra)
        assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output
