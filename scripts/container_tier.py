"""The container test tier: the image built and run as SageMaker runs it (``make test-container``;
``.ci/run`` runs it after ``make test``).

1. A Docker engine: the one already answering (used, left running), else ``dockerd --bridge=none
   --iptables=false`` (no bridge, no private-range addresses), installed from Debian's
   ``docker.io`` if missing, waited for at most ENGINE_START_S, stopped at the end by its pid.
   If it cannot start, one line says why and the tier is skipped (exit 0): that is the only way
   it skips.
2. The base image: ``python:3.11-slim-bookworm`` needs Docker Hub, which is not reachable
   here, so a stand-in is made once from Debian's packages (debootstrap: bookworm, minbase,
   python3, venv, CA certificates, this machine's CA bundle) and kept in the engine's image
   store (BASE); later runs reuse it.
3. The package sources this machine's pip uses that are local directories (its find-links,
   its file:// indexes) are served on loopback and given to the build as PIP_* build
   arguments, with ``--network host``: torch's CPU wheel and the local indexes reach the
   build without Docker Hub; anything else comes from the package registries.
4. The CPU flavour of the Dockerfile is built (IMAGE), then
   tests/container/test_container_image.py runs it the way SageMaker does (``docker run IMAGE
   serve``, the model under /opt/ml/model).

    python -m scripts.container_tier [--flavour cpu|cuda] [--build-only] [--run-dir DIR]
                                     [pytest args ...]

Each step prints its time; logs go to .run/container-tier/. docs/container.md §Container tier.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
RUN_DIR = ROOT / ".run" / "container-tier"  # --run-dir changes it for the whole run
IMAGE_TESTS = ROOT / "tests" / "container" / "test_container_image.py"
BASE = "stateful-llava-base:bookworm"
IMAGES = {"cpu": "stateful-llava:cpu-test", "cuda": "stateful-llava:cuda-local"}
ENGINE_START_S = 60
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# The build arguments are part of Docker's layer cache key: the same loopback port each run
# keeps the torch layer cached (another free port is taken when this one is busy).
INDEX_PORT = 38123


class Skip(Exception):
    """Docker cannot run on this machine: the tier says so in one line and is skipped."""


class Failed(Exception):
    """A step that could have worked did not: the tier fails."""


def log(message: str) -> None:
    print(f"container tier: {message}", flush=True)


def docker_answers() -> bool:
    return _quiet(["docker", "info"], timeout=20)


def _quiet(command: list[str], timeout: float) -> bool:
    try:
        return subprocess.run(command, capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def apt_install(*packages: str) -> None:
    """Debian's packages for what is missing (once per machine)."""
    log(f"installing {' '.join(packages)} (apt-get)")
    quiet = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}  # CI has no stdin
    with open(RUN_DIR / "apt.log", "wb") as out:
        for command in (["apt-get", "update"], ["apt-get", "install", "-y", *packages]):
            try:
                subprocess.run(
                    command,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    check=True,
                    timeout=900,
                    env=quiet,
                )
            except (OSError, subprocess.SubprocessError) as e:
                raise Skip(f"cannot install {' '.join(packages)}: {e}") from None


@contextlib.contextmanager
def docker_engine() -> Iterator[None]:
    """An answering engine for the duration; one started here is stopped by its pid."""
    if docker_answers():
        log("using the Docker engine already running")
        yield
        return
    if not (shutil.which("dockerd") and shutil.which("docker")):
        apt_install("docker.io")
    began = time.monotonic()
    with open(RUN_DIR / "dockerd.log", "wb") as out:
        engine = subprocess.Popen(
            ["dockerd", "--bridge=none", "--iptables=false"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        while not docker_answers():
            if engine.poll() is not None:
                raise Skip(f"dockerd exited with {engine.returncode}: {_last_line('dockerd.log')}")
            if time.monotonic() - began > ENGINE_START_S:
                raise Skip(f"dockerd did not answer within {ENGINE_START_S} s")
            time.sleep(0.5)
        log(f"started dockerd (pid {engine.pid}) in {time.monotonic() - began:.1f} s")
        yield
    finally:
        engine.terminate()  # dockerd stops its containers and containerd, then exits
        try:
            engine.wait(60)
        except subprocess.TimeoutExpired:
            engine.kill()
            engine.wait(10)


def _last_line(name: str) -> str:
    lines = (RUN_DIR / name).read_text(errors="replace").strip().splitlines()
    return lines[-1][-300:] if lines else "(no output)"


def make_base() -> None:
    """The stand-in base image, unless the engine already has it."""
    if _quiet(["docker", "image", "inspect", BASE], timeout=30):
        log(f"base {BASE} cached")
        return
    if not shutil.which("debootstrap"):
        apt_install("debootstrap")
    began = time.monotonic()
    with tempfile.TemporaryDirectory(dir=RUN_DIR) as tmp:
        rootfs = Path(tmp, "rootfs")
        _step(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-venv,ca-certificates",
                "bookworm",
                str(rootfs),
            ],
            "debootstrap.log",
        )
        # pip and apt inside the build trust what this machine trusts.
        shutil.copy(CA_BUNDLE, rootfs / CA_BUNDLE.relative_to("/"))
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            _step(
                ["docker", "import", "--change", "ENV LANG=C.UTF-8", "-", BASE],
                "import.log",
                stdin=tar.stdout,
            )
        finally:
            tar.stdout.close()
            tar.wait()
    log(f"made base {BASE} in {time.monotonic() - began:.0f} s")


def _step(command: list[str], log_name: str, **kwargs) -> None:
    with open(RUN_DIR / log_name, "wb") as out:
        run = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, **kwargs)
    if run.returncode != 0:
        raise Failed(f"{command[0]} {command[1]} failed ({run.returncode}): {_last_line(log_name)}")


def pip_sources() -> tuple[list[Path], list[Path]]:
    """The local directories among this machine's pip find-links and indexes."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    links, indexes = [], []
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        option = key.rsplit(".", 1)[-1]
        for item in value.strip("'\"").split():
            path = Path(urlsplit(item).path if item.startswith("file:") else item)
            if not path.is_absolute() or not path.is_dir():
                continue
            if option == "find-links":
                links.append(path)
            elif option in ("index-url", "extra-index-url"):
                indexes.append(path)
    return list(dict.fromkeys(links)), list(dict.fromkeys(indexes))


@contextlib.contextmanager
def served_pip_sources() -> Iterator[dict[str, str]]:
    """Serve them on loopback; yield the PIP_* build arguments that point at them."""
    links, indexes = pip_sources()
    with tempfile.TemporaryDirectory(dir=RUN_DIR) as tmp:
        urls = {"PIP_FIND_LINKS": [], "PIP_EXTRA_INDEX_URL": []}
        # An index page links to its files relatively (../../files/...): serve its parent.
        for number, path in enumerate(links):
            Path(tmp, f"l{number}").symlink_to(path)
            urls["PIP_FIND_LINKS"].append(f"l{number}/")
        for number, path in enumerate(indexes):
            Path(tmp, f"i{number}").symlink_to(path.parent)
            urls["PIP_EXTRA_INDEX_URL"].append(f"i{number}/{path.name}/")
        handler = functools.partial(_QuietFiles, directory=tmp)
        try:
            server = ThreadingHTTPServer(("127.0.0.1", INDEX_PORT), handler)
        except OSError:
            server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{server.server_address[1]}/"
        try:
            yield {
                name: " ".join(base + url for url in found) for name, found in urls.items() if found
            } | {"PIP_CERT": str(CA_BUNDLE)}
        finally:
            server.shutdown()
            server.server_close()


class _QuietFiles(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's signature)
        pass


def build(flavour: str, pip_args: dict[str, str]) -> None:
    """The Dockerfile's ``flavour`` on the stand-in base. The legacy builder: BuildKit needs
    the buildx plugin (not in Debian's docker.io 20.10) and an entitlement for host network."""
    args = {"BASE_IMAGE": BASE, "TORCH_FLAVOUR": flavour, **pip_args}
    if flavour == "cuda":  # the find-links' 2.13.0+cpu would win over PyPI's 2.13.0
        args.pop("PIP_FIND_LINKS", None)
    command = ["docker", "build", "--network", "host", "-t", IMAGES[flavour]]
    for name, value in args.items():
        command += ["--build-arg", f"{name}={value}"]
    began = time.monotonic()
    with open(RUN_DIR / f"build-{flavour}.log", "wb") as out:
        run = subprocess.run(
            [*command, str(ROOT)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "DOCKER_BUILDKIT": "0"},
        )
    if run.returncode != 0:
        raise Failed(f"docker build failed: {_last_line(f'build-{flavour}.log')}")
    size = subprocess.run(
        ["docker", "image", "inspect", "-f", "{{.Size}}", IMAGES[flavour]],
        capture_output=True,
        text=True,
    ).stdout.strip()
    log(
        f"built {IMAGES[flavour]} in {time.monotonic() - began:.0f} s "
        f"({int(size or 0) / 1e9:.2f} GB)"
    )


def run_tests(image: str, pytest_args: list[str]) -> int:
    began = time.monotonic()
    status = subprocess.call(
        [sys.executable, "-m", "pytest", "-q", str(IMAGE_TESTS), *pytest_args],
        cwd=ROOT,
        env={**os.environ, "LLAVA_TEST_IMAGE": image},
    )
    log(f"tests took {time.monotonic() - began:.0f} s")
    return status


def main(argv: list[str]) -> int:
    global RUN_DIR
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavour", choices=sorted(IMAGES), default="cpu")
    parser.add_argument("--build-only", action="store_true", help="build, run no test")
    parser.add_argument("--run-dir", type=Path, default=RUN_DIR, help="logs (and temp files)")
    args, pytest_args = parser.parse_known_args(argv)
    RUN_DIR = args.run_dir
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    try:
        with docker_engine():
            make_base()
            with served_pip_sources() as pip_args:
                build(args.flavour, pip_args)
            status = 0 if args.build_only else run_tests(IMAGES[args.flavour], pytest_args)
    except Skip as e:
        log(f"SKIPPED, Docker cannot run here: {e}")
        return 0
    except Failed as e:
        log(f"FAILED: {e}")
        return 1
    log(f"done in {time.monotonic() - began:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
