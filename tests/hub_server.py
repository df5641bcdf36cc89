"""A local imitation of the Hugging Face Hub, for testing hub sources with the real huggingface_hub client.

The server is a ``ThreadingHTTPServer`` on 127.0.0.1 (port 0) in a daemon thread of the test process; point the
client at it with ``HF_ENDPOINT=server.url`` (huggingface_hub reads it at import: run the CLI in a subprocess).
A repo is made from a folder (a fixture checkpoint): ``server.push(repo_id, folder, branch)`` commits the folder's
files as they are now and moves ``branch`` to that commit; pushing another folder moves the branch, as a commit on
the hub does. The folder must not change while it is served (bytes are read from it on each request).

Endpoints, and the huggingface_hub 2.4.0 calls that use them:

- ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}``: ``HfApi.model_info`` / ``repo_info``
  (ckpt-tool resolves a revision to its commit; ``snapshot_download`` for a branch; ``HfFileSystem.resolve_path``).
  ``sha``, and ``siblings`` (``rfilename``; with ``?blobs=true`` also size, blobId and lfs).
- ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=``: ``HfApi.list_repo_tree`` (``snapshot_download`` lists
  the commit's files before filtering them with ``allow_patterns``; ``HfFileSystem.ls``). One page, no ``Link``.
- ``POST /api/models/{repo}/paths-info/{rev}`` (form ``paths=...``): ``HfApi.get_paths_info`` (``HfFileSystem.info``).
- ``HEAD /{repo}/resolve/{rev}/{path}``: ``get_hf_file_metadata`` (``hf_hub_download``; ``HfApi.file_exists``, which
  ``get_safetensors_metadata`` asks first). Every answer carries ``X-Repo-Commit``. A small file: 200 with
  ``ETag`` (its git blob id) and ``Content-Length``. An LFS file (``*.safetensors``, or 10 MB and more): 302 to the
  "CDN" with ``X-Linked-Etag`` (its sha256) and ``X-Linked-Size``; the CDN is a second listener on another port,
  so huggingface_hub treats it as another host, as it treats the hub's CDN: it stops following there and drops
  the ``authorization`` header.
- ``GET /{repo}/resolve/{rev}/{path}``, with or without ``Range: bytes=a-b``: ``HfApi.parse_safetensors_file_metadata``
  (``bytes=0-100000``, then the rest of a longer header), ``HfFileSystemFile._fetch_range``; an LFS file redirects
  (302) to the CDN, which httpx follows. ``GET /cdn/{sha256}/{path}`` on the CDN: ``http_get`` of
  ``hf_hub_download`` goes straight there (the HEAD's ``Location``), with ``Range: bytes=n-`` to resume.
  A range is answered 206 with ``Content-Range``, no range 200, a range past the end 416.

Unknown repo: 401 ``X-Error-Code: RepoNotFound`` (what the hub answers an anonymous client);
unknown revision: 404 ``RevisionNotFound``; unknown file: 404 ``EntryNotFound``; ``hf_raise_for_status`` turns
them into ``RepositoryNotFoundError`` / ``RevisionNotFoundError`` / ``RemoteEntryNotFoundError``.

Every request is logged (:class:`Request`: method, path, file, Range, status, body bytes sent) and faults can be
injected per request (:class:`Fault`: a status such as 429 with ``Retry-After`` or 503, a connection dropped after
N body bytes, a short body, a slow answer; only while a condition holds; after an action of the test's, such as a
push or a wait for the test's go, so a test orders events by construction, never by how long a sleep lasts).
huggingface_hub retries 408/429/5xx in ``http_backoff`` (``utils/_http.py``; ``Retry-After`` honoured) and resumes
a dropped ``http_get`` from the byte it reached (``Range: bytes=n-``).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_MIN_SIZE = 10 * 1000 * 1000  # the hub's default .gitattributes sends large files to LFS
CHUNK = 1 << 20
BODY_BLOCK = 8 << 20  # a body is read from disk and sent in blocks of this
PAGE = 4096
HANG_S = 60  # how long a wait in the imitation lasts at most: only a hang reaches it, not a busy machine
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


@dataclass(frozen=True)
class Blob:
    """One file of a commit: where its bytes are, and the ids the hub gives it."""

    path: Path
    size: int
    git_oid: str  # sha1 of the git blob: a small file's ETag
    sha256: str  # an LFS file's ETag (X-Linked-Etag)
    lfs: bool

    @classmethod
    def of(cls, path: Path) -> Blob:
        git, sha = hashlib.sha1(), hashlib.sha256()
        size = path.stat().st_size
        git.update(b"blob %d\0" % size)
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                git.update(chunk)
                sha.update(chunk)
        return cls(path, size, git.hexdigest(), sha.hexdigest(), path.suffix == ".safetensors" or size >= LFS_MIN_SIZE)

    def entry(self, name: str) -> dict:
        """The tree / paths-info JSON of this file."""
        doc = {"type": "file", "oid": self.git_oid, "size": self.size, "path": name}
        if self.lfs:
            doc["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": 134}
        return doc


@dataclass
class Request:
    """One request as the server saw it. ``file`` is the repo path (resolve and CDN), else None."""

    method: str
    path: str
    host: str  # "hub" or "cdn"
    file: str | None = None
    range: str | None = None
    status: int | None = None
    sent: int = 0  # body bytes handed to the socket


@dataclass
class Fault:
    """Answer the next ``times`` requests whose ``method``, ``file`` and ``host`` ("hub" or "cdn") equal these
    (None: any) with a fault instead of the normal response:

    - ``status`` (429, 503, ...) with an empty body, plus ``Retry-After: retry_after`` if given;
    - ``drop_after=N``: the normal headers, N body bytes, then the connection is closed;
    - ``short_by=N``: a well-formed response N bytes shorter than asked (Content-Range and Content-Length agree
      with the short body), as a misbehaving proxy or CDN may answer;
    - ``delay_s=S``: the answer (normal or faulty) after S seconds, as a slow hub gives it (no test may count
      on what happens meanwhile: a busy machine can stall either side for longer; use ``before``);
    - ``before``: called in the server's thread once the request is counted in flight, before the answer:
      an action that must land while a request is in flight (a push), or a wait until the test says go;
    - ``when``: the fault applies only to a request that arrives while ``when()`` is true.
    """

    method: str | None = "GET"
    file: str | None = None
    host: str | None = None
    status: int | None = None
    retry_after: int | None = None
    drop_after: int | None = None
    short_by: int | None = None
    delay_s: float | None = None
    before: Callable[[], object] | None = None
    when: Callable[[], bool] | None = None
    times: int = 1

    def matches(self, req: Request) -> bool:
        return (
            self.times > 0
            and self.method in (None, req.method)
            and self.file in (None, req.file)
            and self.host in (None, req.host)
            and (self.when is None or self.when())
        )


@dataclass
class _Repo:
    commits: dict[str, dict[str, Blob]] = field(default_factory=dict)  # commit sha -> repo path -> blob
    refs: dict[str, str] = field(default_factory=dict)  # branch / tag -> commit sha

    def resolve(self, rev: str) -> str | None:
        return self.refs.get(rev) or (rev if rev in self.commits else None)


class HubServer:
    """The hub imitation: ``with HubServer() as hub: hub.push("org/name", folder); env HF_ENDPOINT=hub.url``."""

    def __init__(self) -> None:
        self.repos: dict[str, _Repo] = {}
        self.log: list[Request] = []
        self.faults: list[Fault] = []
        self._lock = threading.Lock()
        self._inflight = 0
        self.peak_inflight = 0  # the most requests answered at once
        self._idle = threading.Condition(self._lock)
        self._servers = [self._listen("hub"), self._listen("cdn")]
        self.url = self._origin(self._servers[0])
        self.cdn_url = self._origin(self._servers[1])

    # -- repo contents

    def push(self, repo_id: str, folder: Path, branch: str = "main") -> str:
        """Commit every file under ``folder`` to ``repo_id`` and point ``branch`` at it; returns the commit sha."""
        folder = Path(folder)
        blobs = {p.relative_to(folder).as_posix(): Blob.of(p) for p in sorted(folder.rglob("*")) if p.is_file()}
        repo = self.repos.setdefault(repo_id, _Repo())
        listing = json.dumps([(name, b.git_oid) for name, b in blobs.items()]).encode()
        commit = hashlib.sha1(repo_id.encode() + b"\0" + listing).hexdigest()
        with self._lock:
            repo.commits[commit] = blobs
            repo.refs[branch] = commit
        return commit

    # -- the request log

    def requests(self, method: str | None = None, file: str | None = None, host: str | None = None) -> list[Request]:
        """Logged requests (after every request in flight has finished), filtered by what is given."""
        with self._idle:
            self._idle.wait_for(lambda: self._inflight == 0, timeout=HANG_S)
            log = list(self.log)
        return [r for r in log if method in (None, r.method) and file in (None, r.file) and host in (None, r.host)]

    def wait_peak(self, n: int) -> bool:
        """Wait until ``n`` requests have been answered at once (a fault's ``before``: an answer held until the
        client has that many in flight); False after HANG_S."""
        with self._idle:
            return self._idle.wait_for(lambda: self.peak_inflight >= n, timeout=HANG_S)

    def bytes_sent(self, file: str | None = None) -> int:
        """Body bytes sent, of ``file`` or of everything."""
        return sum(r.sent for r in self.requests(file=file))

    def clear(self) -> None:
        with self._lock:
            self.log.clear()

    def inject(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    # -- serving

    def _listen(self, host: str) -> ThreadingHTTPServer:
        server = _Server(("127.0.0.1", 0), _Handler)
        server.daemon_threads = True
        server.hub, server.role = self, host  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, args=(0.05,), name=f"hub-server-{host}", daemon=True).start()
        return server

    @staticmethod
    def _origin(server: ThreadingHTTPServer) -> str:
        return f"http://127.0.0.1:{server.server_address[1]}"

    def close(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()

    def __enter__(self) -> HubServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _begin(self, req: Request) -> Fault | None:
        with self._lock:
            self._inflight += 1
            self.peak_inflight = max(self.peak_inflight, self._inflight)
            self._idle.notify_all()
            self.log.append(req)
            fault = next((f for f in self.faults if f.matches(req)), None)
            if fault is not None:
                fault.times -= 1
            return fault

    def _end(self) -> None:
        with self._idle:
            self._inflight -= 1
            self._idle.notify_all()


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A client that closes its connection (a reader abandoning a body it refused) is no server error."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _HubError(Exception):
    """An answer with the hub's error headers (X-Error-Code, X-Error-Message, X-Repo-Commit if known)."""

    def __init__(self, status: int, code: str, message: str, commit: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.commit = status, code, commit


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as httpx uses the hub
    hub: HubServer
    req: Request
    _block: memoryview | None = None  # the connection's body buffer, made at its first body

    def log_message(self, format, *args) -> None:  # the request log is HubServer.log
        pass

    def do_GET(self) -> None:
        self._serve()

    def do_HEAD(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    # -- dispatch

    def _serve(self) -> None:
        self.hub = self.server.hub  # type: ignore[attr-defined]
        url = urlsplit(self.path)
        self.req = Request(self.command, url.path, self.server.role, range=self.headers.get("Range"))  # type: ignore[attr-defined]
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        answer = self._route(url.path, parse_qs(url.query), body)  # sets req.file
        fault = self.hub._begin(self.req)
        try:
            if fault is not None and fault.before is not None:
                fault.before()
            if fault is not None and fault.delay_s:
                time.sleep(fault.delay_s)
            if fault is not None and fault.status is not None:
                headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
                self._send(fault.status, b"", headers)
                return
            self.fault = fault
            try:
                answer()
            except _HubError as err:
                headers = {"X-Error-Code": err.code, "X-Error-Message": str(err)}
                if err.commit:
                    headers["X-Repo-Commit"] = err.commit
                self._send(err.status, json.dumps({"error": str(err)}).encode(), headers)
        finally:
            self.hub._end()

    def _route(self, path: str, query: dict, body: bytes):
        """The function that answers ``path``: it raises _HubError for an unknown repo, revision or file."""
        parts = path.strip("/").split("/")
        if self.req.host == "cdn":
            if len(parts) >= 3 and parts[0] == "cdn":
                self.req.file = unquote("/".join(parts[2:]))
                return lambda: self._cdn(parts[1])
        elif parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id, rest = "/".join(parts[2:4]), parts[4:]
            if not rest:
                return lambda: self._model_info(repo_id, "main", query)
            if rest[0] == "revision" and len(rest) == 2:
                return lambda: self._model_info(repo_id, unquote(rest[1]), query)
            if rest[0] == "tree" and len(rest) >= 2:
                return lambda: self._tree(repo_id, unquote(rest[1]), unquote("/".join(rest[2:])), query)
            if rest[0] == "paths-info" and len(rest) == 2 and self.command == "POST":
                return lambda: self._paths_info(repo_id, unquote(rest[1]), parse_qs(body.decode()))
        elif len(parts) >= 5 and parts[2] == "resolve":
            self.req.file = unquote("/".join(parts[4:]))
            return lambda: self._resolve("/".join(parts[:2]), unquote(parts[3]))
        return lambda: self._send(404, b"not found", {})

    # -- endpoints

    def _commit(self, repo_id: str, rev: str) -> tuple[str, dict[str, Blob]]:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            raise _HubError(401, "RepoNotFound", "Repository not found")
        commit = repo.resolve(rev)
        if commit is None:
            raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return commit, repo.commits[commit]

    def _model_info(self, repo_id: str, rev: str, query: dict) -> None:
        commit, blobs = self._commit(repo_id, rev)
        with_blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for name, b in blobs.items():
            sibling: dict = {"rfilename": name}
            if with_blobs:
                sibling.update(size=b.size, blobId=b.git_oid)
                if b.lfs:
                    sibling["lfs"] = {"size": b.size, "sha256": b.sha256, "pointerSize": 134}
            siblings.append(sibling)
        self._json({"id": repo_id, "modelId": repo_id, "sha": commit, "private": False, "siblings": siblings})

    def _tree(self, repo_id: str, rev: str, sub: str, query: dict) -> None:
        _, blobs = self._commit(repo_id, rev)
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        prefix = f"{sub}/" if sub else ""
        entries, folders = [], set()
        for name, b in blobs.items():
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix) :].split("/")
            for depth in range(1, len(rest) if recursive else min(len(rest), 2)):  # the folders on the way
                folder = prefix + "/".join(rest[:depth])
                if folder not in folders:
                    folders.add(folder)
                    entries.append(_folder_entry(folder))
            if recursive or len(rest) == 1:
                entries.append(b.entry(name))
        if sub and not entries:
            raise _HubError(404, "EntryNotFound", f"{sub} does not exist on {rev}")
        self._json(entries)

    def _paths_info(self, repo_id: str, rev: str, form: dict) -> None:
        _, blobs = self._commit(repo_id, rev)
        out = []
        for p in form.get("paths", []):
            if p in blobs:
                out.append(blobs[p].entry(p))
            elif any(name.startswith(p + "/") for name in blobs):
                out.append(_folder_entry(p))
        self._json(out)

    def _resolve(self, repo_id: str, rev: str) -> None:
        commit, blobs = self._commit(repo_id, rev)
        blob = blobs.get(self.req.file or "")
        if blob is None:
            raise _HubError(404, "EntryNotFound", "Entry not found", commit)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{blob.git_oid}"', "Accept-Ranges": "bytes"}
        if not blob.lfs:
            self._send_blob(blob, headers)
            return
        # an LFS file: to the CDN, as the hub redirects them
        headers["X-Linked-Etag"] = f'"{blob.sha256}"'
        headers["X-Linked-Size"] = str(blob.size)
        headers["Location"] = f"{self.hub.cdn_url}/cdn/{blob.sha256}/{quote(self.req.file or '')}"
        self._send(302, b"", headers)

    def _cdn(self, sha256: str) -> None:
        for repo in self.hub.repos.values():
            for blobs in repo.commits.values():
                if (b := blobs.get(self.req.file or "")) is not None and b.sha256 == sha256:
                    self._send_blob(b, {"ETag": f'"{sha256}"', "Accept-Ranges": "bytes"})
                    return
        self._send(404, b"no such blob", {})

    # -- bytes on the wire

    def _send_blob(self, blob: Blob, headers: dict) -> None:
        """The file, or the ``Range`` of it asked for (206), with the fault injected into this request if any."""
        start, end, status = 0, blob.size, 200  # [start, end)
        if self.req.range:
            span = _parse_range(self.req.range, blob.size)
            if span is None:
                self._send(416, b"", {**headers, "Content-Range": f"bytes */{blob.size}"})
                return
            (start, end), status = span, 206
        fault = self.fault
        if fault is not None and fault.short_by:
            end = max(start, end - fault.short_by)
        if status == 206:
            headers = {**headers, "Content-Range": f"bytes {start}-{end - 1}/{blob.size}"}
        self._head(status, end - start, {**headers, "Content-Type": "application/octet-stream"})
        if self.command == "HEAD":
            return
        drop = fault.drop_after if fault is not None else None
        left = end - start if drop is None else min(drop, end - start)
        self.wfile.flush()  # the status line and headers go first
        self._body(blob.path, start, left)
        if drop is not None:  # the connection drops mid-body
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    def _body(self, path: Path, start: int, left: int) -> None:
        """``left`` bytes of ``path`` from ``start`` to the socket, read from the disk with ``O_DIRECT`` (where the
        file system allows it) into this connection's buffer and sent from there, as a CDN sends from memory of its
        own. Not ``sendfile``: that hands the socket the page-cache pages the disk has just filled, and the client
        beside the server then copies every byte out of cold memory (``perf`` of ``convert --stream`` on the 8.6 GiB
        bench skeleton, cold cache: the receive copy ``_copy_to_iter`` 33 % of the client's 43 CPU-s; sent from this
        buffer, 4 % of 27 CPU-s; the server's own CPU 3.4 -> 3.6 s). That cost was the imitation's, and the bench
        counted it against the conversion: stream / local 1.43-1.48 with ``sendfile`` (three rounds), 1.02-1.19
        this way (six rounds; ``bench/stream_bench.py``)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:  # a file system without direct I/O (tmpfs): the same reads through the cache
            fd = os.open(path, os.O_RDONLY)
        if self._block is None:
            self._block = memoryview(mmap.mmap(-1, BODY_BLOCK))  # page-aligned, as O_DIRECT wants
        buf = self._block
        try:
            pos = start
            while left > 0:
                skip = pos % PAGE  # O_DIRECT reads whole pages: from the one ``pos`` is in
                want = min(BODY_BLOCK, -(-(skip + left) // PAGE) * PAGE)
                try:
                    got = os.preadv(fd, [buf[:want]], pos - skip)
                except OSError as exc:  # direct I/O refused at the first read (some file systems do): buffered
                    if exc.errno != errno.EINVAL or not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                        raise
                    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                    continue
                n = min(got - skip, left)
                if n <= 0:
                    raise ConnectionError(f"{path} ended at byte {pos}")
                for a in range(skip, skip + n, CHUNK):  # a MiB at a time, each counted before it goes: the
                    b = min(a + CHUNK, skip + n)  # client may hold it before sendall returns
                    self.req.sent += b - a
                    self.connection.sendall(buf[a:b])
                pos, left = pos + n, left - n
        finally:
            os.close(fd)

    def _json(self, doc) -> None:
        self._send(200, json.dumps(doc).encode(), {"Content-Type": "application/json"})

    def _head(self, status: int, length: int, headers: dict) -> None:
        self.req.status = status
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def _send(self, status: int, body: bytes, headers: dict) -> None:
        self._head(status, len(body), headers)
        if self.command != "HEAD" and body:
            self.req.sent += len(body)
            self.wfile.write(body)


def _folder_entry(path: str) -> dict:
    return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0, "path": path}


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` as [start, end) within ``size``; None if not satisfiable."""
    m = _RANGE.match(header.strip())
    if m is None or not (m.group(1) or m.group(2)):
        return None
    if m.group(1):
        start = int(m.group(1))
        end = min(int(m.group(2)) + 1, size) if m.group(2) else size
    else:  # the last n bytes
        start, end = max(size - int(m.group(2)), 0), size
    return (start, end) if start < end else None
