"""The install tier: the wheel installed into a fresh venv from the package index (minutes),
with only the shipped packages importable."""
