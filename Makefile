# Everything a fresh Debian/Ubuntu machine needs, then the job or the tests.
#   make demo   set up, then train the example on 2 local ranks
#   make test   set up, then run the test suite
PYTHON ?= python3
VENV ?= .venv
TF_VERSION ?= 2.21.*
PY := $(VENV)/bin/python
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
SYSTEM_PACKAGES := libgloo-dev bazel-bootstrap g++ python3-venv iproute2

.PHONY: demo test system native bazel clean

demo: native
	$(VENV)/bin/perseusrun -np 2 -- $(PY) examples/keras_digits.py

test: native
	$(PY) -m pytest tests -q

system:
	@missing=""; for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi

$(VENV)/.deps: | system
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "tensorflow==$(TF_VERSION)" numpy pybind11 pytest scikit-learn setuptools wheel
	touch $@

native: $(VENV)/.deps
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .

bazel: $(VENV)/.deps
	JOBS=2 PYTHON=$(PY) tools/bazel_build.sh build/bazel-out

clean:
	rm -rf build perseus_tf/*.so *.egg-info
