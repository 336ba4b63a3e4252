"""The serving tier: each test here starts a real TorchServe (Java frontend, Python worker) on
loopback, or the container entrypoint that does (docker/serve.py: serving/container.py)."""
