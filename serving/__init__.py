"""The serving runtime: TorchServe started, stopped and watched with real readiness
(``torchserve``, ``supervisor``), the .mar built (``mar``), and the container's front and
metrics (``front``, ``emf``). Used by docker/serve.py, local_endpoint/ and the Make targets.
It imports neither the engine (llava/) nor TorchServe's Python package: it runs processes."""
