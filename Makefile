# The README's two commands are `make demo` and `make test`; both call `make setup`.
.PHONY: setup demo test test-fast lint bench clean

VENV := .venv/bin

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/gpuresa demo

lint: setup
	$(VENV)/ruff check .
	$(VENV)/ruff format --check .
	$(VENV)/mypy

# three workers (most of the suite waits on engines and daemons; a fourth on two cores made
# timing promises such as "a booking starts within 2 s" fail under the load); tests that share one thing
# of the machine run on one (tests/conftest.py); the slowest tests are listed at the end
test: lint
	$(VENV)/pytest -n 3 --dist loadgroup --durations=15

# lint and the tests that need no engine, server or daemon (under a minute, one worker a core)
test-fast: lint
	$(VENV)/pytest -m "not services" -n 2

bench: setup
	$(VENV)/python benchmarks/bench_reservations.py
	$(VENV)/python benchmarks/bench_sessions.py
	$(VENV)/python benchmarks/bench_sessions.py --engine podman
	$(VENV)/python benchmarks/bench_sessions.py --engine udocker
	$(VENV)/python benchmarks/bench_daemon.py
	$(VENV)/python benchmarks/bench_walkin.py
	$(VENV)/python benchmarks/bench_walkin.py --engine podman --sources ics --polls 5
	$(VENV)/python benchmarks/bench_walkin.py --engine udocker --sources ics --polls 5
	$(VENV)/python benchmarks/bench_outputs.py
	$(VENV)/python benchmarks/bench_homes.py
	$(VENV)/python benchmarks/bench_telemetry.py
	$(VENV)/python benchmarks/bench_grr.py
	$(VENV)/python benchmarks/bench_slurm.py
	$(VENV)/python benchmarks/bench_report.py

clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache
