# The two commands of the README, and a fast test loop. All set up .venv on first use (scripts/setup.sh).
PY := .venv/bin/python

.PHONY: setup demo test test-fast
setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) examples/demo.py

test: setup
	$(PY) -m pytest -q -p no:cacheprovider --durations=30

# No vLLM engine, no `vllm serve`, nothing over ~20 s, no GPU (the markers: pyproject.toml): the
# algorithm, the references, configs, checkpoints and the quick interpreted kernels; ~4 minutes on
# 2 CPU cores. `make test` above is CI's command and runs everything (its 30 slowest tests listed at the end).
test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "not engine and not slow and not gpu" --durations=10
