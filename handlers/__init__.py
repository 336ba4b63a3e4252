"""TorchServe adapter for the llava engine: parse, validate, map errors, set headers, stream."""
