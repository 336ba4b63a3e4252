#!/usr/bin/env bash
# Fills .whl/ with the wheels `python3 -m scripts.gpu_check --steps tests` needs on a GPU machine
# that lacks them: pytest and what it imports (about 1 MB, pure Python, for Python 3.12). The
# lent H100/H200 image already had pytest 9.1.1 when it was last used (docs/testing.md §GPU check),
# so carrying is a fallback. Run here, where the package index is reachable; there, name .whl in the
# call's carry and begin the command with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
#     export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .whl
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 -d .whl \
    pytest==9.1.1 iniconfig==2.1.0 pluggy==1.6.0 packaging==25.0 pygments==2.19.2
du -sh .whl
