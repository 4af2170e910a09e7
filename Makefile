# Two commands set everything up on a fresh machine:  make demo   and   make test
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test clean

$(STAMP): setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: on a CPU machine this is the CPU wheel, and nothing later pulls a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) -m megatron_gspo

test: install
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) runs .pytest_cache
