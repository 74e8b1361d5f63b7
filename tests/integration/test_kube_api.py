"""The sidecar's own Kubernetes API client (watchdog/edge/kube/kube_api.py): its configuration from a
kubeconfig or the pod's service account, and its calls against a plain HTTP(S) server on loopback."""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpu_watchdog.watchdog.edge.kube import kube_api
from gpu_watchdog.watchdog.edge.kube.kube import load_api_client
from gpu_watchdog.watchdog.edge.kube.kube_api import ApiError, KubeApi, KubeConfigError


def kubeconfig(path: Path, user: dict[str, Any], cluster: dict[str, Any] | None = None) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fleet",
        "clusters": [{"name": "fleet", "cluster": cluster or {"server": "https://api.example:6443"}}],
        "users": [{"name": "fleet", "user": user}],
        "contexts": [{"name": "fleet", "context": {"cluster": "fleet", "user": "fleet", "namespace": "serving"}}],
    }))
    return path


# -- configuration ---------------------------------------------------------------------------------------


def test_a_kubeconfig_with_a_token(tmp_path: Path) -> None:
    api = load_api_client(str(kubeconfig(tmp_path / "config", {"token": "abc"}, {"server": "http://127.0.0.1:1/"})),
                          3.0)
    assert (api.server, api.token(), api.timeout) == ("http://127.0.0.1:1", "abc", 3.0)


def test_a_token_file_relative_to_the_kubeconfig_is_read_again_when_it_rotates(tmp_path: Path) -> None:
    (tmp_path / "sa").mkdir()
    token = tmp_path / "sa" / "token"
    token.write_text("first\n")
    api = kube_api.from_kubeconfig(str(kubeconfig(tmp_path / "config", {"tokenFile": "sa/token"})), 5.0)
    assert api.token() == "first"
    token.write_text("second, a bit longer\n")
    assert api.token() == "second, a bit longer"
    token.unlink()  # mid-rotation: the last one read stands
    assert api.token() == "second, a bit longer"


@pytest.mark.parametrize(("user", "key"), [
    ({"exec": {"command": "aws", "apiVersion": "client.authentication.k8s.io/v1"}}, "exec"),
    ({"auth-provider": {"name": "oidc"}}, "auth-provider"),
    ({"username": "admin", "password": "x"}, "username"),
])
def test_what_the_sidecar_cannot_do_is_a_clear_error(tmp_path: Path, user: dict[str, Any], key: str) -> None:
    path = kubeconfig(tmp_path / "config", user)
    with pytest.raises(KubeConfigError) as caught:
        load_api_client(str(path), 5.0)
    assert str(caught.value) == (f"kubeconfig {path}: users[fleet].user.{key}: not supported by the sidecar;"
                                 " use a token or client certificate")


@pytest.mark.parametrize(("change", "says"), [
    (lambda doc: doc.pop("current-context"), "current-context: not set"),
    (lambda doc: doc.update({"current-context": "other"}), "no context named 'other'"),
    (lambda doc: doc["clusters"][0]["cluster"].pop("server"), "clusters[fleet].cluster.server: not set"),
    (lambda doc: doc["clusters"][0]["cluster"].update({"server": "api.example:6443"}), "is not an http(s) URL"),
    (lambda doc: doc["clusters"][0]["cluster"].update({"certificate-authority": "ca.crt"}),
     "clusters[fleet].cluster.certificate-authority:"),
    (lambda doc: doc["clusters"][0]["cluster"].update({"certificate-authority-data": "not base64!"}),
     "certificate-authority-data: not base64"),
    (lambda doc: doc["users"][0]["user"].update({"client-certificate-data": base64.b64encode(b"x").decode()}),
     "a client certificate without its client-key"),
])
def test_a_kubeconfig_it_cannot_use_names_the_key(tmp_path: Path, change: Callable[[dict[str, Any]], Any],
                                                    says: str) -> None:
    path = kubeconfig(tmp_path / "config", {"token": "abc"})
    doc = yaml.safe_load(path.read_text())
    change(doc)
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(KubeConfigError, match=r"^kubeconfig ") as caught:
        load_api_client(str(path), 5.0)
    assert says in str(caught.value)


def test_a_missing_kubeconfig_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError, match="cannot be read"):
        load_api_client(str(tmp_path / "nope"), 5.0)


def test_kubeconfig_files_listed_merge_as_kubectl_merges_them(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    first = tmp_path / "a"
    first.write_text(yaml.safe_dump({"current-context": "fleet",
                                     "users": [{"name": "fleet", "user": {"token": "t1"}}]}))
    second = kubeconfig(tmp_path / "b", {"token": "t2"}, {"server": "http://10.0.0.1:8080"})
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", f"{first}:{tmp_path / 'missing'}:{second}")
    api = load_api_client(None, 5.0)
    assert (api.server, api.token()) == ("http://10.0.0.1:8080", "t1")  # the first to name a user wins


def test_in_cluster_the_service_account_and_an_ipv6_service_address(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("sa-token")
    ca = tmp_path / "ca.crt"
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    if not make_ca(tmp_path):
        pytest.skip("no openssl to make a CA with")
    shutil.copy(tmp_path / "ca.pem", ca)
    api = kube_api.in_cluster(4.0, env=env, folder=str(tmp_path))
    assert (api.server, api.token(), api.timeout) == ("https://[fd00::1]:443", "sa-token", 4.0)
    (tmp_path / "token").write_text("rotated-token")
    assert api.token() == "rotated-token"
    (tmp_path / "token").unlink()
    with pytest.raises(KubeConfigError, match="token does not exist"):
        kube_api.in_cluster(4.0, env=env, folder=str(tmp_path))
    with pytest.raises(KubeConfigError, match="KUBERNETES_SERVICE_PORT"):
        kube_api.in_cluster(4.0, env={"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, folder=str(tmp_path))


def test_times_as_the_api_writes_and_reads_them() -> None:
    assert kube_api.parse_time("2026-01-02T03:04:05Z") == 1767323045.0
    assert kube_api.parse_time("2026-01-02T03:04:05.123456789Z") == pytest.approx(1767323045.123456)
    assert kube_api.parse_time("2026-01-02T03:04:05") == 1767323045.0  # no offset: UTC
    assert kube_api.parse_time(None) is None and kube_api.parse_time("yesterday") is None
    stamp = kube_api.micro_time()
    assert stamp.endswith("Z") and len(stamp.split(".")[1]) == 7  # always six digits: MicroTime needs them
    assert kube_api.path("/api/v1/namespaces", "a b", "pods", None) == "/api/v1/namespaces/a%20b/pods"


# -- calls ------------------------------------------------------------------------------------------------------


Handler = Callable[[http.server.BaseHTTPRequestHandler, bytes], tuple[int, bytes]]


@contextlib.contextmanager
def serving(answer: Handler, tls: ssl.SSLContext | None = None) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []

    class Serve(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _any(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append({"method": self.command, "path": self.path, "headers": dict(self.headers),
                         "body": json.loads(body) if body else None})
            code, out = answer(self, body)
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

        def log_message(self, *args: Any) -> None:
            return None

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Serve)
    server.daemon_threads = True
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{'https' if tls else 'http'}://{'localhost' if tls else '127.0.0.1'}:{server.server_port}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_json_in_and_out_with_the_token_and_the_query() -> None:
    def answer(req: Any, body: bytes) -> tuple[int, bytes]:
        return 200, json.dumps({"kind": "Lease", "echo": json.loads(body) if body else None}).encode()

    with serving(answer) as (url, seen):
        api = KubeApi(url, token="t0k")
        got = api.request("PUT", "/apis/coordination.k8s.io/v1/namespaces/ns/leases/l", {"a": 1},
                          {"dryRun": "All", "limit": 5, "continue": None})
        assert got == {"kind": "Lease", "echo": {"a": 1}}
        assert api.patch("/api/v1/nodes/n", {"spec": {}}, kube_api.STRATEGIC_MERGE_PATCH) is None  # not parsed
    put, patch = seen
    assert put["path"] == "/apis/coordination.k8s.io/v1/namespaces/ns/leases/l?dryRun=All&limit=5"
    assert put["headers"]["Authorization"] == "Bearer t0k" and put["headers"]["Content-Type"] == "application/json"
    assert patch["headers"]["Content-Type"] == "application/strategic-merge-patch+json"


def test_an_answer_outside_2xx_is_an_api_error_with_its_status_and_message() -> None:
    status = {"kind": "Status", "status": "Failure", "reason": "Conflict", "code": 409,
              "message": "the object has been modified"}
    with serving(lambda req, body: (409, json.dumps(status).encode())) as (url, _):
        with pytest.raises(ApiError) as caught:
            KubeApi(url).get("/x")
    exc = caught.value
    assert (exc.status, exc.reason, exc.message) == (409, "Conflict", "the object has been modified")
    assert str(exc) == "HTTP 409 Conflict: the object has been modified" and json.loads(exc.body) == status


def test_garbage_after_a_2xx_fails_only_a_call_that_reads_its_answer() -> None:
    with serving(lambda req, body: (201, b'{"kind": "Status", "broken": ')) as (url, _):
        api = KubeApi(url)
        assert api.post("/events", {"kind": "Event"}) is None
        with pytest.raises(ValueError, match="not JSON"):
            api.get("/pod")


def test_a_hung_api_is_an_error_within_the_timeout() -> None:
    release = threading.Event()

    def hang(req: Any, body: bytes) -> tuple[int, bytes]:
        release.wait(10)
        return 200, b"{}"

    with serving(hang) as (url, _):
        start = time.monotonic()
        with pytest.raises(Exception, match="timed out"):
            KubeApi(url, timeout=5.0).get("/hang", timeout=0.3)
        assert time.monotonic() - start < 2
        release.set()


def make_ca(folder: Path) -> bool:
    """A CA (ca.pem) and a server certificate for localhost it signed (server.pem, server.key)."""
    if shutil.which("openssl") is None:
        return False

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (folder / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "server.pem", "-days", "2", "-extfile", "san.ext")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "client.key", "-out", "client.csr", "-subj",
        "/CN=system:serviceaccount:serving:gpu-watchdog")
    run("x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "client.pem", "-days", "2")
    return True


def test_tls_against_the_clusters_ca_from_a_file_or_inline(tmp_path: Path) -> None:
    if not make_ca(tmp_path):
        pytest.skip("no openssl to make a CA with")
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(tmp_path / "server.pem", tmp_path / "server.key")
    with serving(lambda req, body: (200, b'{"kind": "Pod"}'), tls) as (url, _):
        ca_data = base64.b64encode((tmp_path / "ca.pem").read_bytes()).decode()
        for cluster in ({"server": url, "certificate-authority": "ca.pem"},
                        {"server": url, "certificate-authority-data": ca_data},
                        {"server": url, "insecure-skip-tls-verify": True}):
            api = kube_api.from_kubeconfig(str(kubeconfig(tmp_path / "config", {"token": "t"}, cluster)), 5.0)
            assert api.get("/api/v1/namespaces/ns/pods/p") == {"kind": "Pod"}
        # Without the cluster's CA the server is not trusted.
        with pytest.raises(Exception, match=r"(?i)certificate"):
            kube_api.from_kubeconfig(str(kubeconfig(tmp_path / "config", {"token": "t"}, {"server": url})),
                                     5.0).get("/x")


def test_a_client_certificate_inline_or_from_files(tmp_path: Path) -> None:
    if not make_ca(tmp_path):
        pytest.skip("no openssl to make a CA with")
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(tmp_path / "server.pem", tmp_path / "server.key")
    tls.load_verify_locations(tmp_path / "ca.pem")
    tls.verify_mode = ssl.CERT_REQUIRED  # no certificate, no answer

    def inline(name: str) -> str:
        return base64.b64encode((tmp_path / name).read_bytes()).decode()

    with serving(lambda req, body: (200, b'{"kind": "Node"}'), tls) as (url, _):
        cluster = {"server": url, "certificate-authority": "ca.pem"}
        for user in ({"client-certificate": "client.pem", "client-key": "client.key"},
                     {"client-certificate-data": inline("client.pem"), "client-key-data": inline("client.key")}):
            api = kube_api.from_kubeconfig(str(kubeconfig(tmp_path / "config", user, cluster)), 5.0)
            assert api.get("/api/v1/nodes/n") == {"kind": "Node"} and api.token() is None


def test_its_clock_is_the_api_servers_learned_from_each_answers_date() -> None:
    """A node whose clock runs 5 minutes slow: after one answer, `now()` is the server's (its `Date`
    header, whole seconds), which the workload's records are stamped by."""
    with serving(lambda req, body: (200, b"{}")) as (url, _):
        api = KubeApi(url, wall_clock=lambda: time.time() - 300)
        assert abs(api.now() - (time.time() - 300)) < 1  # nothing learned yet: its own
        api.get("/api/v1/namespaces/ns/pods/p")
        assert abs(api.now() - time.time()) < 1.5


def test_a_date_it_cannot_read_changes_nothing_and_one_within_the_second_moves_nothing() -> None:
    api = KubeApi("http://127.0.0.1:1", wall_clock=lambda: 1_000_000.0)
    for garbage in (None, "", "yesterday", "Mon, 32 Foo 2026 99:99:99 GMT", "Mon, 07 Dec 2026 02:00:00"):
        api.learn_time(garbage)
        assert api.now() == 1_000_000.0, garbage
    api.learn_time("Mon, 12 Jan 1970 14:00:00 GMT")  # 1_000_800 s: 800.5 s ahead, the middle of its second
    assert api.now() == 1_000_800.5
    api.learn_time("Mon, 12 Jan 1970 14:00:01 GMT")  # the next second: within the steady bound
    assert api.now() == 1_000_800.5
