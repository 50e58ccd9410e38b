# The two commands of the README. Both set up .venv on first use (scripts/setup.sh).
PY := .venv/bin/python

.PHONY: setup demo test
setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) examples/demo.py

test: setup
	$(PY) -m pytest -q -p no:cacheprovider
