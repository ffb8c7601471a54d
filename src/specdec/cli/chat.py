"""`specdec chat`: the interactive session (ui/conversation.py) on loaded models."""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console

from ..models import catalogue as registry
from ..errors import SpecdecError
from .common import (app, err, _fail, check_vocab_options, _drafter_weights, _check_runs_on, _load, TARGET_DTYPE_HELP,
                     DRAFTER_DTYPE_HELP, DRAFTER_VOCAB_HELP, DRAFTER_VOCAB_CORPUS_HELP, METHOD_HELP, spec_config)


@app.command()
def chat(
    target: str = typer.Option(registry.DEFAULT_TARGET, help="Target model."),
    drafter: str = typer.Option(registry.DEFAULT_DRAFTER, help="Drafter: a model, ngram, lookup, suffix, "
                                "medusa:DIR, eagle:DIR or self-skip[:LAYERS] (as generate's)."),
    method: str = typer.Option("default", help=METHOD_HELP),
    tree: str = typer.Option("off", help="The tree method's shape (as generate's --tree)."),
    schedule: Optional[str] = typer.Option(None, help="cost, fixed, heuristic, confidence, egag (default: the "
                                           "method's)."),
    gamma: Optional[int] = typer.Option(None, help="A fixed γ (alone it picks the fixed schedule; as generate's)."),
    gamma_max: Optional[int] = typer.Option(None, "--gamma-max", help="Largest γ (default 20; egag's: γ)."),
    temperature: float = typer.Option(0.0, help="0 means greedy."),
    top_k: int = typer.Option(0, "--top-k"),
    top_p: float = typer.Option(1.0, "--top-p"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Most tokens per reply."),
    debug: bool = typer.Option(False, help="Start with the step view on."),
    dtype: str = typer.Option("auto", "--dtype", "--weights", help=TARGET_DTYPE_HELP),
    drafter_dtype: str = typer.Option("auto", help=DRAFTER_DTYPE_HELP),
    drafter_vocab: Optional[int] = typer.Option(None, "--drafter-vocab", help=DRAFTER_VOCAB_HELP),
    drafter_vocab_corpus: Optional[str] = typer.Option(None, "--drafter-vocab-corpus",
                                                       help=DRAFTER_VOCAB_CORPUS_HELP),
    device: str = typer.Option("auto"),
):
    """Chat interactively; /help lists the commands that switch method, drafter, schedule, sampler, debug."""
    from ..ui.conversation import ChatSession
    from ..core.samplers import Sampler

    try:
        check_vocab_options(drafter_vocab, drafter_vocab_corpus)  # before minutes of loading
        sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p)
        # the session builds its speculation lazily (outside this handler); a bad value must fail
        # here, before minutes of model loading, as one error line
        config = spec_config(method, drafter, tree, schedule=schedule, gamma=gamma, gamma_max=gamma_max)
        _check_runs_on(dtype, config)
        drafter_dtype = _drafter_weights(dtype, drafter, drafter_dtype, bool(drafter_vocab or drafter_vocab_corpus))
        target_model = _load(target, dtype, device, "target")
        if not getattr(target_model.tokenizer, "chat_template", None):
            raise SpecdecError(f"{target_model.name} has no chat template")

        def load_drafter(name: str):
            return _load(name, drafter_dtype, device, "drafter", vocab=drafter_vocab, vocab_corpus=drafter_vocab_corpus)

        session = ChatSession(target_model, load_drafter, drafter, Console(), method, schedule, gamma,
                              gamma_max, sampler, debug, max_new_tokens, tree)
        session.speculation()  # load it now: a bad name fails before the first prompt
    except SpecdecError as exc:
        _fail(str(exc))
    err.print(f"[dim]{session.describe()} — /help for commands, /quit to leave[/]", highlight=False)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            break
        if not session.handle(line):
            break
