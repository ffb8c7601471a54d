"""Any Hugging Face causal LM: sliding-window caches (Mistral, Gemma 2/3), BOS in plain-text prompts,
and drafters whose output head is padded to another width than the target's (one tokenizer)."""

import pytest
import torch

from specdec import TransformersModel, Sampler, SpecdecError, autoregressive_generate, check_pair
from specdec.models import catalogue as registry
from specdec import speculative_generate
from specdec.drafters import ModelDrafter

from test_sampling_exactness import chi_square_pvalue, exact_joint
from specdec.backends.cache import cache_length, crop_cache


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: thousands of tiny ops, each of which can wait on an OpenMP barrier with 2 threads
    on a busy 2-core machine (see test_sampling_exactness.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- sliding-window caches

WINDOW = 8


def _sliding_hf(family: str, seed: int, layers: int, vocab: int = 32):
    """A tiny random model of `family` whose attention (all or some layers) slides over WINDOW keys."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=WINDOW,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    if family == "mistral":
        config, cls = transformers.MistralConfig(**common), transformers.MistralForCausalLM
    elif family == "gemma2":  # alternating sliding / full layers, eager attention, logit soft-capping
        config, cls = transformers.Gemma2Config(head_dim=8, **common), transformers.Gemma2ForCausalLM
    else:  # gemma3: five sliding layers, then a full one
        config, cls = transformers.Gemma3TextConfig(head_dim=8, **common), transformers.Gemma3ForCausalLM
    torch.manual_seed(seed)
    hf = cls(config)
    with torch.no_grad():
        hf.lm_head.weight.mul_(40.0)
    return hf


def _sliding_pair(family: str) -> tuple[TransformersModel, TransformersModel]:
    """A target and a drafter that agrees with it often but not always (its head perturbed), so
    drafts are cut at many different points and the caches are cropped past the window."""
    layers = 7 if family == "gemma3" else 2
    target = TransformersModel(_sliding_hf(family, 0, layers), None, f"{family}-target", kernels="stock")
    drafter_hf = _sliding_hf(family, 0, layers)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        drafter_hf.lm_head.weight.add_(torch.randn(drafter_hf.lm_head.weight.shape, generator=g) * 0.3)
    return target, TransformersModel(drafter_hf, None, f"{family}-drafter", role="drafter", kernels="stock")


FAMILIES = ["mistral", "gemma2", "gemma3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_sliding_window_speculative_greedy_matches_autoregressive(family):
    target, drafter = _sliding_pair(family)
    assert any(getattr(layer, "is_sliding", False) for layer in target.new_cache().layers)
    prompt, length = [3, 9, 14, 20], 40  # 44 positions: five windows
    reference = autoregressive_generate(prompt, target, max_new_tokens=length, eos_token_ids=[])
    out = speculative_generate(prompt, target, drafter, gamma=4, max_new_tokens=length, eos_token_ids=[])
    assert out.tokens == reference.tokens
    cut = [step.num_accepted for step in out.steps if 0 < step.num_accepted < len(step.draft_tokens)]
    assert len(cut) >= 2  # drafts cut after an accepted token: caches cropped at varying points


def _sliding_layers(cache):
    return [layer for layer in cache.layers if getattr(layer, "is_sliding", False)]


@pytest.mark.parametrize("family", FAMILIES)
def test_sliding_window_cache_crops_like_a_cache_free_pass(family):
    model = TransformersModel(_sliding_hf(family, 0, 7 if family == "gemma3" else 2), None, family, kernels="stock")
    tokens = torch.randint(2, 32, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    cache = model.new_cache()
    model.forward(tokens[:12], cache, 1)  # past the window already
    model.forward([7, 8, 9, 10, 11], cache, 5)  # a rejected draft...
    crop_cache(cache, 12)  # ...cropped
    assert cache_length(cache) == 12  # the whole sequence, not the window
    cached = model.forward(tokens[12:20], cache, 8)
    model.forward(tokens[20:26], cache, 6)
    crop_cache(cache, 26)  # all accepted: nothing dropped, sliding layers trimmed to the window
    assert cache_length(cache) == 26
    assert all(layer.keys.shape[-2] == WINDOW - 1 for layer in _sliding_layers(cache))
    for token in tokens[26:30]:  # drafter-style: one token per pass, no crop in between
        model.forward([token], cache, 1)
    crop_cache(cache, 27)  # drop 3 of those 4
    cached_tail = model.forward(tokens[27:40], cache, 13)
    reference = model.forward(tokens, None, 40)
    torch.testing.assert_close(cached, reference[12:20], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cached_tail, reference[27:40], atol=1e-4, rtol=1e-4)
    # keys older than the window and the tokens fed since the last crop are gone: a clear error
    crop_cache(cache, 40)
    with pytest.raises(SpecdecError, match="cannot crop a sliding-window cache from 40 to 30"):
        crop_cache(cache, 30)


# --- BOS in plain-text prompts


def _word_tokenizer(size: int = 12, template: str | None = None):
    """A word-level tokenizer over "t0".."t{size-1}" (t0 = BOS, t1 = EOS, t3 = unknown), optionally
    with a post-processor that wraps the default encoding, e.g. "t0 $A t1"."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(size)}, unk_token="t3"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    if template:
        backend.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("t0", 0), ("t1", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="t0", eos_token="t1", unk_token="t3")


def _with_tokenizer(tokenizer) -> TransformersModel:
    from conftest import tiny_model

    model = tiny_model(0, vocab=16, kernels="stock")
    model.tokenizer = tokenizer
    return model


def test_plain_text_gets_bos_but_never_eos_when_the_tokenizer_adds_them():
    model = _with_tokenizer(_word_tokenizer(template="t0 $A t1"))
    assert model.tokenizer.encode("t5 t6") == [0, 5, 6, 1]  # the tokenizer's default
    assert model.encode("t5 t6") == [0, 5, 6]
    assert model.encode("t0 t5 t6") == [0, 5, 6]  # a BOS already there is not doubled


def test_plain_text_gets_no_bos_when_the_tokenizer_adds_none():
    model = _with_tokenizer(_word_tokenizer())
    assert model.encode("t5 t6") == [5, 6]


def _real_tokenizer(name: str):
    from transformers import AutoTokenizer

    if not registry.is_installed(name):
        pytest.skip(f"{name} is not installed (run `make models`)")
    return AutoTokenizer.from_pretrained(registry.converted_dir(name))


@pytest.mark.slow
def test_gemma3_plain_text_starts_with_one_bos():
    tokenizer = _real_tokenizer("gemma3-270m")
    model = _with_tokenizer(tokenizer)
    text = "The capital of France is"
    plain = tokenizer.encode(text, add_special_tokens=False)
    assert model.encode(text) == [tokenizer.bos_token_id] + plain == [2] + plain
    assert model.encode("<bos>" + text) == [2] + plain


@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "smollm2-135m"])
def test_plain_text_of_tokenizers_without_bos_is_unchanged(name):
    tokenizer = _real_tokenizer(name)
    model = _with_tokenizer(tokenizer)
    text = "def fibonacci(n):\n    return"
    assert model.encode(text) == tokenizer.encode(text, add_special_tokens=False) == tokenizer.encode(text)


# --- one tokenizer, output heads padded to different widths

TOKENS = 12  # the tokenizer's ids; the heads below have 16 (target), 20 and 12 (drafters) rows


def _padded_model(seed: int, vocab: int, role: str, name: str, tokenizer, padding_logit: float = 0.0) -> TransformersModel:
    """A tiny Llama with `vocab` output rows over the shared tokenizer; rows from 16 on (ids no
    target of 16 rows has) get logit `padding_logit` from a bias, as an untrained padded head might."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(config)
    head = torch.nn.Linear(32, vocab, bias=True)
    with torch.no_grad():
        head.weight.copy_(hf.lm_head.weight * 12.0)
        head.bias.zero_()
        head.bias[16:] = padding_logit
    hf.lm_head = head
    return TransformersModel(hf, tokenizer, name, role=role, kernels="stock")


@pytest.fixture(scope="module")
def padded_models():
    tokenizer = _word_tokenizer(TOKENS)
    target = _padded_model(0, 16, "target", "target16", tokenizer)
    wide = _padded_model(1, 20, "drafter", "drafter20", tokenizer, padding_logit=1000.0)
    narrow = _padded_model(2, 12, "drafter", "drafter12", tokenizer)
    return target, wide, narrow


def test_pair_check_compares_tokenizers_not_head_widths(padded_models):
    target, wide, narrow = padded_models
    check_pair(target, wide)
    check_pair(target, narrow)
    other = _padded_model(3, 16, "drafter", "other", _word_tokenizer(TOKENS + 1))  # one more token
    with pytest.raises(SpecdecError, match="tokenizers differ"):
        check_pair(target, other)
    other.tokenizer = None  # without a tokenizer, only the widths can be compared
    check_pair(target, other)
    narrow_untokenized = _padded_model(2, 12, "drafter", "bare12", None)
    with pytest.raises(SpecdecError, match="target target16 has 16 ids, drafter bare12 has 12"):
        check_pair(target, narrow_untokenized)


def test_pair_check_remembers_a_verified_pair_until_a_tokenizer_grows():
    target = _padded_model(0, 16, "target", "grows-target", _word_tokenizer(TOKENS))
    drafter = _padded_model(4, 16, "drafter", "grows-drafter", _word_tokenizer(TOKENS))
    check_pair(target, drafter)
    check_pair(target, drafter)  # remembered: the vocabularies are not built again
    # both grow by one token, each by another: equal lengths, different vocabularies
    target.tokenizer.add_tokens(["zzz-target-token"])
    drafter.tokenizer.add_tokens(["zzz-drafter-token"])
    with pytest.raises(SpecdecError, match="tokenizers differ"):
        check_pair(target, drafter)


@pytest.mark.parametrize("which", ["wide", "narrow"])
def test_padded_drafter_greedy_matches_autoregressive(padded_models, which):
    target, wide, narrow = padded_models
    drafter = wide if which == "wide" else narrow
    reference = autoregressive_generate([4, 5], target, max_new_tokens=30, eos_token_ids=[])
    # the wide twin outweighs the target by its padded embedding rows alone
    out = speculative_generate([4, 5], target, drafter, gamma=4, max_new_tokens=30, eos_token_ids=[],
                               allow_larger_drafter=True)
    assert out.tokens == reference.tokens
    assert all(t < 16 for step in out.steps for t in step.draft_tokens)


@pytest.mark.parametrize("which", ["wide", "narrow"])
def test_padded_drafter_q_covers_the_target_vocabulary(padded_models, which):
    target, wide, narrow = padded_models
    drafter = ModelDrafter(wide if which == "wide" else narrow)
    drafter.check_target(target)
    drafter.start([4, 5])
    g = torch.Generator(device=target.device).manual_seed(0)
    draft = drafter.propose([4, 5, 13, 6], 4, Sampler(1.0), g, lambda n, logits: True)  # 13: no id of drafter12
    assert draft.probs.shape == (4, 16)
    if which == "narrow":
        assert torch.all(draft.probs[:, 12:] == 0)
    assert all(t < 16 for t in draft.tokens)


class _Reference:
    """exact_joint's view of a TransformersModel: p(. | context) from a cache-free pass."""

    def __init__(self, model):
        self.model = model

    def next_probs(self, context, sampler):
        return sampler.probs(self.model.forward(context, None, 1)[-1])


@pytest.mark.parametrize("which", ["wide", "narrow"])
@pytest.mark.slow
def test_padded_drafter_sampling_matches_the_target_joint_distribution(padded_models, which):
    target, wide, narrow = padded_models
    drafter = wide if which == "wide" else narrow
    sampler, prompt, length, runs = Sampler(1.0), [4, 5], 2, 1500
    joint = exact_joint(_Reference(target), prompt, length, sampler)
    assert sum(p for k, p in joint.items() if max(k) >= TOKENS) > 0.05  # the target emits ids drafter12 lacks
    g = torch.Generator().manual_seed(99)
    samples, rejected = [], 0
    for _ in range(runs):
        seed = int(torch.randint(0, 2**62, (1,), generator=g))
        out = speculative_generate(prompt, target, drafter, gamma=2, sampler=sampler, max_new_tokens=length,
                                   seed=seed, seed_rule="stream", eos_token_ids=[], first_target=False,
                                   allow_larger_drafter=True)  # the wide drafter's padded head outweighs the target
        samples.append(tuple(out.tokens))
        rejected += out.stats.drafted - out.stats.accepted
    assert rejected > runs // 10  # the drafter is another model: the rejection path is exercised
    assert chi_square_pvalue(samples, joint) > 1e-4
