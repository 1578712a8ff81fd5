PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-envs test-transformers test-torch lint bench docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python requirements-dev.txt pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-dev.txt
	# g2p-en only for its trained GRU weights (examples/g2p_en_gru.py); its own dependencies fetch NLTK data
	$(BIN)/pip install -q --no-deps g2p-en==2.1.0
	# reference implementations for the toolkit-semantics tests (their own pins would replace torch)
	$(BIN)/pip install -q --no-deps opennmt-py==3.5.1 pyonmttok==1.38.1 ctranslate2==4.8.5
	$(BIN)/pip install -q --no-deps -e .
	# the native extension (the T5 step, the beam bookkeeping) is built once per machine (about 35-60 s; cached under
	# ~/.cache/beamsearch/native), here rather than silently at the first decode
	$(BIN)/python -c "import beamsearch.extension as e; e.main()"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/beamsearch decode examples/words.txt --num-beams 5 --num-return-sequences 3 --format tsv

# tests/test_trace_browser.py draws the search-tree page in headless Chromium; where none is on PATH it skips (under
# CI=true it fails: .ci/run installs Debian's chromium first), and make test says so in one line
BROWSERS := chromium chromium-headless-shell chromium-browser google-chrome chrome

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	@for browser in $(BROWSERS); do command -v $$browser >/dev/null && exit 0; done; \
		echo "make test: tests/test_trace_browser.py skips: no Chromium on PATH to draw the search-tree page in" \
			"(.ci/install_chromium.sh or apt-get install chromium installs one)"
	$(BIN)/python -m pytest -q

# the whole suite under each thread count and instruction set the suite must pass on (docs/testing.md)
ENVS := OMP_NUM_THREADS=1 OMP_NUM_THREADS=2 ATEN_CPU_CAPABILITY=avx2 ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=AVX2

test-envs: $(STAMP)
	@for setting in $(ENVS); do echo "== $$setting"; env $$setting $(BIN)/python -m pytest -q -p no:warnings || exit 1; done

# the adapter, parity and exact-parity tests under other transformers releases than the pinned one, each in its own
# environment beside .venv with the same torch (.ci/transformers_env.sh); CI runs the oldest, a middle and the
# newest supported release (docs/testing.md lists every release tested)
VERSIONS ?= 4.57.6 5.12.1 5.24.0

test-transformers: $(STAMP)
	.ci/test_transformers.sh $(VERSIONS)

# the whole suite under other torch releases than the pinned one, each in its own environment beside .venv
# (.ci/torch_env.sh: .venv-torch/VERSION, the registry's build of that release, a few GB; the pinned transformers);
# the oldest and the newest of the range pyproject.toml declares by default (docs/testing.md lists the runs). Not in
# CI, whose time allows the pinned release only. VERSIONS="..." names others, as for test-transformers.
TORCH_VERSIONS ?= 2.6.0 2.15.0

test-torch: $(STAMP)
	.ci/test_torch.sh $(if $(filter command line environment,$(origin VERSIONS)),$(VERSIONS),$(TORCH_VERSIONS))

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples

# the main job (the embedded G2P model on CMUdict words; batches sorted by length as the CLI makes them, then in
# file order) and the t5-small-shaped case at batch 16, against transformers and CTranslate2, at each thread count
# of BENCH_THREADS (docs/performance.md); the wider grid: benchmarks/suite.py --quick
BENCH_THREADS ?= 1 2

bench: $(STAMP)
	@for threads in $(BENCH_THREADS); do \
		$(BIN)/python benchmarks/g2p_speed.py --threads $$threads || exit 1; \
		$(BIN)/python benchmarks/g2p_speed.py --threads $$threads --unsorted || exit 1; \
		$(BIN)/python benchmarks/suite.py --models t5-small-eos --beams 1,4 --batches 16 --repeats 3 \
			--threads $$threads --lengths '' --no-plot --engines hf,ours,ours-lean,ours-int8,ct2-fp32,ct2-int8 || exit 1; \
	done

# the documentation site from docs/ (mkdocs.yml) into site/ (git-ignored); any warning fails the build
# (NO_MKDOCS_2_WARNING: mkdocs-material's end-of-life banner, not a build warning)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .venv-transformers .venv-torch site
