"""Build model-store/llava.mar: the handler, the llava/, handlers/ and llava_wire/ packages, the
model config and, with ``--weights inside``, the checkpoint.

Layout inside the .mar (TorchServe 0.12 extracts it to $TMPDIR/models/<uuid>/, which becomes
the worker's cwd and sys.path[0], so ``import llava`` and ``import handlers.x`` just work)::

    llava_handler.py      the --handler file, imported as a top-level module
    llava/  handlers/  llava_wire/   the packages, without __pycache__
    model-config.yaml     handler.model_dir filled in for the weights mode
    weights/              --weights inside only: the model dir's files

torch-model-archiver copies the *contents* of a directory named in --extra-files into the
archive root (llava/config.py would land as config.py), so the packages are staged under one
directory and that directory is passed. The archiver also stages in $TMPDIR/<model-name>,
deleting what is there: each run gets its own TMPDIR so parallel builds don't clobber.

``--weights reference`` copies nothing: handler.model_dir is the absolute path given, which
must exist where TorchServe runs (operators' 14 GB checkpoints stay out of the archive).
An existing .mar of the same name is overwritten. A model dir the engine does not serve is
refused in one line before anything is archived (llava.model.checkpoint: its small files
only, seconds; a handler other than the engine's, such as a test's probe, skips this).

``--remember`` (what ``make mar`` passes) records the model dir and weights mode next to the
archive (``<name>.source.json``); a later build given neither, as ``make serve``'s, archives the
same model again, so the operator's choice is what gets served. The demo, tests and
benchmarks name the demo model explicitly and leave the record alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("llava", "handlers", "llava_wire")
WEIGHTS_SUBDIR = "weights"
HANDLER = ROOT / "handlers" / "llava_handler.py"  # the engine's; a test's probe needs no checks
DEMO_CHOICE = {"model_dir": str(ROOT / "models" / "demo-llava"), "weights": "inside"}


class NotACheckpoint(ValueError):
    """The model dir is missing, empty, lacks config.json or safetensors weights, or holds a
    checkpoint the engine does not serve; ``str()`` is one line."""


def check_model_dir(model_dir: Path, *, engine: bool = True) -> None:
    """Refuse at once what cannot be served, rather than a worker failing to load it.

    ``engine``: also run the engine's checkpoint checks (llava.model.checkpoint: the small files
    only, no weight read, seconds); off for a handler other than the engine's, which serves
    whatever it likes.
    """
    if not model_dir.is_dir():
        raise NotACheckpoint(f"model dir not found: {model_dir}")
    if not any(model_dir.iterdir()):
        raise NotACheckpoint(f"model dir is empty: {model_dir}")
    if not (model_dir / "config.json").is_file():
        raise NotACheckpoint(f"no config.json in {model_dir}: not a llava-hf checkpoint dir")
    if not any(model_dir.glob("*.safetensors")):
        raise NotACheckpoint(f"no *.safetensors weights in {model_dir}")
    if engine:
        # Imported here: torch and transformers, which the cheap refusals above don't need.
        from llava.model.checkpoint import UnsupportedCheckpoint, inspect_checkpoint

        try:
            inspect_checkpoint(model_dir)
        except UnsupportedCheckpoint as e:
            raise NotACheckpoint(e.problem) from None


def choice_file(export_path: str | Path, model_name: str) -> Path:
    return Path(export_path) / f"{model_name}.source.json"


def remembered_choice(export_path: str | Path, model_name: str) -> dict[str, str]:
    """The model dir and weights mode last archived with ``--remember``, else the demo's."""
    try:
        return {**DEMO_CHOICE, **json.loads(choice_file(export_path, model_name).read_text())}
    except FileNotFoundError:
        return dict(DEMO_CHOICE)


def build_mar(
    model_dir: str | Path,
    weights: str = "inside",
    *,
    handler: str | Path = HANDLER,
    config: str | Path = ROOT / "model-config.yaml",
    export_path: str | Path = ROOT / "model-store",
    model_name: str = "llava",
) -> Path:
    """Archive and return the path of ``<export_path>/<model_name>.mar``."""
    model_dir, handler = Path(model_dir), Path(handler)
    check_model_dir(model_dir, engine=handler.resolve() == HANDLER)
    if not handler.is_file():
        raise FileNotFoundError(f"handler not found: {handler}")

    settings = yaml.safe_load(Path(config).read_text())
    inside = weights == "inside"
    settings.setdefault("handler", {})["model_dir"] = (
        WEIGHTS_SUBDIR if inside else str(model_dir.absolute())
    )
    with tempfile.TemporaryDirectory(prefix="make_mar-") as tmp:
        extra, work = Path(tmp, "extra"), Path(tmp, "work")
        work.mkdir()
        for package in PACKAGES:
            shutil.copytree(
                ROOT / package,
                extra / package,
                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
            )
        if inside:  # a link: the archiver copies through it, we don't copy the weights twice
            (extra / WEIGHTS_SUBDIR).symlink_to(model_dir.resolve(), target_is_directory=True)
        model_config = Path(tmp, "model-config.yaml")
        model_config.write_text(
            f"# Generated by serving/mar.py from {Path(config).name} (weights {weights}).\n"
            + yaml.safe_dump(settings, sort_keys=False)
        )
        Path(export_path).mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                Path(sys.executable).parent / "torch-model-archiver",
                "--model-name",
                model_name,
                "--version",
                "1.0",
                "--handler",
                handler,
                "--extra-files",
                extra,
                "--config-file",
                model_config,
                "--export-path",
                export_path,
                "--force",
            ],
            env={**os.environ, "TMPDIR": str(work)},
            check=True,
        )
    return Path(export_path) / f"{model_name}.mar"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="default: the remembered one, else demo")
    parser.add_argument("--weights", choices=["inside", "reference"], help="default: likewise")
    parser.add_argument("--remember", action="store_true", help="default for later builds")
    parser.add_argument("--handler", default=HANDLER, type=Path)
    parser.add_argument("--config", default=ROOT / "model-config.yaml", type=Path)
    parser.add_argument("--export-path", default=ROOT / "model-store", type=Path)
    parser.add_argument("--model-name", default="llava")
    args = parser.parse_args(argv)
    choice = remembered_choice(args.export_path, args.model_name)
    if args.model_dir is not None:
        choice["model_dir"] = str(args.model_dir.absolute())
    if args.weights is not None:
        choice["weights"] = args.weights
    try:
        mar = build_mar(
            choice["model_dir"],
            choice["weights"],
            handler=args.handler,
            config=args.config,
            export_path=args.export_path,
            model_name=args.model_name,
        )
    except NotACheckpoint as e:
        sys.exit(f"make mar: {e}; MODEL_DIR=<a llava-hf checkpoint dir> chooses another")
    except FileNotFoundError as e:
        parser.error(str(e))
    if args.remember:
        choice_file(args.export_path, args.model_name).write_text(json.dumps(choice) + "\n")
    size_mb = mar.stat().st_size / 1e6
    print(f"{mar}: {size_mb:.2f} MB from {choice['model_dir']} (weights {choice['weights']})")


if __name__ == "__main__":
    main()
