#!/usr/bin/env bash
# Sets up a virtualenv with smetric and its test tools, then runs every check: Rust format,
# clippy and tests; ruff and mypy; pytest (tests, and the benchmarks once each, untimed).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'

echo "== cargo fmt / clippy / test"
cargo fmt --all -- --check
cargo clippy --all-targets --features upstream -- -D warnings
cargo clippy --features python -- -D warnings
cargo test -q --features upstream

echo "== ruff / mypy"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy

echo "== pytest"
.venv/bin/python -m pytest -q -p no:cacheprovider --benchmark-disable "$@"
