"""The serving plumbing with real TorchServe 0.12 processes and stand-in handlers: make_mar's
archive layout in both weight modes, start-until-READY, clean stop, crash detection, parallel
instances, and the loopback APIs closed (keys, allowed URLs, workflows). The real handler is
tested elsewhere; here it would only add load time.
"""

from __future__ import annotations

import socket
import stat
import time
import zipfile

import psutil
import pytest
import requests

from serving import torchserve
from serving.mar import build_mar
from serving.torchserve import TorchServeError, TorchServeInstance
from tests.intake_servers import LoopbackServer

pytestmark = pytest.mark.torchserve

# Answers with where the worker found llava and its weights: proves the .mar is self-contained.
# A class with an async handle, as model-config.yaml's async mode needs (handlers/llava_handler.py).
# Its load takes a moment, as a real one does: a LOAD reply that reaches 0.12's async frontend
# before the latch it counts down exists kills the worker (NullPointerException on `latch`,
# seen once in CI with an instant load; docs/serving.md §Failed loads in async mode).
PROBE_HANDLER = """
import json, os, time
import llava.errors

class Probe:
    def initialize(self, context):
        time.sleep(0.5)

    async def handle(self, data, context):
        base = context.system_properties["model_dir"]
        model_dir = os.path.join(base, context.model_yaml_config["handler"]["model_dir"])
        return [json.dumps({"llava": llava.errors.__file__, "base": base, "model_dir": model_dir,
                            "has_config": os.path.isfile(os.path.join(model_dir, "config.json"))})]
"""
CRASHING_HANDLERS = {
    "crash_import": 'raise RuntimeError("boom at import")\n',
    "crash_init": (
        "class Crash:\n"
        "    def initialize(self, context):\n"
        '        raise RuntimeError("boom in initialize")\n\n'
        "    async def handle(self, data, context):\n"
        "        return []\n"
    ),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A model store with the probe archived in both weight modes and the crashing handlers."""
    root = tmp_path_factory.mktemp("store")
    model = root / "tiny-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").touch()  # make_mar refuses a dir without weights
    (model / "__pycache__").mkdir()  # must not reach the archive
    (model / "__pycache__" / "junk.pyc").write_bytes(b"x")
    probe = root / "probe.py"
    probe.write_text(PROBE_HANDLER)
    export = root / "model-store"
    for weights in ("inside", "reference"):
        build_mar(model, weights, handler=probe, export_path=export, model_name=weights)
    for name, source in CRASHING_HANDLERS.items():
        (root / f"{name}.py").write_text(source)
        build_mar(
            model, "reference", handler=root / f"{name}.py", export_path=export, model_name=name
        )
    return export, model


def instance(tmp_path, store, name, mar) -> TorchServeInstance:
    return TorchServeInstance.on_free_ports(tmp_path / name, model_store=store[0], mar_name=mar)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def probe(ts: TorchServeInstance) -> dict:
    reply = requests.post(
        f"{ts.inference_url}/predictions/{ts.mar_name}",
        json={},
        headers=ts.auth_headers("inference"),
        timeout=30,
    )
    reply.raise_for_status()
    return reply.json()


@pytest.mark.parametrize("weights", ["inside", "reference"])
def test_mar_layout(store, weights):
    export, model = store
    with zipfile.ZipFile(export / f"{weights}.mar") as mar:
        names = set(mar.namelist())
        config = mar.read("model-config.yaml").decode()
    assert {"probe.py", "llava/__init__.py", "llava/errors.py", "handlers/__init__.py"} <= names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    assert ("weights/config.json" in names) == (weights == "inside")
    expected = "weights" if weights == "inside" else str(model)
    assert f"model_dir: {expected}\n" in config
    assert "minWorkers: 1" in config and "maxWorkers: 1" in config


def test_start_returns_when_ready_and_stop_leaves_nothing(tmp_path, store):
    ts = instance(tmp_path, store, "a", "inside")
    began = time.monotonic()
    worker = ts.start(timeout=90)
    print(f"start to READY: {time.monotonic() - began:.1f} s")
    try:
        java = ts.java_pid()
        assert [w["status"] for w in ts.workers()] == ["READY"]
        assert ts.worker_pid() == worker and psutil.Process(worker).ppid() == java
        answer = probe(ts)
        assert answer["llava"].startswith(f"{ts.tmp_dir}/models/")  # the .mar's copy, not ours
        assert answer["has_config"] and answer["model_dir"] == f"{answer['base']}/weights"
        big = requests.post(  # inline images: config.properties raises the 6.5 MB default
            f"{ts.inference_url}/predictions/inside",
            data=b'{"b64": "%s"}' % (b"A" * 8_000_000),
            headers={"Content-Type": "application/json", **ts.auth_headers("inference")},
            timeout=30,
        )
        assert big.status_code == 200
        metrics = requests.get(f"http://127.0.0.1:{ts.metrics_port}/metrics", timeout=10)
        assert metrics.ok and "# TYPE" in metrics.text  # prometheus text format
        with pytest.raises(TorchServeError, match="already running"):
            ts.start(timeout=10)
    finally:
        ts.stop()
    assert gone(java) and gone(worker) and ts.processes() == []
    ts.stop()  # stopping a stopped instance is fine


@pytest.mark.parametrize("mar", sorted(CRASHING_HANDLERS))
def test_crashing_handler_fails_start_with_log_tail(tmp_path, store, mar):
    ts = instance(tmp_path, store, "c", mar)
    began = time.monotonic()
    with pytest.raises(TorchServeError, match="crash loop") as failure:
        ts.start(timeout=60)
    assert time.monotonic() - began < 60
    assert "RuntimeError: boom" in str(failure.value)
    assert ts.java_pid() is None and ts.processes() == []


def test_start_fails_when_torchserve_exits(tmp_path, store):
    ts = instance(tmp_path, store, "p", "inside")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ts.inference_port))
        taken.listen()
        with pytest.raises(TorchServeError, match="TorchServe exited") as failure:
            ts.start(timeout=60)
    assert "Address already in use" in str(failure.value)
    assert ts.processes() == []


def test_two_instances_run_at_once(tmp_path, store):
    pair = [instance(tmp_path, store, "x", "inside"), instance(tmp_path, store, "y", "reference")]
    try:
        workers = [ts.start(timeout=120) for ts in pair]
        answers = [probe(ts) for ts in pair]
        assert workers[0] != workers[1]
        for ts, answer in zip(pair, answers, strict=True):
            assert answer["llava"].startswith(f"{ts.tmp_dir}/models/") and answer["has_config"]
        assert answers[1]["model_dir"] == str(store[1])  # reference: the absolute path given
    finally:
        for ts in pair:
            ts.stop()
    assert all(gone(pid) for pid in workers)
    assert [ts.processes() for ts in pair] == [[], []]


def test_the_loopback_apis_want_their_keys_and_fetch_no_workflow(tmp_path, store, capsys):
    """ShellTorch's path: ``POST /workflows?url=`` downloads an archive from any URL with 0.12's
    defaults, and the model API's switch does not cover workflows. Here a call without its key is
    refused (0.12: 400 ``InvalidKeyException``, not 401) and, with the management key, the URL
    matches no allowed_urls: the server behind it is never asked, the workflow store stays empty."""
    ts = instance(tmp_path, store, "k", "inside")
    war = LoopbackServer()
    war_url = war.url("/x.war")
    ts.start(timeout=90)
    try:
        assert stat.S_IMODE(ts.key_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(ts.root.stat().st_mode) == 0o700
        management = ts.auth_headers("management")
        refused = [
            requests.get(f"{ts.management_url}/models", timeout=10),
            requests.put(f"{ts.management_url}/models/inside?min_worker=2", timeout=10),
            requests.post(f"{ts.management_url}/workflows?url={war_url}", timeout=10),
            requests.post(f"{ts.inference_url}/predictions/inside", json={}, timeout=10),
            requests.get(f"{ts.inference_url}/ping", timeout=10),
            requests.get(  # the other API's key
                f"{ts.management_url}/models", headers=ts.auth_headers("inference"), timeout=10
            ),
        ]
        assert [(r.status_code, r.json()["type"]) for r in refused] == [
            (400, "InvalidKeyException")
        ] * len(refused)
        workflow = requests.post(
            f"{ts.management_url}/workflows?url={war_url}", headers=management, timeout=10
        )
        assert workflow.status_code == 404
        assert "does not match any allowed URL" in workflow.json()["message"]
        assert war.paths == [] and list(ts.workflow_store.iterdir()) == []
        assert [w["status"] for w in ts.workers()] == ["READY"]  # one worker: the scale refused
        assert probe(ts)["has_config"]
        assert torchserve.main(["auth", "inference", "--instance-dir", str(ts.root)]) == 0
        printed = capsys.readouterr().out.strip()  # what `curl -H "$(...)"` sends
        assert printed == f"Authorization: {ts.auth_headers('inference')['Authorization']}"
    finally:
        ts.stop()
        war.close()
    assert not ts.key_file.exists()
