"""The contracts the loop reads instead of probing: a drafter subclasses `Drafter` and declares its
`Capabilities`; a model backend declares its `Features` (`parallel_k` and an online learner
included). What declares nothing is refused with a clear error, and no probe on a drafter or a
backend comes back into drafters/, backends/ or models/roles.py."""

import re
from pathlib import Path

import pytest

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

# Every hasattr/getattr left in drafters/, backends/ and models/roles.py, by (file, the object
# probed), with why it is fair: duck typing of third-party objects (transformers' configs, modules
# and caches, tokenizers, llama_cpp, os) or the contract's own check. A probe on a drafter or a
# backend is none of these: it fails this test until it reads a declaration instead.
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


def test_no_probe_on_a_drafter_or_a_backend_comes_back():
    files = [*sorted((SRC / "drafters").glob("*.py")), *sorted((SRC / "backends").glob("*.py")),
             SRC / "models" / "roles.py"]
    found = {(path.relative_to(SRC).as_posix(), probed) for path in files for probed in _probes(path.read_text())}
    assert found - set(ALLOWED) == set(), "probes on drafters or backends: read a declaration instead"
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
