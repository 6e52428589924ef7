"""host.serving on a real local Ray instance: HTTP on 127.0.0.1, answers checked against onnxruntime.

One Ray instance and one two-replica deployment for the whole module (Ray takes ~10 s to start on
a small machine); every client call has a timeout and every wait a deadline, and the fixture shuts
Serve and Ray down. CI installs the `serve` extra, so these run there; they skip only when Ray
cannot be imported.
"""

from __future__ import annotations

import io
import re
import socket
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed (pip install -e '.[serve]')")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[serve]')")
requests = pytest.importorskip("requests", reason="requests comes with ray[serve]; not installed")

from host.cli import zoo  # noqa: E402
from host.serving import ephost_deployment  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FEATURES, HIDDEN = 16, 32
NAME = "mlp"
TIMEOUT_S = 60          # one HTTP call
CLIENTS, PER_CLIENT = 8, 50


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("serve") / f"{NAME}.onnx"
    onnx.save(zoo.mlp(layers=3, hidden=HIDDEN, in_features=FEATURES, dynamic_batch=True, seed=3), path)
    return path


@pytest.fixture(scope="module")
def reference(model_path):
    """onnxruntime's CPU session on the same file: the answer every served request must match."""
    sess = onnxruntime.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    return lambda x: sess.run(None, {"input": x})[0]


@pytest.fixture(scope="module")
def url(model_path):
    port = _free_port()
    # Workers import this checkout's `host`, not an installed copy of another one.
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = ephost_deployment(model_path, max_batch_size=8, batch_wait_timeout_s=0.02, buckets=True,
                                num_replicas=2, ray_actor_options={"num_cpus": 0.5})
        serve.run(app, name=NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _json_body(request_id: str, x: np.ndarray) -> dict:
    return {"id": request_id, "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                          "data": x.reshape(-1).tolist()}]}


def _npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def infer(http, url: str, request_id: str, x: np.ndarray, binary: bool):
    """One request; returns (status, request id answered, output or error text, replica)."""
    target = f"{url}/v2/models/{NAME}/infer"
    if binary:
        r = http.post(target, data=_npz(input=x), timeout=TIMEOUT_S,
                      headers={"Content-Type": "application/x-npz", "X-Request-Id": request_id})
        if r.status_code != 200:
            return r.status_code, None, r.text, None
        with np.load(io.BytesIO(r.content)) as archive:
            out = archive["output"]
        return 200, r.headers["x-ephost-request-id"], out, r.headers["x-ephost-replica"]
    r = http.post(target, json=_json_body(request_id, x), timeout=TIMEOUT_S)
    if r.status_code != 200:
        return r.status_code, None, r.text, None
    doc = r.json()
    (out,) = doc["outputs"]
    assert out["datatype"] == "FP32"
    return 200, doc["id"], np.asarray(out["data"], np.float32).reshape(out["shape"]), doc["parameters"]


def run_clients(url: str, on_answer=None):
    """CLIENTS threads x PER_CLIENT requests of 1..3 rows (every 5th as .npz); one record per request."""
    records, lock = {}, threading.Lock()

    def client(c: int):
        rng = np.random.default_rng(c)
        with requests.Session() as http:
            for i in range(PER_CLIENT):
                rid = f"c{c}-r{i}"
                x = rng.standard_normal((int(rng.integers(1, 4)), FEATURES)).astype(np.float32)
                started = time.monotonic()
                try:
                    status, answered_id, value, meta = infer(http, url, rid, x, binary=i % 5 == 4)
                except requests.RequestException as exc:  # a dropped connection is an error the client sees
                    status, answered_id, value, meta = -1, None, repr(exc), None
                with lock:
                    assert rid not in records
                    records[rid] = (x, status, answered_id, value, meta, started, time.monotonic())
                if on_answer is not None:
                    on_answer(len(records))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a client did not finish within 300 s"
    assert len(records) == CLIENTS * PER_CLIENT
    return records


def check_answers(records: dict, reference) -> list:
    """Every 200 answer is for its own request and equals onnxruntime's; returns the other records."""
    failed = []
    for rid, (x, status, answered_id, value, _meta, *_) in records.items():
        if status != 200:
            failed.append((rid, status, value))
            continue
        assert answered_id == rid
        np.testing.assert_allclose(value, reference(x), rtol=1e-4, atol=1e-5, err_msg=rid)
    return failed


# ---- tests ---------------------------------------------------------------------------------------
def test_health_and_metadata(url):
    assert requests.get(f"{url}/v2/health/ready", timeout=TIMEOUT_S).json() == {"ready": True}
    meta = requests.get(f"{url}/v2/models/{NAME}", timeout=TIMEOUT_S).json()
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, FEATURES]}]
    assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, HIDDEN]}]
    r = requests.get(f"{url}/v2/models/other", timeout=TIMEOUT_S)
    assert r.status_code == 404
    assert r.json()["error"] == "NotFound: model 'other' is not served here; served: ['mlp']"


def _good(http, url, reference, rid):
    x = np.full((2, FEATURES), 0.25, np.float32)
    status, answered, value, _ = infer(http, url, rid, x, binary=False)
    assert (status, answered) == (200, rid)
    np.testing.assert_allclose(value, reference(x), rtol=1e-4, atol=1e-5)


def _tensor(**overrides) -> dict:
    tensor = {"name": "input", "shape": [1, FEATURES], "datatype": "FP32", "data": [0.5] * FEATURES}
    tensor.update(overrides)
    return tensor


BAD_JSON = {
    "unknown input": ({"inputs": [_tensor(name="x")]},
                      r"^InvalidArgument: unknown input name\(s\) \['x'\]; model inputs: \['input'\]$"),
    "missing input": ({"inputs": []}, r"^InvalidArgument: missing input\(s\) \['input'\]; model inputs: \['input'\]$"),
    "wrong dtype": ({"inputs": [_tensor(datatype="INT64", data=[1] * FEATURES)]},
                    r"^InvalidArgument: input 'input': expected datatype FP32 \(float32\), got INT64 \(int64\)$"),
    "wrong rank": ({"inputs": [_tensor(shape=[FEATURES])]},
                   r"^InvalidArgument: input 'input': expected rank 2 \(shape \[-1, 16\]\), got rank 1 \(shape \[16\]\)$"),
    "wrong dimension": ({"inputs": [_tensor(shape=[2, 8])]},
                        r"^InvalidArgument: input 'input': dimension 1 must be 16, got 8 "),
    "data does not fill the shape": ({"inputs": [_tensor(shape=[2, FEATURES])]},
                                     r"^InvalidArgument: input 'input': shape \[2, 16\] holds 32 elements; data has 16$"),
    "unknown datatype": ({"inputs": [_tensor(datatype="FLOAT")]},
                         r"^InvalidArgument: datatype 'FLOAT' is not a KServe v2 datatype; allowed: \["),
    "data of the wrong kind": ({"inputs": [_tensor(data=["a"] * FEATURES)]},
                               r"^InvalidArgument: input 'input': data cannot be read as FP32 "),
    "dict form, unknown input": ({"inputs": {"x": {"shape": [1], "datatype": "FP32", "data": [1.0]}}},
                                 r"^InvalidArgument: unknown input name\(s\) \['x'\]"),
    "unknown output": ({"inputs": [_tensor()], "outputs": [{"name": "nope"}]},
                       r"^InvalidArgument: unknown output name\(s\) \['nope'\]; model outputs: \['output'\]$"),
}


@pytest.mark.parametrize("kind", sorted(BAD_JSON))
def test_bad_json_requests_get_400_and_the_replica_keeps_serving(url, reference, kind):
    body, message = BAD_JSON[kind]
    with requests.Session() as http:
        r = http.post(f"{url}/v2/models/{NAME}/infer", json=body, timeout=TIMEOUT_S)
        assert r.status_code == 400
        assert r.json()["error_type"] == "InvalidArgument"
        assert re.match(message, r.json()["error"]), r.json()["error"]
        _good(http, url, reference, f"after-{kind}")


BAD_BODIES = {
    "malformed JSON": (b'{"inputs": [', "application/json", r"^InvalidArgument: request body is not valid JSON \("),
    "JSON without inputs": (b'{"id": "1"}', "application/json",
                            r"^InvalidArgument: request body must be a JSON object with \"inputs\"; got \['id'\]$"),
    "bad binary body": (b"not an npz", "application/x-npz",
                        r"^InvalidArgument: request body is not a readable \.npz archive \("),
    "binary, wrong dtype": (_npz(input=np.zeros((1, FEATURES), np.float64)), "application/x-npz",
                            r"^InvalidArgument: input 'input': expected datatype FP32 \(float32\), got FP64 \(float64\)$"),
    "binary, unknown input": (_npz(x=np.zeros((1, FEATURES), np.float32)), "application/x-npz",
                              r"^InvalidArgument: unknown input name\(s\) \['x'\]"),
}


@pytest.mark.parametrize("kind", sorted(BAD_BODIES))
def test_bad_bodies_get_400_and_the_replica_keeps_serving(url, reference, kind):
    body, content_type, message = BAD_BODIES[kind]
    with requests.Session() as http:
        r = http.post(f"{url}/v2/models/{NAME}/infer", data=body, headers={"Content-Type": content_type},
                      timeout=TIMEOUT_S)
        assert r.status_code == 400
        assert re.match(message, r.json()["error"]), r.json()["error"]
        _good(http, url, reference, f"after-{kind}")


def test_concurrent_clients_get_onnxruntime_answers_in_padded_batches(url, reference):
    """8 clients x 50 requests, with every bad-request kind sent amid the load: each bad one gets 400,
    every good answer is its own request's and equals onnxruntime's, and batches form."""
    bad = iter([body for body, _ in BAD_JSON.values()] + [BAD_BODIES[k][:2] for k in sorted(BAD_BODIES)])
    statuses, lock = [], threading.Lock()

    def send_bad(done: int):
        if done % 25:
            return
        with lock:
            body = next(bad, None)
        if body is None:
            return
        if isinstance(body, tuple):
            r = requests.post(f"{url}/v2/models/{NAME}/infer", data=body[0], headers={"Content-Type": body[1]},
                              timeout=TIMEOUT_S)
        else:
            r = requests.post(f"{url}/v2/models/{NAME}/infer", json=body, timeout=TIMEOUT_S)
        with lock:
            statuses.append(r.status_code)

    records = run_clients(url, on_answer=send_bad)
    assert check_answers(records, reference) == []
    assert statuses == [400] * (len(BAD_JSON) + len(BAD_BODIES))
    metas = [r[4] for r in records.values() if isinstance(r[4], dict)]  # the JSON answers' parameters
    # Batches were formed: some answers came from a batch of several requests ...
    assert max(m["batch_requests"] for m in metas) > 1
    # ... and every run was padded to a bucket (powers of two up to 8).
    assert {m["run_rows"] for m in metas} <= {1, 2, 4, 8}
    stats = requests.get(f"{url}/v2/models/{NAME}/stats", timeout=TIMEOUT_S).json()
    assert stats["buckets"] == [1, 2, 4, 8]
    assert stats["padded_rows"] > 0  # requests of 3 rows alone, or 1+2+2 rows, were padded
    assert stats["batches"] < stats["requests"]  # this replica joined requests into fewer batches
    assert sum(int(k) * v for k, v in stats["batch_sizes"].items()) == stats["requests"]


def _replicas_seen(url: str, tries: int, want: int = 2) -> set[str]:
    """Replica names that answered probes: up to `tries` rounds of 4 concurrent probes, stopping
    once `want` names are seen (one at a time, Ray's router may keep choosing the same replica; a
    loaded machine may also bring the second replica up late)."""
    seen: set[str] = set()

    def probe(i: int) -> None:
        with requests.Session() as http:
            status, _, _, meta = infer(http, url, f"probe-{i}", np.ones((1, FEATURES), np.float32), binary=False)
            if status == 200:
                seen.add(meta["replica"])

    for r in range(tries):
        threads = [threading.Thread(target=probe, args=(4 * r + k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if len(seen) >= want:
            break
        time.sleep(0.1)
    return seen


def test_a_replica_killed_mid_load_is_replaced_and_only_its_requests_fail(url, reference):
    before = _replicas_seen(url, 20)
    assert len(before) == 2
    victim = sorted(before)[0]
    killed_at = []

    def kill_once(done: int):
        if done == 60:  # mid-load: 60 of 400 answered, 8 clients in flight
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
            killed_at.append(time.monotonic())

    records = run_clients(url, on_answer=kill_once)
    assert killed_at
    failed = check_answers(records, reference)  # no wrong answer, no answer to another request
    # Only requests in flight when the replica died may fail: each client holds one at a time.
    assert len(failed) <= CLIENTS, failed
    for rid, status, text in failed:
        assert status != 400, (rid, text)  # an error, not a verdict on the request
        started, ended = records[rid][5], records[rid][6]
        assert started <= killed_at[0] + 10 and ended >= killed_at[0], (rid, status, text)
    # Ray replaces the replica: within a deadline, two replicas answer again, one of them new.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = _replicas_seen(url, 10)
        if len(now) == 2 and victim not in now:
            break
        time.sleep(0.25)  # a poll: each round already waits for HTTP answers
    assert victim not in now and len(now) == 2, now


def test_ephost_serve_redeploys_the_application_with_its_options(url, model_path, reference, capsys):
    """Last in the module: `ephost serve --detach` in this process (Ray already up) replaces the app."""
    from host.cli import app as cli

    port = url.rsplit(":", 1)[1]
    assert cli.main(["serve", str(model_path), "--replicas", "1", "--max-batch-size", "1", "--buckets", "off",
                     "--num-cpus", "0.5", "--port", port, "--detach"]) == 0
    assert f"serving {NAME}: POST http://127.0.0.1:{port}/v2/models/{NAME}/infer" in capsys.readouterr().out
    deadline, seen = time.monotonic() + 120, set()
    while time.monotonic() < deadline:  # the old replicas drain away; one new one remains
        seen = _replicas_seen(url, 6)
        stats = requests.get(f"{url}/v2/models/{NAME}/stats", timeout=TIMEOUT_S).json()
        if len(seen) == 1 and stats["buckets"] == []:
            break
        time.sleep(0.25)  # a poll: each round already waits for HTTP answers
    assert len(seen) == 1 and stats["buckets"] == [], (seen, stats)
    with requests.Session() as http:
        x = np.ones((3, FEATURES), np.float32)
        status, _, value, meta = infer(http, url, "cli", x, binary=False)
    assert status == 200 and meta["run_rows"] == 3  # no bucket: 3 rows run as 3
    np.testing.assert_allclose(value, reference(x), rtol=1e-4, atol=1e-5)
