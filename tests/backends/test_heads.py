"""Logits after the output head: each model's own transform applied (or the model refused)."""

import pytest
import torch

from specdec import GREEDY, TransformersModel, SpecdecError, autoregressive_generate, speculative_generate


def _tiny(family: str, seed: int = 0, layers: int = 2):
    import transformers

    common = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
                  bos_token_id=0, eos_token_id=1)
    if family == "gemma2":
        config = transformers.Gemma2Config(**common, head_dim=8, final_logit_softcapping=0.5,
                                           attn_logit_softcapping=50.0, sliding_window=16)
        cls = transformers.Gemma2ForCausalLM
    elif family == "cohere":
        config = transformers.CohereConfig(**common, logit_scale=0.0625)
        cls = transformers.CohereForCausalLM
    elif family == "granite":
        config = transformers.GraniteConfig(**common, logits_scaling=8.0)
        cls = transformers.GraniteForCausalLM
    else:
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():  # logits large enough that a missing transform shows
        model.get_output_embeddings().weight.mul_(60.0)
    return model


@pytest.mark.parametrize("family", ["gemma2", "cohere", "granite"])
def test_our_logits_are_the_models_own(family):
    hf = _tiny(family)
    ids = torch.tensor([[3, 9, 4, 17, 22, 5]])
    with torch.inference_mode():
        reference = hf(input_ids=ids).logits[0].float()
    model = TransformersModel(hf, None, family)
    assert model._transform is not None
    ours = model.forward(ids[0].tolist(), None, num_logits=6)
    ours = ours.to(reference.device)
    assert torch.allclose(ours, reference, atol=1e-4, rtol=1e-4), (ours - reference).abs().max()


@pytest.mark.parametrize("family", ["gemma2", "cohere", "granite"])
def test_greedy_identity_with_transformed_logits(family):
    target, drafter = TransformersModel(_tiny(family, 0), None, "t"), TransformersModel(_tiny(family, 1, 1), None, "d", role="drafter")
    prompt = [3, 9, 4]
    ar = autoregressive_generate(prompt, target, GREEDY, max_new_tokens=20, eos_token_ids=[])
    sd = speculative_generate(prompt, target, drafter, gamma=3, max_new_tokens=20, eos_token_ids=[])
    assert sd.tokens == ar.tokens


def test_an_unknown_transform_is_refused():
    hf = _tiny("llama")
    original = hf.forward

    def forward(*args, **kwargs):  # a model that rescales its logits in code we do not know
        out = original(*args, **kwargs)
        out.logits = out.logits * 3.0
        return out

    hf.forward = forward
    with pytest.raises(SpecdecError, match="transforms its logits"):
        TransformersModel(hf, None, "odd")


def test_a_plain_model_has_no_transform():
    assert TransformersModel(_tiny("llama"), None, "plain")._transform is None
