"""`specdec install`, `models`, `methods`, `datastore build`: what there is to run with."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Console

from ..models import catalogue as registry
from ..errors import SpecdecError
from .common import (app, err, _fail, _tokenizer)


@app.command()
def install(names: list[str] = typer.Argument(None, help="Registry names (default: all).")):
    """Download, verify (sha256) and convert the embedded models into specdec's cache."""
    for name in names or list(registry.MODELS):
        try:
            if registry.is_installed(name):
                err.print(f"{name}: installed", highlight=False)
                continue
            with err.status(f"installing {name}…") as status:
                registry.install(name, say=lambda m: status.update(f"{name}: {m}"))
            err.print(f"{name}: installed in {registry.converted_dir(name)}", highlight=False)
        except SpecdecError as exc:
            _fail(str(exc))


@app.command("methods")
def methods_command(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: each name's config and summary."),
):
    """List the speculation methods and presets that generate, chat, serve and bench take."""
    from rich.table import Table

    from ..decoding.speculation import METHODS as REGISTRY, names, preset, summary

    if as_json:
        print(json.dumps({name: {"config": preset(name).to_dict(), "summary": summary(name),
                                 "kind": "method" if name in REGISTRY else "preset"} for name in names()},
                         ensure_ascii=False))
        return
    table = Table("name", "is", "what it does", title="methods (--method NAME; serve: speculative.method)",
                  title_justify="left")
    for name in names():
        config = {k: v for k, v in preset(name).to_dict().items() if k != "method"}
        kind = "method" if name in REGISTRY else preset(name).method + "".join(
            f", {k}={v}" for k, v in config.items())
        table.add_row(name, kind, summary(name))
    Console().print(table)
    err.print("[dim]options (--gamma, --tree-nodes, --schedule, ...) apply on top; `specdec bench --methods` also "
              "takes its peers (hf*, llama-cpp*), beam, beam-sd, sd-distilled, sd-online, sd-other-tokenizer[/]",
              highlight=False)


@app.command()
def models():
    """List the embedded models and whether they are installed."""
    from rich.table import Table

    table = Table("name", "installed", "description")
    for spec in registry.MODELS.values():
        table.add_row(spec.name, "yes" if registry.is_installed(spec.name) else "no", spec.description)
    Console().print(table)
    err.print(f"cache: {registry.home()}")


datastore_app = typer.Typer(no_args_is_help=True, help="Retrieval datastores (REST) for --drafter retrieval:DIR.")


app.add_typer(datastore_app, name="datastore")


@datastore_app.command("build")
def datastore_build(
    corpus: str = typer.Option(..., "--corpus", help="python-stdlib (this Python's standard library, whole "
                               "files), or a text file."),
    out: Path = typer.Option(..., "--out", help="Folder to write (tokens.npy, suffixes.npy, meta.json)."),
    target: str = typer.Option(registry.DEFAULT_TARGET, help="The target whose tokenizer the datastore is for "
                               "(registry name or Hugging Face directory)."),
):
    """Tokenize a corpus and write its suffix array: the datastore `--drafter retrieval:DIR` drafts from."""
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..drafters.datastore import CORPORA, build_from_corpus, corpus_documents

    try:
        if corpus not in CORPORA:
            corpus_documents(corpus)  # a missing or empty file fails before the tokenizer loads
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise SpecdecError(f"--out {out} exists and is not an empty folder; name a new one")
        tokenizer = _tokenizer(target)
        began = time.perf_counter()
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        with Progress(*columns, console=err) as progress:
            task = progress.add_task("tokenizing", total=None)

            def advance(done: int, total: int) -> None:
                progress.update(task, completed=done, total=total,
                                description="tokenizing" if done < total else "sorting suffixes")

            meta = build_from_corpus(corpus, tokenizer, len(tokenizer), out, advance)
    except SpecdecError as exc:
        _fail(str(exc))
    size = sum(f.stat().st_size for f in out.iterdir())
    err.print(f"wrote {out}: {meta['tokens']:,} tokens from {meta['documents']} documents ({meta['corpus']}), "
              f"{size / 2**20:.0f} MiB, in {time.perf_counter() - began:.0f} s", highlight=False)
