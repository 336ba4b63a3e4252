"""The benchmarks (`make bench`), one module each: `python -m scripts.bench.<name>`."""
