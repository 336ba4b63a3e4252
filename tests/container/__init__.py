"""The container tier: the image built and run as SageMaker runs it (`make test-container`,
scripts/container_tier.py), and its build side checked without a Docker engine."""
