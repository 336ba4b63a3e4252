"""``make mar``'s choices: a bad model dir is refused at once, and the model an operator
archived is the one later builds (``make serve``'s) archive again."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from serving.mar import NotACheckpoint, build_mar, check_model_dir, main
from tests.conftest import DEMO_MODEL_DIR
from tests.unit.test_makefile import dry_run


def make_mar(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "serving.mar", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def archived_model_dir(mar: Path) -> str:
    with zipfile.ZipFile(mar) as archive:
        config = yaml.safe_load(archive.read("model-config.yaml"))
    return config["handler"]["model_dir"]  # parsed: YAML folds a long path across lines


def checkpoint(path: Path) -> Path:
    return shutil.copytree(DEMO_MODEL_DIR, path)  # one the engine serves: make mar checks it


def bad_model_dir(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / kind
    if kind != "missing":
        path.mkdir()
    if kind == "no config.json":
        (path / "model.safetensors").touch()
    if kind == "no weights":
        (path / "config.json").write_text("{}")
    return path


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("missing", "not found"),
        ("empty", "is empty"),
        ("no config.json", "no config.json"),
        ("no weights", "no *.safetensors"),
    ],
)
# the model dir is checked before the weights mode counts: make test-fast runs "inside" only
@pytest.mark.parametrize(
    "weights", ["inside", pytest.param("reference", marks=pytest.mark.thorough)]
)
def test_a_bad_model_dir_is_refused_at_once(tmp_path, kind, says, weights):
    model_dir, store = bad_model_dir(tmp_path, kind), tmp_path / "store"
    refused = make_mar("--model-dir", str(model_dir), "--weights", weights, "--export-path", store)
    assert refused.returncode == 1 and len(refused.stderr.splitlines()) == 1
    assert refused.stderr.startswith("make mar: ") and says in refused.stderr
    assert str(model_dir) in refused.stderr
    assert not store.exists()  # refused before anything was built


def test_the_remembered_model_is_archived_until_another_is_given(tmp_path):
    big, other, store = checkpoint(tmp_path / "big"), checkpoint(tmp_path / "other"), tmp_path / "s"
    mar = store / "llava.mar"
    main(
        [
            "--model-dir",
            str(big),
            "--weights",
            "reference",
            "--remember",
            "--export-path",
            str(store),
        ]
    )
    main(["--remember", "--export-path", str(store)])  # `make serve` → `make mar`, no variables
    assert archived_model_dir(mar) == str(big)
    main(["--model-dir", str(other), "--weights", "reference", "--export-path", str(store)])
    assert archived_model_dir(mar) == str(other)  # built, but not remembered (like demo-mar)
    main(["--export-path", str(store)])
    assert archived_model_dir(mar) == str(big)


def test_without_a_remembered_choice_the_demo_model_goes_inside(tmp_path):
    main(["--export-path", str(tmp_path)])
    assert archived_model_dir(tmp_path / "llava.mar") == "weights"


def test_make_serve_archives_the_remembered_model_and_test_the_demo_model():
    def archive_command(target: str) -> str:
        return next(line for line in dry_run(target) if "serving.mar" in line)

    assert archive_command("serve").split("serving.mar", 1)[1].split() == ["--remember"]
    assert archive_command("test").endswith("--model-dir models/demo-llava --weights inside")
    assert "--remember" not in archive_command("test")


def test_only_the_engines_handler_gets_the_engines_checkpoint_checks(tmp_path):
    """A directory with a config.json and weights is refused as a checkpoint the engine does not
    serve; archived with another handler (a test's probe), it is not checked beyond that."""
    model_dir = bad_model_dir(tmp_path, "no weights")
    (model_dir / "model.safetensors").touch()
    refusal = re.escape(f"{model_dir} cannot be served: model type None")
    with pytest.raises(NotACheckpoint, match=refusal):
        check_model_dir(model_dir)
    check_model_dir(model_dir, engine=False)
    probe = tmp_path / "probe.py"
    probe.write_text("class Probe:\n    pass\n")
    mar = build_mar(model_dir, "reference", handler=probe, export_path=tmp_path / "store")
    assert archived_model_dir(mar) == str(model_dir)
