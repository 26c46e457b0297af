# make demo: set up .venv if missing, then train the char GPT with stock ZeRO-3, dense INT4 and DGC (2 ranks).
# make test: set up .venv if missing, then run the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STEPS ?= 300
SEED ?= 1234

.PHONY: install test demo clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py requirements-test.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-test.txt
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

test: install
	$(PY) -m pytest -q tests

demo: install
	$(PY) examples/compare.py --max-steps $(STEPS) --seed $(SEED)

clean:
	rm -rf runs build *.egg-info .pytest_cache
