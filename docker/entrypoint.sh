#!/bin/sh
# SageMaker starts the container as `docker run <image> serve`: run the supervisor
# (docker/serve.py → serving/container.py: TorchServe behind a /ping that is 200 only with a
# READY worker).
# Any other command runs as given, e.g. `docker run -it <image> bash` to look inside.
set -eu
if [ "${1:-}" = "serve" ]; then
    exec "${PYTHON:-python3}" "$(dirname "$0")/serve.py" "$@"
fi
exec "$@"
