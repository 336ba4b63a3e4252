"""The serving runtime: TorchServe started, stopped and watched with real readiness
(``torchserve``, ``supervisor``), the .mar built (``mar``), the container's start
(``container``), front and metrics (``front``, ``emf``), and what a front answers when the
worker dies under a call (``interrupted``). Used by docker/serve.py, local_endpoint/ and the
Make targets. Of the engine it takes the torch-free error types (llava.errors, through
handlers.errors) and, for the container's start, the settings' checks (llava.config) and, when
a .mar is served, the checkpoint's (llava.model.checkpoint: the one import of torch, made only
then); it never imports TorchServe's Python package: it runs processes."""
