"""The contracts the loop reads instead of probing: a drafter subclasses `Drafter` and declares its
`Capabilities`; a model backend declares its `Features` (`parallel_k` and an online learner
included). What declares nothing is refused with a clear error, and no probe on a drafter or a
backend comes back anywhere in src/specdec."""

import re
from pathlib import Path

import pytest
import torch

from specdec import autoregressive_generate, speculative_generate
from specdec.backends import Features, features
from specdec.backends.transformers import TransformersModel
from specdec.decoding.config import SpecConfig
from specdec.decoding.speculation import Parts, Speculation, build
from specdec.decoding.sequence import Decoding, Limits
from specdec.drafters import Draft, Drafter, ModelDrafter, NgramDrafter
from specdec.drafters.base import Capabilities, capabilities_of, is_drafter, is_factory
from specdec.drafters.parallel import ParallelDrafter
from specdec.errors import SpecdecError

from conftest import TableModel, tiny_model, tiny_parallel

SRC = Path(__file__).resolve().parents[1] / "src" / "specdec"
PROMPT = [3, 1, 4, 1, 5]


class _Repeats:
    """A drafter written against the bare members, without subclassing `Drafter`."""

    name = "repeats"
    passes = 0

    def check_target(self, target):
        pass

    def start(self, prompt):
        pass

    def propose(self, context, max_tokens, sampler, generator, keep_going):
        return Draft([context[-1]] * max_tokens)

    def rollback(self, length):
        pass


class _RepeatsDrafter(_Repeats, Drafter):
    """The same drafter, subclassing `Drafter`: nothing beyond the base to declare."""


class _Bare:
    """A model with every member a probe used to look for (batched passes, exact rows, a parallel
    drafter's k, an online learner) but no `features()` declaration."""

    exact_rows, rows_invariant, tree_masks, parallel_k, online = True, True, True, 3, object()

    def __init__(self, model):
        self.inner = model
        self.name, self.vocab_size, self.tokenizer, self.role = "bare", model.vocab_size, None, None
        self.device, self.max_context, self.eos_token_ids = model.device, model.max_context, []

    def new_cache(self):
        return self.inner.new_cache()

    def prefill(self, prompt, cache):
        return self.inner.prefill(prompt, cache)

    def forward(self, *args, **kwargs):
        return self.inner.forward(*args, **kwargs)

    def forward_batch(self, segments):
        return [self.forward(s.input_ids, s.cache, s.num_logits) for s in segments]


def test_a_drafter_that_does_not_subclass_drafter_is_refused_with_what_to_do():
    target = TableModel(8, 0)
    with pytest.raises(SpecdecError, match=r"_Repeats is no drafter: a drafter subclasses specdec\.drafters\.Drafter"):
        capabilities_of(_Repeats())
    with pytest.raises(SpecdecError, match=r"neither a drafter nor a model: a drafter subclasses specdec\.drafters\.Drafter"):
        speculative_generate(PROMPT, target, _Repeats(), max_new_tokens=8, eos_token_ids=[])
    with pytest.raises(SpecdecError, match=r"subclasses specdec\.drafters\.Drafter"):
        Decoding(PROMPT, target, Speculation.of(_Repeats()), limits=Limits(8, []))
    # the same members on a Drafter subclass draft, its capabilities the base's
    ar = autoregressive_generate(PROMPT, target, max_new_tokens=12, eos_token_ids=[])
    assert capabilities_of(_RepeatsDrafter()) == Capabilities()
    out = speculative_generate(PROMPT, target, _RepeatsDrafter(), gamma=3, max_new_tokens=12, eos_token_ids=[])
    assert out.tokens == ar.tokens and out.stats.drafted_at


def test_a_drafter_a_factory_and_a_model_are_told_apart_by_class_not_by_members():
    model, table = tiny_model(0, vocab=16), TableModel(8, 0)
    assert is_drafter(NgramDrafter()) and not is_drafter(_Repeats()) and not is_drafter(model)
    assert is_factory(NgramDrafter) and is_factory(lambda: NgramDrafter())
    assert not is_factory(_Repeats) and not is_factory(NgramDrafter()) and not is_factory(model)
    assert not is_factory(table)  # a declared backend, whatever it has or lacks (no `forward` probe)


def test_a_backend_without_features_is_refused_where_it_is_first_used():
    table = TableModel(8, 0)
    bare = _Bare(table)
    with pytest.raises(SpecdecError, match=r"_Bare declares no features\(\).*specdec\.backends\.Features"):
        features(bare)
    with pytest.raises(SpecdecError, match=r"_Bare declares no features\(\)"):
        speculative_generate(PROMPT, bare, NgramDrafter(), max_new_tokens=8, eos_token_ids=[])
    with pytest.raises(SpecdecError, match=r"_Bare is neither a drafter nor a model"):
        speculative_generate(PROMPT, table, bare, max_new_tokens=8, eos_token_ids=[])
    with pytest.raises(SpecdecError, match=r"_Bare declares no features\(\)"):
        ModelDrafter(bare)


def test_every_backend_class_declares_its_features():
    from specdec.backends.captured import CapturedModel
    from specdec.backends.llamacpp import LlamaCppModel
    from specdec.backends.seq2seq import BoundDecoder, Seq2SeqModel
    from specdec.backends.transformers import TransformersModel
    from specdec.drafters.eagle import EagleModel
    from specdec.drafters.early_exit import EarlyExitModel
    from specdec.drafters.layerskip import LayerSkipModel

    for cls in (TransformersModel, LlamaCppModel, CapturedModel, Seq2SeqModel, BoundDecoder, EagleModel,
                LayerSkipModel, EarlyExitModel, TableModel):
        assert callable(getattr(cls, "features", None)), cls.__name__
    model = tiny_model(0, vocab=16)
    assert features(model) == model.features() and features(model).embedded == 16
    assert features(model).parallel_k is None and features(model).online is None


def test_parallel_k_is_read_from_the_declaration_not_probed():
    drafter_model = tiny_parallel(1, vocab=16, k=3)
    assert features(drafter_model).parallel_k == 3 and ParallelDrafter(drafter_model).k == 3
    table = TableModel(16, 1)
    table.parallel_k = 3  # an attribute the old probe read; the declaration says none
    with pytest.raises(SpecdecError, match="no parallel drafter"):
        ParallelDrafter(table)

    class DeclaresK(TableModel):
        def features(self):
            return Features(parallel_k=3)

    assert features(DeclaresK(16, 1)).parallel_k == 3
    with pytest.raises(SpecdecError, match="parallel method drafts with a parallel drafter"):
        build(SpecConfig("parallel"), Parts(TableModel(16, 0), table))


class _Recorder:
    """An online learner's surface the loop calls: `record` at each rejection, `finish` at the end."""

    def __init__(self):
        self.records, self.finished = [], []

    def record(self, key, position, logits):
        self.records.append(position)

    def finish(self, key, sequence):
        self.finished.append(list(sequence))


def test_the_online_learner_is_read_from_the_declaration_not_probed():
    target = tiny_model(0, vocab=16)
    recorder = _Recorder()

    class Learning(TransformersModel):
        def features(self):
            return Features(exact_rows=self.exact_rows, tree_masks=True, online=recorder,
                            embedded=self.hf.get_input_embeddings().num_embeddings)

    drafter_model = tiny_model(1, vocab=16, role="drafter")
    drafter_model.__class__ = Learning  # the same model, its class declaring a learner
    ar = autoregressive_generate(PROMPT, target, max_new_tokens=16, eos_token_ids=[])
    out = speculative_generate(PROMPT, target, drafter_model, gamma=3, max_new_tokens=16, eos_token_ids=[])
    assert out.tokens == ar.tokens
    assert recorder.records and recorder.finished == [PROMPT + ar.tokens]  # told of each rejection, then the end
    assert Decoding(PROMPT, target, Speculation.of(drafter_model), limits=Limits(8)).online is recorder

    table = TableModel(16, 1)
    table.online = _Recorder()  # an attribute the old side channel set on any model: not declared, not read
    assert Decoding(PROMPT, TableModel(16, 0), Speculation.of(table), limits=Limits(8)).online is None


def test_an_online_distiller_is_its_drafter_models_declared_learner():
    from specdec.adapters.lora import OnlineDistiller

    drafter_model = tiny_model(1, vocab=16, role="drafter")
    online = OnlineDistiller(drafter_model, rank=2, min_records=1)
    assert features(drafter_model).online is online
    assert Decoding(PROMPT, tiny_model(0, vocab=16), Speculation.of(drafter_model), limits=Limits(8)).online is online


# ---------------------------------------------------------------- no probe comes back

# Every hasattr/getattr left in src/specdec, by (file, the object probed), with why it is fair:
# duck typing of third-party objects (transformers' configs, modules and caches, tokenizers,
# llama_cpp, torch, os, vLLM, the ASGI server), our own objects' fields by name, or the contract's
# own check. A probe on a drafter or a backend is none of these: it fails this test until it reads
# a declaration instead (a Backend protocol member, a Features or Capabilities field, or an
# isinstance check against our own backend class where only that one has the member).
ALLOWED = {
    ("backends/__init__.py", "type(model)"): "the contract's check: the class declares features() or is refused",
    ("backends/captured.py", "attention"): "a transformers attention module (q_norm/k_norm by family)",
    ("backends/captured.py", "config"): "a transformers config (fields vary by family)",
    ("backends/captured.py", "hf_model"): "a transformers model (its base_model_prefix)",
    ("backends/captured.py", "hf_model.get_output_embeddings()"): "a torch Linear (a bias or none)",
    ("backends/captured.py", "self.hf"): "a transformers model (generation_config or none)",
    ("backends/cache.py", "cache"): "a transformers cache (DynamicCache's members vary by version)",
    ("backends/cache.py", "layer"): "a transformers cache layer (sliding, initialised, reserve)",
    ("backends/heads.py", "config"): "a transformers config (logit scaling by family)",
    ("backends/heads.py", "hf_model"): "a transformers model (its base_model_prefix)",
    ("backends/kernels.py", "cls"): "a transformers norm class (patched once)",
    ("backends/llamacpp.py", "llama_cpp"): "the llama_cpp module (its constants by version)",
    ("backends/llamacpp.py", "os"): "os.sched_getaffinity exists on Linux only",
    ("backends/llamacpp.py", "self"): "its own teardown of a partly built object (__del__, close)",
    ("backends/prompts.py", "cache"): "a transformers cache, or one wrapped with a prompt's record (held)",
    ("backends/seq2seq.py", "config"): "a transformers config (fields vary by family)",
    ("backends/seq2seq.py", "hf_model"): "a transformers model (generation_config or none)",
    ("backends/text.py", "tokenizer"): "a transformers tokenizer (chat template, decoder by kind)",
    ("backends/text.py", "getattr(tokenizer"): "a tokenizers backend (its decoder)",
    ("backends/text.py", "ids"): "what a tokenizer's apply_chat_template returns (a BatchEncoding or a list)",
    ("backends/text.py", "source"): "a generation config, a model config or a tokenizer (eos ids)",
    ("backends/text.py", "token"): "a tokenizer's AddedToken",
    ("backends/transformers.py", "hf_model"): "a transformers model (its base_model_prefix)",
    ("backends/transformers.py", "head"): "a torch Linear (a bias or none)",
    ("backends/transformers.py", "hf_model.config"): "a transformers config",
    ("backends/transformers.py", "self.hf.config"): "a transformers config",
    ("backends/transformers.py", "config"): "a transformers config (fields vary by family)",
    ("backends/transformers.py", "self.hf"): "a transformers model (generation_config or none)",
    ("backends/transformers.py", "cache"): "a transformers cache, or one wrapped with a prompt's record (held)",
    ("drafters/layerskip.py", "self.target"): "the view's own delegation to its target (__getattr__)",
    ("drafters/layerskip.py", "decoder"): "a transformers decoder module (its layers)",
    ("drafters/layerskip.py", "target.hf.config"): "a transformers config (layer_types by family)",
    ("drafters/model.py", "tokenizer"): "a transformers tokenizer (unk or pad id)",
    ("drafters/retokenize.py", "mine"): "a transformers tokenizer (its special tokens)",
    ("drafters/retokenize.py", "theirs"): "a transformers tokenizer (its special tokens)",
    # the rest of src/specdec: the same two kinds, and our own objects' fields by name
    ("adapters/eagle_layer.py", "config"): "a transformers config (fields vary by family)",
    ("adapters/eagle_layer.py", "embeddings"): "a torch Embedding (its width)",
    ("adapters/export.py", "hf.config"): "a transformers config (torch_dtype or none)",
    ("adapters/export.py", "torch"): "the torch module (a dtype by its name)",
    ("adapters/lora.py", "module"): "a torch module (a Linear's in_features)",
    ("bench/kvstorage.py", "config"): "a transformers config (fields vary by family)",
    ("bench/rowprobe.py", "type(m)"): "a torch module's class (patched norms mark themselves)",
    ("bench/run.py", "llama_cpp"): "the llama_cpp module (its version)",
    ("bench/runners.py", "settings"): "own fields: a Settings field by name",
    ("bench/vllm_peer.py", "os"): "os.sched_getaffinity and os.getuid exist on some systems only",
    ("bench/vllm_worker.py", "getattr(worker.model_runner"): "vLLM's model runner and its drafter",
    ("bench/vllm_worker.py", "worker.model_runner"): "vLLM's model runner (a drafter or none)",
    ("cli/chat.py", "target_model.tokenizer"): "a transformers tokenizer (a chat template or none)",
    ("cli/training.py", "config"): "own fields: a training config's fields by name (validation)",
    ("core/penalties.py", "self"): "own fields by name (validation)",
    ("core/verify.py", "self"): "own fields by name (validation)",
    ("decoding/config.py", "default"): "own fields: SpecConfig's by name (to_dict)",
    ("decoding/config.py", "self"): "own fields: SpecConfig's by name (validation, to_dict)",
    ("decoding/sequence.py", "self.on_step"): "the caller's step callback (a printer may hold output back: flush)",
    ("models/catalogue.py", "model.config"): "a transformers config (quantized or not)",
    ("models/loading.py", "AutoConfig.from_pretrained(directory)"): "a transformers config (encoder-decoder or not)",
    ("models/vocab.py", "tokenizer"): "a transformers tokenizer (its backend and special ids)",
    ("server/app.py", "getattr(send"): "the ASGI server's send callable and its transport",
    ("server/app.py", "send"): "the ASGI server's send callable (bound to a protocol object or not)",
    ("server/service.py", "ids"): "what a tokenizer's apply_chat_template returns (a BatchEncoding or a list)",
    ("server/service.py", "tokenizer"): "a transformers tokenizer (a chat template or none)",
    ("server/tools.py", "tokenizer"): "a transformers tokenizer (chat template, added vocabulary)",
    ("training/fit_distilled.py", "config"): "own fields: a training config's fields by name (validation)",
    ("training/fit_parallel.py", "config"): "own fields: a training config's fields by name (validation)",
    ("ui/conversation.py", "ids"): "what a tokenizer's apply_chat_template returns (a BatchEncoding or a list)",
    ("ui/conversation.py", "self"): "own fields by name (a /command sets one)",
    ("vllm/proposers.py", "config"): "vLLM's speculative config (fields vary by version)",
}


def _probes(text: str) -> list[str]:
    """The first argument of every hasattr/getattr call in `text`."""
    found = []
    for match in re.finditer(r"\b(?:hasattr|getattr)\(", text):
        depth, i = 0, match.end()
        while i < len(text) and not (depth == 0 and text[i] == ","):
            depth += text[i] in "([{"
            depth -= text[i] in ")]}"
            i += 1
        first = text[match.end():i].strip()
        found.append(first.split(",")[0] if first.startswith("getattr(") else first)
    return found


def _found(folder: Path = SRC) -> set[tuple[str, str]]:
    """(file relative to `folder`, the object probed) of every hasattr/getattr under `folder`."""
    return {(path.relative_to(folder).as_posix(), probed) for path in sorted(folder.rglob("*.py"))
            for probed in _probes(path.read_text())}


def test_no_probe_on_a_drafter_or_a_backend_comes_back():
    """Over the whole of src/specdec: every probe left is on the allow-list, with its reason."""
    found = _found()
    assert found - set(ALLOWED) == set(), "probes on drafters or backends: read a declaration instead"
    assert set(ALLOWED) - found == set(), "allowed probes that are gone: take them off the list"
    assert _probes('getattr(model, "parallel_k", None) and hasattr(drafter, "pin")') == ["model", "drafter"]
    assert _probes('getattr(getattr(tokenizer, "x", None), "y")') == ["getattr(tokenizer", "tokenizer"]


# ---------------------------------------------------------------- one proposal entry

def test_chains_and_trees_have_one_proposal_entry():
    """Every drafter proposes through `propose` (a chain: parents None; a tree: a Draft with
    parents) and, where it batches its passes, `proposal`; the loop calls nothing else."""
    import inspect

    import specdec.drafters as drafters
    from specdec.core.trees import Tree
    from specdec.drafters import LookupTreeDrafter

    for name, cls in inspect.getmembers(drafters, inspect.isclass):
        if issubclass(cls, Drafter):
            assert not {"propose_tree", "tree_proposal"} & set(dir(cls)), name
    calls = []

    class WatchedTree(LookupTreeDrafter):
        def propose(self, *args):
            draft = super().propose(*args)
            calls.append(("tree", draft.parents is not None and isinstance(draft, Tree), args[4]))
            return draft

    class WatchedChain(NgramDrafter):
        def propose(self, *args):
            draft = super().propose(*args)
            calls.append(("chain", draft.parents is None, callable(args[4])))
            return draft

    target = TableModel(8, 0)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    ar = autoregressive_generate(prompt, target, max_new_tokens=12, eos_token_ids=[])
    for drafter in (WatchedTree(), WatchedChain()):
        assert speculative_generate(prompt, target, drafter, max_new_tokens=12, eos_token_ids=[]).tokens == ar.tokens
    assert ("tree", True, None) in calls and ("chain", True, True) in calls  # a tree's policy sizes it: no keep_going
    assert {call[:2] for call in calls} == {("tree", True), ("chain", True)}


# ---------------------------------------------------------------- declarations outside drafters/ and backends/

def test_the_probe_guard_sees_a_new_probe_anywhere(tmp_path):
    (tmp_path / "sizing").mkdir()
    (tmp_path / "sizing" / "costs.py").write_text('weights = getattr(model, "weights", None)\n')
    assert _found(tmp_path) - set(ALLOWED) == {("sizing/costs.py", "model")}


class _BatchedTable(TableModel):
    """Every member the beam search's old probe looked for, and a declaration that says no row exactness."""

    exact_rows = True

    def forward_batch(self, segments):
        return [self.forward(s.input_ids, s.cache, s.num_logits, s.parents, s.tree_start) for s in segments]


def test_beam_search_reads_row_exactness_and_drafter_kinds_from_declarations():
    from specdec.decoding.beam import _fork_drafter, speculative_beam_search
    from specdec.drafters import LookupTreeDrafter

    with pytest.raises(SpecdecError, match="row-exact target"):
        speculative_beam_search(PROMPT, _BatchedTable(16, 0), LookupTreeDrafter, num_beams=2, max_new_tokens=4)
    target = tiny_model(0, vocab=16, exact_rows=True)
    with pytest.raises(SpecdecError, match="a drafter model or a factory of tree drafters"):
        speculative_beam_search(PROMPT, target, LookupTreeDrafter(), num_beams=2, max_new_tokens=4)
    drafter = LookupTreeDrafter()
    drafter.cache = marker = object()  # not a model drafter's cache: a fork shares it, never clones it
    assert _fork_drafter(drafter).cache is marker


def test_pass_costs_key_a_restricted_vocabulary_of_transformers_models_alone():
    from specdec.sizing.pass_costs import _key

    table = TableModel(16, 0)
    table.draft_vocabulary = 7  # a member only transformers' backend declares
    assert "|vocab=all|" in _key(table)
    drafter = tiny_model(1, vocab=16, role="drafter")
    drafter.restrict_vocabulary([0, 1, 2, 3])
    assert "|vocab=4|" in _key(drafter) and f"|{drafter.weights}|" in _key(drafter)


def test_adapters_and_heads_refuse_what_is_not_transformers_own_model():
    from specdec.adapters.checkpoints import check_reads_hidden, head_rows
    from specdec.adapters.eagle_layer import check_embeddings
    from specdec.adapters.lora import Head, OnlineDistiller, adapted_layers, check_adapter_target
    from specdec.drafters.layerskip import LayerSkipModel

    target = tiny_model(0, vocab=16, layers=3)
    view = LayerSkipModel(target, [1])  # a drafter whose members are its target's, by delegation
    for attach in (adapted_layers, Head, lambda model: OnlineDistiller(model, rank=2)):
        with pytest.raises(SpecdecError, match="transformers' weights|cannot be read for distillation"):
            attach(view)
    table = TableModel(16, 0)
    table.hidden_size, table.hf, table.adapter_target = 32, target.hf, "0" * 64  # members it does not declare
    with pytest.raises(SpecdecError, match=r"hidden states can be read; table \(table\)"):
        check_reads_hidden(table)
    with pytest.raises(SpecdecError, match="has none to read"):
        check_embeddings(table)
    with pytest.raises(SpecdecError, match=r"output head cannot be read for self-drafting heads \(table\)"):
        head_rows(table, torch.arange(2))
    check_adapter_target(table, target)  # only transformers' backend carries an adapter's target
    check_reads_hidden(target)
    check_embeddings(target)
    assert head_rows(target, torch.arange(2)).shape == (2, target.hidden_size)


def test_transformers_model_declares_its_source_and_parallel_hooks():
    from specdec.adapters.pard import remove
    from specdec.training.distill import drafter_source

    model = tiny_model(0, vocab=16, name="tiny")
    assert model.source is None and model._parallel_hooks == () and drafter_source(model) == "tiny"
    remove(model)  # nothing installed: nothing to remove
    model.source = "tiny-dir"
    assert drafter_source(model) == "tiny-dir"


def test_a_drafters_weights_are_its_declared_models():
    from specdec.cli.common import _weights_of

    drafter_model = tiny_model(1, vocab=16, role="drafter")
    ngram = NgramDrafter()
    ngram.model = drafter_model  # not declared (no `model` capability): not a drafter model's weights
    assert _weights_of(ngram) is None and _weights_of(None) is None
    assert _weights_of(ModelDrafter(drafter_model)) == drafter_model.weights
