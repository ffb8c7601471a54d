"""Which earlier occurrence, which n-gram sizes: tokens per target pass of prompt-lookup variants
(issue 12's question of why our lookup lost to transformers' on the same prompts).

Greedy, fixed γ = 5, on the default pair: every variant's output must equal the first one's (all
are lossless), so only the tokens per target pass differ. Usage:
    .venv/bin/python scripts/lookup_variants.py out.json [--max-new-tokens 48]
"""
import argparse
import json

from specdec import load, speculative_generate
from specdec.bench.datasets import load_prompts
from specdec.drafters import LookupDrafter, make_tree_drafter

VARIANTS = {
    "ours: latest, n=3..1": lambda: LookupDrafter(3, 1),
    "transformers' rule: earliest, n=2..1": lambda: LookupDrafter(2, 1, earliest=True),
    "latest, n=2..1": lambda: LookupDrafter(2, 1),
    "earliest, n=3..1": lambda: LookupDrafter(3, 1, earliest=True),
    "tree-lookup (trie of latest, earliest, others)": lambda: make_tree_drafter("lookup", None),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    target = load("qwen2.5-coder-1.5b")
    prompts = load_prompts("spec-bench", 1) + load_prompts("humaneval", 2)
    rows = {name: [] for name in VARIANTS}
    for prompt in prompts:
        ids = target.encode(prompt.text, chat=prompt.dataset == "spec-bench")
        reference = None
        for name, make in VARIANTS.items():
            result = speculative_generate(ids, target, make(), gamma=5, max_new_tokens=args.max_new_tokens, seed=0)
            reference = reference or result.tokens
            assert result.tokens == reference, (name, prompt.task)
            per_pass = result.stats.new_tokens / result.stats.target_forwards
            rows[name].append({"task": prompt.task, "tokens_per_pass": per_pass})
            print(prompt.task, name, f"{per_pass:.2f}", flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
