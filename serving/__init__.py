"""The serving runtime: TorchServe started, stopped and watched with real readiness
(``torchserve``, ``supervisor``), the .mar built (``mar``), and the container's front and
metrics (``front``, ``emf``), and what a front answers when the worker dies under a call
(``interrupted``). Used by docker/serve.py, local_endpoint/ and the Make targets. Of the
engine it takes only the torch-free error types (llava.errors, through handlers.errors); it
never imports torch or TorchServe's Python package: it runs processes."""
