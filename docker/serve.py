"""The image's entrypoint (docker/entrypoint.sh serve): serving/container.py's ``serve``, with this
directory's parent (the checkout, or /opt/stateful-llava in the image) as the application
directory whose config.properties and model-config.yaml are served. Everything else, settings,
model layout, TorchServe behind the front, supervision and exit codes, is serving/container.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

from serving.container import main

APP = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], APP))
