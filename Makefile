# `make demo` and `make test` each create .venv when missing, install what
# they need (pinned by requirements/constraints.txt) and run. Re-running is
# cheap: installs are skipped while the stamps are newer than their inputs.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
CONSTRAINTS := requirements/constraints.txt
PYTEST_ARGS ?= --durations=25

.PHONY: demo test install install-demo install-sglang install-sglang-releases install-test clean

$(PY):
	python3 -m venv $(VENV)

# torch first and alone, at the version requirements/constraints.txt pins (2.14.1),
# so the installs after it resolve against it instead of pulling another build.
# pip downloads it from the package index it is configured with (a local wheel
# directory holding other torch builds, e.g. 2.13.0+cpu, does not satisfy the pin).
# cscan.c, ctable.c: the fleet engine's native modules, built in place by the editable install.
$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) dsv4_idxk_probe/offline/fleet/cscan.c dsv4_idxk_probe/offline/fleet/ctable.c | $(PY)
	$(PIP) install -q -c $(CONSTRAINTS) torch==2.14.1 torchvision==0.29.1
	$(PIP) install -q -c $(CONSTRAINTS) -e .
	touch $@

# What only the test beds need (extra `[demo]`: NIXL, rich), kept out of the plain install
# a serving image gets.
$(VENV)/.installed-demo: $(VENV)/.installed
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[demo]'
	touch $@

# The real SGLang, without its CUDA-only dependency tree, plus the modules
# its PD and host-pool code imports and what its own servers and router need
# on a CPU machine (the SGLang rig: docs/rig.md), each pinned and --no-deps.
$(VENV)/.installed-sglang: $(VENV)/.installed requirements/sglang-imports.txt requirements/sglang-servers.txt
	$(PIP) install -q -c $(CONSTRAINTS) --no-deps sglang==0.5.23
	$(PIP) install -q -c $(CONSTRAINTS) -r requirements/sglang-imports.txt
	$(PIP) install -q --no-deps -r requirements/sglang-servers.txt
	touch $@

# The older releases the SGLang-facing tests also run on (tests/sglang_releases/):
# each wheel --no-deps into build/sglang/<release>/ with the pinned extra
# modules requirements/sglang-releases.txt names for it. A release is
# installed once and kept while its stamp is newer than that file (CI caches build/).
RELEASES_FILE := requirements/sglang-releases.txt
SGLANG_RELEASES := $(shell awk '!/^\s*(\#|$$)/ {print $$1}' $(RELEASES_FILE))
RELEASES_DIR := build/sglang
RELEASE_STAMPS := $(SGLANG_RELEASES:%=$(RELEASES_DIR)/%/.installed)

$(RELEASES_DIR)/%/.installed: $(RELEASES_FILE) | $(VENV)/.installed
	rm -rf $(@D) && mkdir -p $(@D)
	$(PIP) install -q --no-deps --no-compile --target $(@D) sglang==$* \
		$$(awk '$$1 == "$*" {for (i = 2; i <= NF; i++) print $$i}' $(RELEASES_FILE))
	touch $@

# Then the test extras and the services the tests talk to.
$(VENV)/.installed-test: $(VENV)/.installed-sglang .ci/install-test-services.sh
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[test,demo,mooncake]'
	bash .ci/install-test-services.sh
	touch $@

install: $(VENV)/.installed

install-demo: $(VENV)/.installed-demo

install-sglang: $(VENV)/.installed-sglang

install-test: $(VENV)/.installed-test

install-sglang-releases: $(RELEASE_STAMPS)

demo: $(VENV)/.installed-sglang $(VENV)/.installed-demo
	$(PY) -m dsv4_idxk_probe demo

test: $(VENV)/.installed-test $(RELEASE_STAMPS)
	DSV4_IDXK_PROBE_RELEASES_DIR=$(RELEASES_DIR) $(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(RELEASES_DIR) probe-logs .pytest_cache .hypothesis
