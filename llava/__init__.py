"""stateful-llava engine: model loading, image intake, prompts, sessions and their caches.

Importable and testable without TorchServe; ``handlers/`` adapts it to the wire.
"""
