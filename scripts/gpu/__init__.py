"""The GPU check, its steps, the probe run before it and the GPU experiments (`make gpu-check`)."""
