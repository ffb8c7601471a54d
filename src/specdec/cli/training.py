"""`specdec train-heads`, `distill-drafter`, `train-parallel-drafter`, `export` (`export-heads`): the target's own
drafting modules and a drafter's adapters, trained here."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..models import catalogue as registry
from ..errors import SpecdecError
from .common import (app, err, _fail, _load, DRAFTER_DTYPE_HELP)


@app.command("train-heads")
def train_heads(
    out: str = typer.Option(..., "--out", help="Folder to write the heads into (resumes a run stopped there)."),
    target: str = typer.Option(registry.DEFAULT_TARGET, help="Target model the heads draft for."),
    kind: str = typer.Option("medusa", help="medusa (K heads on the last hidden state) or eagle (a one-layer "
                             "feature drafter)."),
    corpus: str = typer.Option("stdlib", help="Training text: stdlib (Python's standard library sources), "
                               "humaneval, spec-bench, or a text file."),
    tokens: int = typer.Option(32768, help="Corpus tokens to run through the target (a tenth is held out)."),
    heads: int = typer.Option(5, "--heads", help="Medusa: heads; head k predicts the token k+1 ahead."),
    vocab: int = typer.Option(32768, help="Most frequent ids the loss and the drafting score."),
    epochs: Optional[int] = typer.Option(None, help="Passes over the corpus (default: medusa 3, eagle 4)."),
    batch: Optional[int] = typer.Option(None, help="Examples per step (default: medusa 64 positions, eagle 2 "
                                        "sequences)."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak learning rate (default: medusa 1e-3, eagle 5e-4)."),
    seq_len: int = typer.Option(256, "--seq-len", help="Tokens per target pass while caching hidden states."),
    unroll: int = typer.Option(2, help="EAGLE: passes per sequence, the later ones on its own predicted features."),
    intermediate: int = typer.Option(0, help="EAGLE: MLP width (0: 8/3 of the hidden size)."),
    seed: int = typer.Option(0),
    dtype: str = typer.Option("auto", "--dtype", help="Target dtype while caching its hidden states (auto, bf16, fp32)."),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
):
    """Train self-drafting heads for a target (self-distillation: they learn what the target would say)."""
    from ..training.fit_eagle import EagleTrainConfig, train_eagle
    from ..training.fit_medusa import TrainConfig, train_medusa

    try:
        if kind not in ("medusa", "eagle"):
            raise SpecdecError(f"unknown kind of heads {kind!r}: medusa or eagle")
        defaults = TrainConfig() if kind == "medusa" else EagleTrainConfig()
        epochs = defaults.epochs if epochs is None else epochs
        batch = defaults.batch if batch is None else batch
        lr = defaults.lr if lr is None else lr
        for name, value in (("tokens", tokens), ("heads", heads), ("vocab", vocab), ("epochs", epochs),
                            ("batch", batch), ("unroll", unroll)):
            if value < 1:
                raise SpecdecError(f"--{name} must be >= 1, got {value}")
        if not lr > 0 or intermediate < 0:
            raise SpecdecError(f"--lr must be > 0 and --intermediate >= 0, got {lr} and {intermediate}")
        if corpus not in ("stdlib", "humaneval", "spec-bench") and not Path(corpus).is_file():
            raise SpecdecError(f"corpus not found: {corpus} (stdlib, humaneval, spec-bench or a text file)")
        if dtype == "gguf":
            raise SpecdecError("training heads needs the target's hidden states: use --dtype auto, bf16 or fp32")
        target_model = _load(target, dtype, device, "target", exact_rows=False)
        say = lambda m: err.print(f"[dim]{m}[/]", highlight=False)  # noqa: E731
        if kind == "medusa":
            trained = train_medusa(target_model, corpus, out, TrainConfig(
                num_heads=heads, tokens=tokens, vocab=vocab, seq_len=seq_len, epochs=epochs, batch=batch, lr=lr,
                seed=seed), say=say)
            what = f"{trained.info['num_heads']} Medusa heads"
        else:
            trained = train_eagle(target_model, corpus, out, EagleTrainConfig(
                tokens=tokens, vocab=vocab, seq_len=seq_len, epochs=epochs, batch=batch, lr=lr, seed=seed,
                intermediate=intermediate, unroll=unroll), say=say)
            what = "an EAGLE drafter"
    except SpecdecError as exc:
        _fail(str(exc))
    info = trained.info
    err.print(f"{what} for {info['target']} in {out}: held-out loss {info['heldout_loss']:.3f} (untrained "
              f"{info['heldout_loss_untrained']:.3f}), top-1 per "
              f"{'head' if kind == 'medusa' else 'depth'} " + ", ".join(f"{a:.3f}" for a in info["heldout_top1"])
              + f"; {info['seconds']:.0f} s", highlight=False)


@app.command("distill-drafter")
def distill_drafter_command(
    out: str = typer.Option(..., "--out", help="Folder to write the adapter into (resumes a run stopped there); "
                            "use it as --drafter distilled:OUT."),
    target: str = typer.Option(registry.DEFAULT_TARGET, help="Target model the drafter should agree with."),
    drafter: str = typer.Option(registry.DEFAULT_DRAFTER, help="Drafter model to distil (same tokenizer)."),
    corpus: str = typer.Option("stdlib", help="Where the contexts come from: stdlib (Python's standard library "
                               "sources), humaneval, spec-bench, or a text file."),
    tokens: int = typer.Option(16384, help="Positions to train on: the contexts and the drafter's continuations "
                               "(a tenth of the sequences is held out)."),
    context: int = typer.Option(64, help="Corpus tokens each sequence starts from."),
    continuation: int = typer.Option(64, help="Tokens the drafter samples after each context (on-policy data)."),
    rank: int = typer.Option(8, help="LoRA rank on each projection of the drafter's layers."),
    loss: str = typer.Option("tvd", help="tvd (1 - acceptance: the loss acceptance reads) or fkl."),
    epochs: int = typer.Option(2),
    batch: int = typer.Option(4, help="Sequences per optimiser step."),
    lr: float = typer.Option(1e-3, "--lr", help="Peak learning rate (cosine schedule)."),
    seed: int = typer.Option(0),
    drafter_dtype: str = typer.Option("auto", "--drafter-dtype", help="The drafter's weights while training; "
                                      "train on the weights it will draft with. " + DRAFTER_DTYPE_HELP),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
):
    """Distil a drafter towards a target (DistillSpec): a LoRA adapter on the drafter's layers,
    trained on the drafter's own samples scored by the target. Prints held-out acceptance before
    and after."""
    from ..training.fit_distilled import DistillConfig, distill_drafter

    try:
        if corpus not in ("stdlib", "humaneval", "spec-bench") and not Path(corpus).is_file():
            raise SpecdecError(f"corpus not found: {corpus} (stdlib, humaneval, spec-bench or a text file)")
        if drafter_dtype == "gguf":
            raise SpecdecError("distillation needs the drafter's hidden states: --drafter-dtype auto, int8, bf16 or fp32")
        config = DistillConfig(tokens=tokens, context=context, continuation=continuation, rank=rank, loss=loss,
                               epochs=epochs, batch=batch, lr=lr, seed=seed)
        for name in ("tokens", "context", "continuation", "rank", "epochs", "batch"):
            if getattr(config, name) < 1:
                raise SpecdecError(f"--{name} must be >= 1, got {getattr(config, name)}")
        if not lr > 0 or loss not in ("tvd", "fkl"):
            raise SpecdecError(f"--lr must be > 0 and --loss tvd or fkl, got {lr} and {loss!r}")
        if drafter.startswith("distilled:"):
            raise SpecdecError("distil the plain drafter model, not a distilled one")
        target_model = _load(target, "auto", device, "target", exact_rows=False)
        drafter_model = _load(drafter, drafter_dtype, device, "drafter")
        made = distill_drafter(target_model, drafter_model, corpus, out, config,
                               say=lambda m: err.print(f"[dim]{m}[/]", highlight=False))
    except SpecdecError as exc:
        _fail(str(exc))
    info = made.info
    before, after = info["heldout_before"], info["heldout_after"]
    err.print(f"an adapter for {info['drafter']} towards {info['target']} in {out} (--drafter distilled:{out}): "
              f"held-out acceptance {before['acceptance']:.3f} -> {after['acceptance']:.3f}, greedy agreement "
              f"{before['greedy_agreement']:.3f} -> {after['greedy_agreement']:.3f} over {info['heldout_tokens']} "
              f"positions; {info['seconds']:.0f} s", highlight=False)


@app.command("train-parallel-drafter")
def train_parallel_drafter_command(
    out: str = typer.Option(..., "--out", help="Folder to write the parallel drafter into (resumes a run stopped "
                            "there); use it as --drafter parallel:OUT."),
    drafter: str = typer.Option(registry.DEFAULT_DRAFTER, help="Drafter model to adapt (any target of its "
                                "tokenizer can use it)."),
    corpus: str = typer.Option("stdlib", help="Training text: stdlib (Python's standard library sources) or a text "
                               "file. Not the bench's prompts (humaneval, spec-bench)."),
    k: int = typer.Option(4, "-k", help="Tokens one drafter pass proposes (its own next token and k - 1 masks)."),
    tokens: int = typer.Option(98304, help="Corpus tokens to train on (a tenth more is held out)."),
    seq_len: int = typer.Option(256, "--seq-len", help="Corpus tokens per training sequence."),
    groups: int = typer.Option(64, help="Groups of k - 1 masks trained per sequence (each after a random position)."),
    rank: int = typer.Option(8, help="LoRA rank on each projection of the drafter's layers."),
    epochs: int = typer.Option(1),
    batch: int = typer.Option(2, help="Sequences per optimiser step."),
    lr: float = typer.Option(2e-3, "--lr", help="Peak learning rate (cosine schedule)."),
    seed: int = typer.Option(0),
    drafter_dtype: str = typer.Option("auto", "--drafter-dtype", help="The drafter's weights while training; "
                                      "train on the weights it will draft with. " + DRAFTER_DTYPE_HELP),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
):
    """Adapt a drafter to propose k tokens in one pass (PARD): a mask token's embedding and a LoRA
    adapter, trained on text (no target runs). Prints held-out top-1 accuracy by draft position
    before and after."""
    from ..training.fit_parallel import ParallelConfig, train_parallel_drafter

    try:
        if corpus in ("humaneval", "spec-bench"):
            raise SpecdecError(f"{corpus} is the bench's prompts: train on other text (stdlib or a text file)")
        if corpus != "stdlib" and not Path(corpus).is_file():
            raise SpecdecError(f"corpus not found: {corpus} (stdlib or a text file)")
        if drafter_dtype == "gguf":
            raise SpecdecError("adapting needs the drafter's hidden states: --drafter-dtype auto, int8, bf16 or fp32")
        if ":" in drafter:
            raise SpecdecError(f"adapt the plain drafter model, not {drafter}")
        config = ParallelConfig(k=k, tokens=tokens, seq_len=seq_len, groups=groups, rank=rank, epochs=epochs,
                                batch=batch, lr=lr, seed=seed)
        for name in ("tokens", "seq_len", "groups", "rank", "epochs", "batch"):
            if getattr(config, name) < 1:
                raise SpecdecError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(config, name)}")
        if k < 2 or seq_len <= k or not lr > 0:
            raise SpecdecError(f"-k must be >= 2, --seq-len > k and --lr > 0, got {k}, {seq_len} and {lr}")
        drafter_model = _load(drafter, drafter_dtype, device, "drafter")
        made = train_parallel_drafter(drafter_model, corpus, out, config,
                                      say=lambda m: err.print(f"[dim]{m}[/]", highlight=False))
    except SpecdecError as exc:
        _fail(str(exc))
    info = made.info
    show = lambda scores: ", ".join(f"{a:.3f}" for a in scores["top1_by_position"])  # noqa: E731
    err.print(f"a parallel drafter ({info['k']} tokens a pass) from {info['drafter']} in {out} (--drafter "
              f"parallel:{out}): held-out top-1 by position {show(info['heldout_before'])} -> "
              f"{show(info['heldout_after'])} over {info['heldout_tokens']} tokens; {info['seconds']:.0f} s",
              highlight=False)


@app.command("export-heads")
def export_heads_command(
    folder: str = typer.Argument(..., help="A folder of heads trained here (specdec train-heads --out)."),
    out: str = typer.Option(..., "--out", help="New folder to write the exported heads into."),
    fmt: str = typer.Option("medusa", "--format", help="medusa (vLLM's Medusa layout). eagle is refused: "
                            "the engines' EAGLE layer differs from ours."),
    target: Optional[str] = typer.Option(None, help="The target the heads were trained for (default: the one "
                                         "their checkpoint names); its output-head rows are copied."),
    dtype: str = typer.Option("auto", "--dtype", help="Target dtype: the exported head rows keep it."),
):
    """Write heads trained here in the layout another engine loads (vLLM's Medusa)."""
    from ..adapters.export import check_format, export_heads
    from ..adapters.medusa_heads import load_heads

    try:
        check_format(fmt)  # before minutes of loading
        heads = load_heads(folder)
        if dtype == "gguf":
            raise SpecdecError("exporting copies the target's output-head rows: use --dtype auto, bf16 or fp32")
        target_model = _load(target or heads.info.get("target") or registry.DEFAULT_TARGET, dtype, "cpu", "target",
                             exact_rows=False)
        with err.status("writing…"):
            written = export_heads(heads, target_model, out, fmt)
    except SpecdecError as exc:
        _fail(str(exc))
    err.print(f"{heads.heads.num_heads} Medusa heads for {target_model.name} in {written} (vLLM: speculative_config "
              f"{{\"method\": \"medusa\", \"model\": \"{written}\", \"num_speculative_tokens\": "
              f"{heads.heads.num_heads}}})", highlight=False)


@app.command("export")
def export_command(
    folder: str = typer.Argument(..., help="A checkpoint trained here: heads (train-heads), a distilled drafter "
                                 "(distill-drafter) or a parallel drafter (train-parallel-drafter)."),
    out: str = typer.Option(..., "--out", help="New folder to write vLLM's layout into."),
    kind: str = typer.Option(..., "--kind", help="medusa (vLLM's Medusa), drafter (a plain model folder for "
                             "vLLM's draft_model), parallel (draft_model with parallel_drafting). eagle is refused: "
                             "vLLM's EAGLE layers differ from ours."),
    target: Optional[str] = typer.Option(None, help="medusa: the target the heads were trained for (default: the "
                                         "one their checkpoint names); its output-head rows are copied."),
    dtype: str = typer.Option("auto", "--dtype", help="medusa: target dtype, the head rows keep it. drafter, "
                              "parallel: the written weights' dtype (auto: the drafter's own config)."),
):
    """Write what was trained here in the layout vLLM 0.32 loads (docs/usage.md#export-to-vllm)."""
    from ..adapters.export import check_kind

    try:
        check_kind(kind)  # before minutes of loading
    except SpecdecError as exc:
        _fail(str(exc))
    if kind == "medusa":
        return export_heads_command(folder, out, "medusa", target, dtype)
    import torch

    from ..adapters.export import check_trained_on, export_drafter, export_parallel, source_dtype

    try:
        if dtype not in ("auto", "bf16", "fp32", "fp16"):
            raise SpecdecError(f"--dtype {dtype} cannot be written: auto, bf16, fp32 or fp16")
        if kind == "drafter":
            from ..adapters.lora import load_adapter
        else:
            from ..adapters.pard import load_adapter
        checkpoint = load_adapter(folder)
        model = _load(checkpoint.info["drafter"], "fp32", "cpu", "drafter", vocab=0, kernels="stock")  # dense, whole head
        check_trained_on(model, checkpoint.info, folder)
        written_dtype = {"auto": source_dtype(checkpoint.info["drafter"]), "bf16": torch.bfloat16,
                         "fp32": torch.float32, "fp16": torch.float16}[dtype]
        with err.status("writing…"):
            write = export_drafter if kind == "drafter" else export_parallel
            written = write(model, checkpoint, out, written_dtype)
    except SpecdecError as exc:
        _fail(str(exc))
    extra = "" if kind == "drafter" else ', "parallel_drafting": true'
    k = checkpoint.info.get("k", 4)
    err.print(f"the {'distilled' if kind == 'drafter' else 'parallel'} drafter {model.name} in {written} (vLLM: "
              f"speculative_config {{\"method\": \"draft_model\", \"model\": \"{written}\", "
              f"\"num_speculative_tokens\": {k}{extra}}})", highlight=False)
