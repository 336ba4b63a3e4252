"""Fail the image build when the installed torch is not the flavour asked for (cuda or cpu).

A CUDA image with a CPU-only torch would start, load on the CPU and serve 100x slower, so the
production build stops here instead (docs/container.md §The image).
"""

import sys

import torch

wanted = sys.argv[1] if len(sys.argv) > 1 else "cuda"
if wanted not in ("cuda", "cpu"):
    sys.exit(f"check_torch: TORCH_FLAVOUR must be cuda or cpu, not {wanted!r}")
built_for = "cpu" if torch.version.cuda is None else "cuda"
if built_for != wanted:
    sys.exit(f"check_torch: torch {torch.__version__} is a {built_for} build, wanted {wanted}")
print(f"check_torch: torch {torch.__version__} ({built_for}, CUDA {torch.version.cuda})")
