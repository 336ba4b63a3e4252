"""``python3 -u -m scripts.gpu_check`` as the docs write it: runs scripts/gpu/check.py."""

import sys

from scripts.gpu.check import main

if __name__ == "__main__":
    sys.exit(main())
