"""The soak (`make soak`, `python -m scripts.soak`): load, faults and bad input together."""
