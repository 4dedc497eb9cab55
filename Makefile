# Everything a fresh Debian/Ubuntu machine needs, then the job or the tests.
#   make demo   set up, then train the example on 2 local ranks
#   make docs   the documentation site (MkDocs) into build/site
#   make check  the fast tier: no multi-rank TensorFlow launch (under 5 minutes
#               from a built tree; run it before each commit)
#   make test   set up, then the whole suite: TF 2.21 (Keras 3) and, in a
#               second venv, what differs under TF 2.15 (Keras 2, tf.estimator);
#               what CI runs. What runs where: tests/tiers.py. Both tiers run
#               in parallel lanes (PERSEUS_TEST_LANES, default 3) and print a
#               timing table at the end (tools/run_tests.py).
PYTHON ?= python3
VENV ?= .venv
TF_VERSION ?= 2.21.*
VENV_OLD ?= .venv-tf215
TF_VERSION_OLD ?= 2.15.*
PY := $(VENV)/bin/python
EXAMPLES_PACKAGES := .examples-packages
# The documentation site's tools (mkdocs.yml; README says why these).
DOCS_PACKAGES := mkdocs mkdocs-material "mkdocstrings[python]"
PY_OLD := $(VENV_OLD)/bin/python
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# What building and running needs; the test suite also builds with Bazel
# (bazel-bootstrap, which brings a JDK), makes hosts out of network namespaces
# (iproute2) that run sshd (openssh-server; ssh and ssh-keygen come with it),
# and starts ranks through mpirun (openmpi-bin) and a Slurm cluster of its own
# (slurm-wlm, munge).
SYSTEM_PACKAGES := libgloo-dev g++ python3-venv
TEST_PACKAGES := bazel-bootstrap iproute2 openssh-server openmpi-bin slurm-wlm munge
NATIVE_SOURCES := $(shell find cc -name '*.cc' -o -name '*.h' -o -name '*.cu') setup.py \
    tools/build_native.py \
    tools/gen_store_protocol.py perseus_tf/common/store_protocol.py \
    tools/gen_settings.py perseus_tf/config/spec.py

.PHONY: demo check test docs ray keras-versions system system-test install-packages native native-old bazel clean cuda

demo: native
	@echo "==> Training the example on 2 local ranks (about 20 seconds)"
	PYTHONPATH=$(CURDIR)/$(EXAMPLES_PACKAGES) $(VENV)/bin/perseusrun -np 2 -- $(PY) examples/keras_digits.py

# tools/run_tests.py runs the set-up targets below as timed phases (system-test,
# native, cuda, native-old), then the test jobs of both passes.
test:
	$(PYTHON) tools/run_tests.py test

# The documentation site, into build/site (strict: what CI's tests/test_docs.py builds).
docs: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict
$(VENV)/.docs: $(VENV)/.deps
	@echo "==> Installing MkDocs into $(VENV) (under a minute)"
	$(PY) -m pip install -q $(DOCS_PACKAGES)
	touch $@

# Ray Train, for the test that runs PerseusStrategy under it (tests/test_ray.py;
# make test installs it beside the first jobs).
RAY_PACKAGES := "ray[train]==2.60.*"
ray: $(VENV)/.ray
$(VENV)/.ray: $(VENV)/.deps
	@echo "==> Installing Ray Train into $(VENV) for its test (2 to 5 minutes)"
	$(PY) -m pip install -q $(RAY_PACKAGES)
	touch $@

check: native system-test
	$(PYTHON) tools/run_tests.py check

system:
	@$(MAKE) --no-print-directory install-packages PACKAGES="$(SYSTEM_PACKAGES)"

system-test:
	@$(MAKE) --no-print-directory install-packages PACKAGES="$(SYSTEM_PACKAGES) $(TEST_PACKAGES)"

install-packages:
	@missing=""; for p in $(PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "==> Installing Debian packages:$$missing (1 to 3 minutes)"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi

# scikit-learn (the examples' digits data) goes into $(EXAMPLES_PACKAGES), put
# on PYTHONPATH only where an example runs: Keras 3 imports scikit-learn when
# it can, which costs every TensorFlow 2.21 process (hundreds in `make test`)
# 1.2 s. Its dependencies stay in the venv, where nothing imports them.
$(VENV)/.deps: | system
	@echo "==> Creating $(VENV) with TensorFlow $(TF_VERSION) and the Python packages (1 to 3 minutes; about 1 GB to download the first time)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "tensorflow==$(TF_VERSION)" numpy pybind11 pytest tensorboard setuptools wheel $(DOCS_PACKAGES)
	touch $@
$(EXAMPLES_PACKAGES)/.installed: | $(VENV)/.deps
	@echo "==> Installing scikit-learn for the examples' data into $(EXAMPLES_PACKAGES) (under a minute)"
	rm -rf $(EXAMPLES_PACKAGES)
	$(PY) -m pip install -q scikit-learn
	version=$$($(PY) -c "import importlib.metadata as m; print(m.version('scikit-learn'))") && \
	$(PY) -m pip uninstall -q -y scikit-learn && \
	$(PY) -m pip install -q --no-deps --target $(EXAMPLES_PACKAGES) "scikit-learn==$$version"
	touch $@

# Rebuilt only when a native source changed (a second `make demo` starts at once).
native: $(VENV)/.native $(EXAMPLES_PACKAGES)/.installed
$(VENV)/.native: $(VENV)/.deps $(NATIVE_SOURCES)
	@echo "==> Building the C++ runtime against $(VENV)'s TensorFlow (about 5 minutes on 2 cores from nothing, counting the files; seconds when little changed)"
	$(PY) tools/build_native.py
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

$(VENV_OLD)/.deps: | system
	@echo "==> Creating $(VENV_OLD) with TensorFlow $(TF_VERSION_OLD) (1 to 3 minutes)"
	$(PYTHON) -m venv $(VENV_OLD)
	$(PY_OLD) -m pip install -q --upgrade pip
	$(PY_OLD) -m pip install -q "tensorflow==$(TF_VERSION_OLD)" "numpy<2" pybind11 pytest scikit-learn setuptools wheel
	touch $@

native-old: $(VENV_OLD)/.native
$(VENV_OLD)/.native: $(VENV_OLD)/.deps $(NATIVE_SOURCES)
	@echo "==> Building the op library against $(VENV_OLD)'s TensorFlow (about 2 minutes)"
	$(PY_OLD) tools/build_native.py
	$(PY_OLD) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

bazel: $(VENV)/.deps system-test
	JOBS=2 PYTHON=$(PY) tools/bazel_build.sh build/bazel-out

clean:
	rm -rf build perseus_tf/*.so *.egg-info $(VENV)/.native $(VENV_OLD)/.native

# The Keras releases tests/test_keras_versions.py runs against (the oldest
# Keras 3 of each supported TF, and tf_keras), each with `pip install
# --target` into .keras-versions/<name> (about 330 MB with their NumPy);
# tests/keras_versions.py lists them.
keras-versions: $(VENV)/.deps
	@echo "==> Installing the Keras releases the tests run into .keras-versions (2 to 5 minutes; seconds once there)"
	$(PY) tests/keras_versions.py install .keras-versions

# What the tests of the CUDA build need (tests/test_cuda.py; no GPU): the
# NVRTC that TF's CUDA wheels install (it compiles the kernels for every
# architecture) and the CUDA 12 headers (cuda.h, nvrtc.h) that the driver
# declarations are checked against, into .cuda/ (about 26 MB). Nothing is
# built: `pip install` builds libperseus_cuda.so with the host compiler.
CUDA_WHEELS := nvidia-cuda-nvrtc-cu12==12.5.82 nvidia-cuda-runtime-cu12==12.5.82
cuda: .cuda/.installed-12.5
.cuda/.installed-12.5: | $(VENV)/.deps
	@echo "==> Installing CUDA 12's NVRTC and headers into .cuda for the CUDA build's tests (under a minute)"
	rm -rf .cuda
	$(PY) -m pip install -q --no-deps --target .cuda $(CUDA_WHEELS)
	touch $@
