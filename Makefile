# The two commands of the README:
#   make demo   sets everything up, then trains SSD with GS and without, and
#               shows what GS did
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
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup demo test test-all test-py312 clean

setup: $(STAMP)

$(STAMP): setup.py Makefile tools/build_frozen_wheels.py tools/chainercv_patch/_nms_gpu_post.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade 'pip>=23' 'setuptools<70' wheel
	$(PY) tools/build_frozen_wheels.py --wheel-dir $(WHEELS) --sdist-dir build/sdists
	$(PY) -m pip install -q --find-links $(WHEELS) --only-binary chainer,chainercv \
		--no-build-isolation -e '.[test]'
	@# pip keeps an installed chainercv of the same version: a rebuilt wheel
	@# (a new tools/chainercv_patch) must replace it.
	$(PY) -m pip install -q --no-deps --force-reinstall $(WHEELS)/chainercv-0.13.1-py3-none-any.whl
	@# mpi4py needs an MPI library (Debian: openmpi-bin libopenmpi-dev); the
	@# MPI tests are skipped without it.
	-$(PY) -m pip install -q 'mpi4py>=3.1' || echo 'mpi4py not installed: MPI tests will be skipped'
	if $(PY) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then \
		$(PY) -m pip install -q '$(TORCH)'; \
	else echo 'not Python 3.11: PyTorch not installed, its tests will be skipped'; fi
	$(PY) -c "import gradient_scaling, chainer, chainercv; print('chainer', chainer.__version__, 'chainercv', chainercv.__version__)"
	touch $(STAMP)

# The main job: SSD with gradient scaling on the embedded data and the same
# run without scaling (CPU: a few minutes each, simulated FP8 E5M2, where
# gradients underflow), then what GS did: per-site scales, the gradient
# values lost with GS and without, result/demo/gs_vs_none.png.
# DEMO_ARGS go to both runs, e.g. DEMO_ARGS='--iteration 100'.
DEMO_ARGS ?=
demo: setup
	$(PY) scripts/demo.py --out result/demo $(DEMO_ARGS)

# pytest's exit code 5 ("no tests collected") is a failure, not a pass.
test: setup
	$(PY) -m pytest $(PYTEST_ARGS); s=$$?; \
	if [ $$s = 5 ]; then echo 'pytest collected no tests' >&2; exit 1; fi; exit $$s

test-all: setup
	$(MAKE) test PYTEST_ARGS='--run-slow $(PYTEST_ARGS)'

# The library's tests on Python 3.12 with NumPy 2 (the GPU machine's
# versions), in .venv-python3.12; .ci/run runs them where python3.12 exists.
PY312 ?= python3.12
PY312_TESTS := tests/test_formats.py tests/test_underflow.py \
	tests/test_statistics.py tests/test_hook.py tests/test_hook_chainercv.py \
	tests/test_training.py tests/test_simulation.py tests/test_s2fp8.py \
	tests/test_compat.py tests/test_nms_gpu_post.py \
	tests/test_cuda_emulation.py tests/test_gpu_check.py \
	tests/test_step.py tests/test_link_state.py tests/test_scale_state.py tests/test_bad_steps.py \
	tests/test_histogram.py tests/test_estimators.py \
	tests/test_private_access.py tests/test_files.py tests/test_random_state.py
test-py312:
	$(MAKE) test PYTHON=$(PY312) PYTEST_ARGS='$(PY312_TESTS) $(PYTEST_ARGS)'

clean:
	rm -rf build .venv .venv-* *.egg-info
