# The two commands of the README:
#   make demo   sets everything up, then trains SegNet in FP32 and in
#               simulated FP16 with GS and without, and shows what GS did
#   make test   sets everything up, then runs the test suite
# PYTHON selects the interpreter; each interpreter gets its own venv, e.g.
#   make test PYTHON=python3.12   (uses .venv-python3.12, NumPy 2)

PYTHON ?= python3
ifeq ($(PYTHON),python3)
VENV ?= .venv
else
VENV ?= .venv-$(notdir $(PYTHON))
endif
PY := $(VENV)/bin/python
WHEELS := build/wheels
# PyTorch, for the PyTorch adapter's tests: 2.13.0 is the CPU build the
# registry of these machines serves for Python 3.11 (other versions pull
# several GB of CUDA libraries); other Pythons skip the PyTorch tests.
TORCH ?= torch==2.13.0
# The frameworks GradientScaler is proven in (tests/test_torch_frameworks.py),
# installed beside $(TORCH) in one call so pip cannot replace that torch
# (they pull no other). transformers 5.25 needs `kernels` 0.19, which the
# registry does not serve: 5.24 is the newest that installs. Keep these pins
# as setup.py's 'torch-frameworks' extra has them.
TORCH_FRAMEWORKS ?= lightning==2.6.6 accelerate==1.16.0 transformers==5.24.0
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Set-up prints one line per stage; what a stage runs prints to SETUP_LOG,
# whose last lines and path are shown when a stage fails.
ifeq ($(PYTHON),python3)
SETUP_LOG ?= build/setup.log
else
SETUP_LOG ?= build/setup-$(notdir $(PYTHON)).log
endif
# stage LABEL COMMAND: says LABEL, runs COMMAND into the log, stops on a
# failure; optional LABEL COMMAND NOTE: says NOTE instead of stopping.
STAGES = stage() { echo "setup: $$1"; { eval "$$2"; } >>'$(SETUP_LOG)' 2>&1 \
	|| { s=$$?; echo "setup: failed (exit status $$s) at: $$1; the last 30 \
	lines of $(SETUP_LOG):" >&2; tail -n 30 '$(SETUP_LOG)' >&2; \
	echo "setup: failed; the whole log is $(SETUP_LOG)" >&2; exit 1; }; }; \
	optional() { echo "setup: $$1"; { eval "$$2"; } >>'$(SETUP_LOG)' 2>&1 \
	|| echo "setup: $$3 (see $(SETUP_LOG))"; }

.PHONY: setup setup-test demo test test-all test-py312 clean

setup: $(STAMP)

# What only the tests need (make demo does without): mpi4py, PyTorch and
# the frameworks of its drop-in tests (optional: 39 packages, 230 MB).
TEST_STAMP := $(VENV)/.installed-test
setup-test: $(TEST_STAMP)
$(TEST_STAMP): $(STAMP)
	@$(STAGES); \
	optional 'mpi4py (for the MPI tests)' "$(PY) -m pip install 'mpi4py>=3.1'" \
		'mpi4py not installed (it needs an MPI library, e.g. Debian: openmpi-bin libopenmpi-dev): the MPI tests will be skipped'; \
	if $(PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
		>>'$(SETUP_LOG)' 2>&1; then \
		stage 'PyTorch ($(TORCH), CPU)' "$(PY) -m pip install '$(TORCH)' ninja"; \
		optional 'Lightning, Accelerate, transformers ($(TORCH_FRAMEWORKS))' \
			"$(PY) -m pip install '$(TORCH)' $(TORCH_FRAMEWORKS)" \
			'the frameworks not installed: tests/test_torch_frameworks.py skips its Lightning, Accelerate and transformers tests'; \
	else echo 'setup: not Python 3.11: PyTorch and its frameworks not installed, their tests will be skipped'; fi; \
	touch $(TEST_STAMP)

# pip keeps an installed chainercv of the same version: a rebuilt wheel (a
# new tools/chainercv_patch) must replace it, hence --force-reinstall.
$(STAMP): setup.py Makefile tools/build_frozen_wheels.py tools/chainercv_patch/_nms_gpu_post.py
	@mkdir -p '$(dir $(SETUP_LOG))' && : >'$(SETUP_LOG)'; $(STAGES); \
	if [ -x $(PY) ]; then echo 'setup: using the venv $(VENV)'; \
	else stage 'creating the venv $(VENV)' '$(PYTHON) -m venv $(VENV)'; fi; \
	stage "pip, setuptools<70, wheel" \
		"$(PY) -m pip install --upgrade 'pip>=23' 'setuptools<70' wheel"; \
	stage 'building the Chainer and ChainerCV wheels ($(WHEELS))' \
		'$(PY) tools/build_frozen_wheels.py --wheel-dir $(WHEELS) --sdist-dir build/sdists \
		&& $(PY) -m pip download -q --only-binary :all: --no-deps --dest $(WHEELS) ninja'; \
	stage 'installing the package, Chainer and ChainerCV' \
		"$(PY) -m pip install --find-links $(WHEELS) --only-binary chainer,chainercv \
		--no-build-isolation -e '.[test]' && $(PY) -m pip install --no-deps \
		--force-reinstall $(WHEELS)/chainercv-0.13.1-py3-none-any.whl"; \
	stage 'checking the import' "$(PY) -c \"import gradient_scaling, chainer, chainercv; \
		print('chainer', chainer.__version__, 'chainercv', chainercv.__version__)\""; \
	touch $(STAMP); echo "setup: done, $$(tail -n 1 '$(SETUP_LOG)') (log: $(SETUP_LOG))"

# The main job: SegNet on the embedded data with the paper-scale loss, in
# FP32 and in simulated FP16 with gradient scaling and without (the three
# at once: 150 s of CPU on 2 cores), then what GS did: each run's mIoU,
# the gradient values lost with GS and without, per-site scales,
# result/demo/gs_vs_none.png (scripts/demo.py; results/demo.md).
# DEMO_ARGS go to every run, e.g. DEMO_ARGS='--seeds 0 1 2'.
DEMO_ARGS ?=
demo: setup
	$(PY) scripts/demo.py --out result/demo $(DEMO_ARGS)

# pytest's exit code 5 ("no tests collected") is a failure, not a pass.
test: setup-test
	$(PY) -m pytest $(PYTEST_ARGS); s=$$?; \
	if [ $$s = 5 ]; then echo 'pytest collected no tests' >&2; exit 1; fi; exit $$s

test-all: setup-test
	$(MAKE) test PYTEST_ARGS='--run-slow $(PYTEST_ARGS)'

# The library's tests on Python 3.12 with NumPy 2 (the GPU machine's
# versions), in .venv-python3.12; .ci/run runs them where python3.12 exists.
PY312 ?= python3.12
PY312_TESTS := tests/test_formats.py tests/test_underflow.py \
	tests/test_statistics.py tests/test_hook.py tests/test_hook_chainercv.py \
	tests/test_training.py tests/test_simulation.py tests/test_s2fp8.py \
	tests/test_compat.py tests/test_nms_gpu_post.py \
	tests/test_cuda_emulation.py tests/test_gpu_check.py \
	tests/test_faults.py tests/test_step_policy.py tests/test_link_state.py tests/test_scale_state.py tests/test_bad_steps.py \
	tests/test_histogram.py tests/test_estimators.py \
	tests/test_private_access.py tests/test_files.py tests/test_random_state.py \
	tests/test_core.py tests/test_rounding.py tests/test_lifecycle.py \
	tests/test_recipes.py tests/test_serialization.py tests/test_block_formats.py \
	tests/test_block_formats_casts.py tests/test_block_formats_recipes.py \
	tests/test_block_formats_tiling.py tests/test_lost_values.py \
	tests/test_block_simulation.py tests/test_example_data.py \
	tests/test_docstring_examples.py
test-py312:
	$(MAKE) test PYTHON=$(PY312) PYTEST_ARGS='$(PY312_TESTS) $(PYTEST_ARGS)'

clean:
	rm -rf build .venv .venv-* *.egg-info
