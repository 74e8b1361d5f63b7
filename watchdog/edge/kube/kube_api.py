"""The sidecar's Kubernetes API client: REST on urllib3, JSON dicts in and out.

Why not the official `kubernetes` client: the sidecar must stay within 64 MiB resident, and that
client (pydantic models, oauthlib, requests, websocket, ...) costs about 17 MiB to import and 6 to
21 MiB more for each typed API class, for the dozen calls the sidecar makes and reads by key.
urllib3 costs about 1 MiB. The objects are the API's JSON as the server sends it (camelCase keys).

Blocking, like the calls it replaces: callers run it through `asyncio.to_thread`. Thread-safe.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import email.utils
import json
import os
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import urllib3
import yaml

JSON_TYPE = "application/json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
USER_AGENT = "gpu-watchdog"
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
# Larger answers are refused rather than held: the sidecar's largest is a page of 500 Events.
MAX_ANSWER = 32 * 2**20
POOL_SIZE = 8  # concurrent calls (the loops' threads) without "pool is full" warnings
# The server's clock as learned moves only when it differs by more than this: a `Date` header has
# whole seconds, and each answer's would otherwise move the clock back and forth within one.
CLOCK_STEADY_S = 1.0
UNSUPPORTED = "not supported by the sidecar; use a token or client certificate"


class ApiError(Exception):
    """An answer outside 2xx: `status` (its HTTP code), `reason` (the HTTP reason phrase), `body`
    (the answer's text, usually a `Status` whose `message` says why)."""

    def __init__(self, status: int | None, reason: str, body: str = "", message: str = "") -> None:
        self.status = status
        self.reason = reason
        self.body = body
        self.message = message or _status_message(body)
        super().__init__(f"HTTP {status} {reason}".strip() + (f": {self.message}" if self.message else ""))


class KubeConfigError(ValueError):
    """A kubeconfig, or the in-cluster config, the sidecar cannot use: the message names the key."""


def _status_message(body: str) -> str:
    try:
        parsed = json.loads(body)
    except ValueError:
        return body[:200]
    message = parsed.get("message") if isinstance(parsed, dict) else None
    return str(message)[:500] if message else body[:200]


def path(*segments: str | None) -> str:
    """`/a/b/c` from its segments, each quoted; a None segment is left out (an optional name)."""
    return "".join(s if i == 0 else "/" + quote(s, safe="") for i, s in enumerate(segments) if s is not None)


def parse_time(value: Any) -> float | None:
    """An RFC 3339 time (`...Z`, any number of fraction digits) as epoch seconds; None when absent
    or unreadable. A time without an offset is UTC, as the API means it."""
    if not isinstance(value, str) or not value:
        return None
    try:
        when = dt.datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        return None
    return (when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)).timestamp()


def micro_time(when: dt.datetime | float | None = None) -> str:
    """A `MicroTime` as the API server parses it (RFC 3339, always six fraction digits, UTC); `when` a
    datetime or epoch seconds (the caller's wall clock), now where None."""
    if isinstance(when, (int, float)):
        when = dt.datetime.fromtimestamp(when, dt.UTC)
    return (when or dt.datetime.now(dt.UTC)).astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def second_time(when: float) -> str:
    """Epoch seconds as RFC 3339 to the second, UTC: as the Events' notes and our annotations state
    a moment to a reader."""
    return dt.datetime.fromtimestamp(when, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class _TokenFile:
    """A bearer token read from a file, again whenever the file changes: the kubelet rotates a
    projected service-account token (about hourly), and the old one stops working."""

    def __init__(self, file: str) -> None:
        self.file = file
        self._seen: tuple[int, int, int] | None = None
        self._token = ""
        self._lock = threading.Lock()
        self.read()

    def read(self) -> str:
        try:
            st = os.stat(self.file)
        except OSError:
            return self._token  # mid-rotation (the symlink swapped): the last one read
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._seen:
            with self._lock:
                try:
                    token = Path(self.file).read_text().strip()
                except OSError:
                    return self._token
                if token:
                    self._token, self._seen = token, key
        return self._token


class KubeApi:
    """One API server: `server` (https://host:port), bearer token (`token`, or `token_file` re-read as it
    rotates) or client certificate, the server's CA (`ca_file` or `ca_data`, PEM; neither: the system's),
    `verify` False to skip TLS verification (kubeconfig `insecure-skip-tls-verify`).

    Each call has a deadline (`timeout`, else the client's): connect and answer within it, or
    TimeoutError / urllib3's timeout error. No retries here: every caller has its own policy.

    `now()` is the API server's clock, learned from its answers' `Date` header: what every record a
    sidecar writes for the workload (the Lease's slots and failures, the restart Events, placement)
    is stamped by, so that a node whose own clock is off stamps them as the others do."""

    def __init__(self, server: str, *, token: str | None = None, token_file: str | None = None,
                 ca_file: str | None = None, ca_data: str | None = None, verify: bool = True,
                 cert_file: str | None = None, key_file: str | None = None, cert_data: bytes | None = None,
                 key_data: bytes | None = None, tls_server_name: str | None = None, proxy: str | None = None,
                 timeout: float = 10.0, wall_clock: Callable[[], float] = time.time) -> None:
        parts = urlsplit(server)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise KubeConfigError(f"server {server!r}: not an http(s) URL")
        self.server = server.rstrip("/")
        self.timeout = timeout
        self.wall_clock = wall_clock
        self.clock_offset = 0.0  # the server's clock less ours, as its last answers said
        self._token = token or None
        self._token_file = _TokenFile(token_file) if token_file else None
        options: dict[str, Any] = {"maxsize": POOL_SIZE, "retries": False}
        if parts.scheme == "https":
            options["ssl_context"] = _tls_context(ca_file, ca_data, verify, cert_file, key_file, cert_data, key_data)
            options["cert_reqs"] = "CERT_REQUIRED" if verify else "CERT_NONE"
            if tls_server_name:
                options["server_hostname"] = tls_server_name
                options["assert_hostname"] = tls_server_name if verify else False
        self.pool: urllib3.PoolManager = urllib3.ProxyManager(proxy, **options) if proxy \
            else urllib3.PoolManager(**options)

    def token(self) -> str | None:
        return (self._token_file.read() or None) if self._token_file is not None else self._token

    def now(self) -> float:
        """The API server's time (ours until it first answered)."""
        return self.wall_clock() + self.clock_offset

    def learn_time(self, date: str | None) -> None:
        """An answer's `Date` header (RFC 9110, whole seconds): the server's clock, taken as the middle
        of that second; garbage or none changes nothing."""
        try:
            said = email.utils.parsedate_to_datetime(date) if date else None
        except (TypeError, ValueError):
            return
        if said is None or said.tzinfo is None:
            return
        offset = said.timestamp() + 0.5 - self.wall_clock()
        if abs(offset - self.clock_offset) > CLOCK_STEADY_S:
            self.clock_offset = offset

    # -- the verbs ------------------------------------------------------------------------------------

    def get(self, path: str, query: Mapping[str, Any] | None = None, timeout: float | None = None) -> dict[str, Any]:
        answer = self.request("GET", path, query=query, timeout=timeout)
        assert answer is not None
        return answer

    def post(self, path: str, body: Any, query: Mapping[str, Any] | None = None, timeout: float | None = None,
             parse: bool = False) -> dict[str, Any] | None:
        return self.request("POST", path, body, query, timeout=timeout, parse=parse)

    def put(self, path: str, body: Any, query: Mapping[str, Any] | None = None, timeout: float | None = None,
            parse: bool = False) -> dict[str, Any] | None:
        return self.request("PUT", path, body, query, timeout=timeout, parse=parse)

    def patch(self, path: str, body: Any, content_type: str = MERGE_PATCH, query: Mapping[str, Any] | None = None,
              timeout: float | None = None, parse: bool = False) -> dict[str, Any] | None:
        return self.request("PATCH", path, body, query, content_type, timeout, parse)

    def delete(self, path: str, query: Mapping[str, Any] | None = None, timeout: float | None = None,
               parse: bool = False) -> dict[str, Any] | None:
        return self.request("DELETE", path, query=query, timeout=timeout, parse=parse)

    def request(self, method: str, path: str, body: Any = None, query: Mapping[str, Any] | None = None,
                content_type: str = JSON_TYPE, timeout: float | None = None,
                parse: bool = True) -> dict[str, Any] | None:
        """The answer's JSON object where `parse`; else None, its body read and dropped unparsed (a
        proxy's garbage after a 2xx must not turn a write that was done into a failure). ApiError
        outside 2xx."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        params = {k: _query_value(v) for k, v in (query or {}).items() if v is not None}
        url = self.server + path + ("?" + urlencode(params) if params else "")
        headers = {"Accept": JSON_TYPE, "User-Agent": USER_AGENT}
        token = self.token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        response = self.pool.request(method, url, body=data, headers=headers, timeout=urllib3.Timeout(total=limit),
                                     retries=False, redirect=False, preload_content=False)
        self.learn_time(response.headers.get("Date"))
        ok = 200 <= response.status < 300
        try:
            raw = _read(response, deadline, limit, method, path)
        except Exception:
            response.close()  # a connection with an answer half read must not serve the next call
            if ok and not parse:
                return None  # what follows a 2xx we do not read is no failure
            raise
        finally:
            response.release_conn()
        if ok and not parse:
            return None
        text = raw.decode("utf-8", errors="replace")
        if not ok:
            raise ApiError(response.status, response.reason or "", text)
        try:
            answer = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{method} {path}: the answer is not JSON ({exc})") from None
        if not isinstance(answer, dict):
            raise ValueError(f"{method} {path}: the answer is not a JSON object")
        return answer


def _query_value(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _read(response: Any, deadline: float, limit: float, method: str, path: str) -> bytes:
    """The whole body, by the deadline: a server that trickles its answer is cut off as one that hangs."""
    chunks: list[bytes] = []
    size = 0
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{method} {path}: the answer timed out after {limit:g} s")
        chunk = response.read1(65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_ANSWER:
            raise ValueError(f"{method} {path}: the answer is larger than {MAX_ANSWER >> 20} MiB")
        chunks.append(chunk)


def _tls_context(ca_file: str | None, ca_data: str | None, verify: bool, cert_file: str | None,
                 key_file: str | None, cert_data: bytes | None, key_data: bytes | None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif ca_file or ca_data:
        try:
            ctx.load_verify_locations(cafile=ca_file, cadata=ca_data)
        except (OSError, ssl.SSLError) as exc:
            raise KubeConfigError(f"the cluster's CA ({ca_file or 'certificate-authority-data'}): {exc}") from None
    else:
        ctx.load_default_certs()
    if cert_file or cert_data:
        _load_client_cert(ctx, cert_file, key_file, cert_data, key_data)
    return ctx


def _load_client_cert(ctx: ssl.SSLContext, cert_file: str | None, key_file: str | None, cert_data: bytes | None,
                      key_data: bytes | None) -> None:
    # ssl loads a certificate from files only: inline data goes through a private folder, gone at once.
    with tempfile.TemporaryDirectory(prefix="gpu-watchdog-tls-") as folder:
        if cert_data is not None:
            cert_file = os.path.join(folder, "client.crt")
            Path(cert_file).write_bytes(cert_data)
        if key_data is not None:
            key_file = os.path.join(folder, "client.key")
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(key_data)
        assert cert_file is not None
        try:
            ctx.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            raise KubeConfigError(f"the client certificate: {exc}") from None


# -- configuration --------------------------------------------------------------------------------------


def in_cluster(timeout: float, env: Mapping[str, str] = os.environ, folder: str = SERVICE_ACCOUNT) -> KubeApi:
    """The pod's own service account: the API at KUBERNETES_SERVICE_HOST:PORT, its rotating token, the CA."""
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise KubeConfigError("in-cluster config: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT must both"
                              " be set (or name a kubeconfig in kubernetes.kubeconfig)")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    token, ca = os.path.join(folder, "token"), os.path.join(folder, "ca.crt")
    for file in (token, ca):
        if not os.path.isfile(file):
            raise KubeConfigError(f"in-cluster config: {file} does not exist (is a service-account token mounted?)")
    api = KubeApi(f"https://{host}:{port}", token_file=token, ca_file=ca, timeout=timeout)
    if not api.token():
        raise KubeConfigError(f"in-cluster config: {token} is empty")
    return api


def default_kubeconfig(env: Mapping[str, str] = os.environ) -> list[str]:
    """As kubectl finds it: $KUBECONFIG (a list, the first to name a thing wins), else ~/.kube/config."""
    listed = [p for p in env.get("KUBECONFIG", "").split(os.pathsep) if p]
    return listed or [os.path.expanduser("~/.kube/config")]


def from_kubeconfig(files: str | list[str], timeout: float) -> KubeApi:
    """The current context's cluster and user, from one kubeconfig or several merged as kubectl merges them."""
    files = [files] if isinstance(files, str) else files
    where = files[0] if len(files) == 1 else os.pathsep.join(files)
    merged: dict[str, dict[str, tuple[dict[str, Any], str]]] = {"clusters": {}, "users": {}, "contexts": {}}
    current = ""
    read = 0
    for file in files:
        try:
            text = Path(file).read_text()
        except OSError as exc:
            if len(files) > 1 and isinstance(exc, FileNotFoundError):
                continue  # kubectl skips a listed file that is not there
            raise KubeConfigError(f"kubeconfig {file}: cannot be read ({exc.strerror or exc})") from None
        try:
            doc = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise KubeConfigError(f"kubeconfig {file}: not YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(doc, dict):
            raise KubeConfigError(f"kubeconfig {file}: not a mapping")
        read += 1
        base = os.path.dirname(os.path.abspath(file))
        current = current or str(doc.get("current-context") or "")
        for section, inner in (("clusters", "cluster"), ("users", "user"), ("contexts", "context")):
            for i, entry in enumerate(doc.get(section) or []):
                if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                    raise KubeConfigError(f"kubeconfig {file}: {section}[{i}]: a mapping with a name")
                body = entry.get(inner) or {}
                if not isinstance(body, dict):
                    raise KubeConfigError(f"kubeconfig {file}: {section}[{entry['name']}].{inner}: not a mapping")
                merged[section].setdefault(entry["name"], (body, base))
    if not read:
        raise KubeConfigError(f"kubeconfig {where}: none of these files exists")
    if not current:
        raise KubeConfigError(f"kubeconfig {where}: current-context: not set")
    if current not in merged["contexts"]:
        raise KubeConfigError(f"kubeconfig {where}: current-context: no context named {current!r}")
    context, _ = merged["contexts"][current]
    cluster_name, user_name = context.get("cluster"), context.get("user")
    if cluster_name not in merged["clusters"]:
        raise KubeConfigError(f"kubeconfig {where}: contexts[{current}].context.cluster: no cluster named"
                              f" {cluster_name!r}")
    cluster, cluster_base = merged["clusters"][cluster_name]
    user, user_base = merged["users"].get(user_name, ({}, "")) if user_name else ({}, "")
    if user_name and user_name not in merged["users"]:
        raise KubeConfigError(f"kubeconfig {where}: contexts[{current}].context.user: no user named {user_name!r}")
    try:
        return _api_of(cluster, cluster_base, f"clusters[{cluster_name}].cluster", user, user_base,
                       f"users[{user_name}].user", timeout)
    except KubeConfigError as exc:
        raise KubeConfigError(f"kubeconfig {where}: {exc}") from None


def _api_of(cluster: dict[str, Any], cluster_base: str, cluster_key: str, user: dict[str, Any], user_base: str,
            user_key: str, timeout: float) -> KubeApi:
    for key in ("exec", "auth-provider", "username", "password", "as", "as-uid", "as-groups", "as-user-extra"):
        if user.get(key):
            raise KubeConfigError(f"{user_key}.{key}: {UNSUPPORTED}")
    server = cluster.get("server")
    if not isinstance(server, str) or not server:
        raise KubeConfigError(f"{cluster_key}.server: not set")
    if urlsplit(server).scheme not in ("http", "https"):
        raise KubeConfigError(f"{cluster_key}.server: {server!r} is not an http(s) URL")

    def file(section: dict[str, Any], key: str, base: str, owner: str) -> str | None:
        value = section.get(key)
        if value in (None, ""):
            return None
        if not isinstance(value, str):
            raise KubeConfigError(f"{owner}.{key}: not a path")
        full = os.path.join(base, os.path.expanduser(value))
        if not os.path.isfile(full):
            raise KubeConfigError(f"{owner}.{key}: {full} does not exist")
        return full

    def data(section: dict[str, Any], key: str, owner: str) -> bytes | None:
        value = section.get(key)
        if value in (None, ""):
            return None
        try:
            return base64.b64decode(str(value), validate=True)
        except (binascii.Error, ValueError):
            raise KubeConfigError(f"{owner}.{key}: not base64") from None

    ca_data = data(cluster, "certificate-authority-data", cluster_key)
    cert_data = data(user, "client-certificate-data", user_key)
    key_data = data(user, "client-key-data", user_key)
    cert_file = None if cert_data is not None else file(user, "client-certificate", user_base, user_key)
    key_file = None if key_data is not None else file(user, "client-key", user_base, user_key)
    if (cert_file or cert_data) and not (key_file or key_data):
        raise KubeConfigError(f"{user_key}: a client certificate without its client-key")
    token = user.get("token")
    proxy = cluster.get("proxy-url")
    if proxy is not None and not (isinstance(proxy, str) and proxy.startswith(("http://", "https://"))):
        raise KubeConfigError(f"{cluster_key}.proxy-url: only an http(s) proxy is supported by the sidecar")
    return KubeApi(server, token=str(token) if token else None,
                   token_file=None if token else file(user, "tokenFile", user_base, user_key),
                   ca_file=None if ca_data is not None else file(cluster, "certificate-authority", cluster_base,
                                                                 cluster_key),
                   ca_data=ca_data.decode("utf-8", errors="replace") if ca_data is not None else None,
                   verify=not cluster.get("insecure-skip-tls-verify"), cert_file=cert_file, key_file=key_file,
                   cert_data=cert_data, key_data=key_data, tls_server_name=cluster.get("tls-server-name") or None,
                   proxy=proxy, timeout=timeout)


def api_of(api: Any) -> KubeApi:
    """A KubeApi as it is; an official client's `ApiClient` (tests' own, which seed the emulator with it) by
    its configuration's host, token and TLS settings, without importing its package."""
    if isinstance(api, KubeApi):
        return api
    cfg = getattr(api, "configuration", None)
    host = getattr(cfg, "host", None)
    if not isinstance(host, str):
        raise TypeError(f"not a Kubernetes API client: {type(api).__name__}")
    keys = getattr(cfg, "api_key", None) or {}
    auth = keys.get("authorization") or keys.get("BearerToken")
    token = auth.split(" ", 1)[1] if isinstance(auth, str) and auth.lower().startswith("bearer ") else auth
    return KubeApi(host, token=token or None, ca_file=getattr(cfg, "ssl_ca_cert", None),
                   verify=bool(getattr(cfg, "verify_ssl", True)), cert_file=getattr(cfg, "cert_file", None),
                   key_file=getattr(cfg, "key_file", None))
