"""``python3 -u -m scripts.gpu_probe`` as the docs write it: runs scripts/gpu/probe.py."""

import sys

from scripts.gpu.probe import main

if __name__ == "__main__":
    sys.exit(main())
