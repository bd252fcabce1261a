"""A loopback stand-in for the Hugging Face Hub: the routes `huggingface_hub.snapshot_download` calls,
for a few tiny repos, answered as the Hub answers them (huggingface_hub 2.x reads these):

    GET  /api/models/{repo}/revision/{rev}      repo info: {"id", "sha", "siblings"}
    GET  /api/models/{repo}/tree/{rev}          the commit's files: {"type", "path", "size", "oid", "lfs"}
    HEAD /{repo}/resolve/{rev}/{file}           metadata in headers: X-Repo-Commit, ETag, Content-Length;
    GET  /{repo}/resolve/{rev}/{file}             an LFS file (*.safetensors) is a 302 to the CDN with
                                                  X-Linked-Etag and X-Linked-Size, as on the real Hub
    GET  CDN /blobs/{sha256}                    the LFS file's bytes (a second server: another origin,
                                                  so the client stops at the redirect, as with a real CDN)

Errors carry X-Error-Code as the Hub sends them: RepoNotFound (404 on the API, 401 on resolve),
RevisionNotFound (404), GatedRepo (401 on resolve without the repo's token), EntryNotFound (404).
Every request is recorded (`requests`) so tests can say what the client fetched."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    """One model repo: commits (sha -> file name -> bytes) and refs (branch or tag -> sha)."""

    repo_id: str
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    token: str | None = None  # set: a gated repo whose files need `Authorization: Bearer <token>`

    def add_commit(self, files: dict[str, bytes], *refs: str) -> str:
        """A new commit of `files` (its sha from their contents), pointed at by `refs`."""
        digest = hashlib.sha1(self.repo_id.encode())
        for name in sorted(files):
            digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
        sha = digest.hexdigest()
        self.commits[sha] = dict(files)
        for ref in refs:
            self.refs[ref] = sha
        return sha

    def resolve(self, rev: str) -> str | None:
        return rev if rev in self.commits else self.refs.get(rev)


def folder_files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by its path relative to it."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def is_lfs(name: str) -> bool:
    return name.endswith((".safetensors", ".bin", ".pth"))


def git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class StandInHub:
    """The hub and its CDN on 127.0.0.1 port 0, each in a thread. `endpoint` goes into HF_ENDPOINT."""

    def __init__(self, repos: list[Repo]) -> None:
        self.repos = {r.repo_id: r for r in repos}
        self.blobs: dict[str, bytes] = {}  # sha256 -> bytes, what the CDN serves
        self.requests: list[tuple[str, str, str]] = []  # (method, path, authorization header)
        self._lock = threading.Lock()
        self.cdn = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, is_cdn=True))
        self.hub = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, is_cdn=False))
        self._threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (self.hub, self.cdn)]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.hub.server_address[1]}"

    def cdn_url(self, sha256: str) -> str:
        return f"http://127.0.0.1:{self.cdn.server_address[1]}/blobs/{sha256}"

    def record(self, method: str, path: str, authorization: str) -> None:
        with self._lock:
            self.requests.append((method, path, authorization))

    def fetched_files(self) -> set[str]:
        """File names the client downloaded (GET on resolve)."""
        return {
            p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p, _ in self.requests if m == "GET" and "/resolve/" in p
        }

    def __enter__(self) -> StandInHub:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for server in (self.hub, self.cdn):
            server.shutdown()
            server.server_close()


def _handler(hub: StandInHub, is_cdn: bool) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the client pools connections: every answer has a length

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._answer(head=True)

        def do_GET(self) -> None:
            self._answer(head=False)

        def _answer(self, head: bool) -> None:
            path = urlsplit(self.path).path
            hub.record(self.command, path, self.headers.get("Authorization", ""))
            if is_cdn:
                blob = hub.blobs.get(path.removeprefix("/blobs/"))
                return self._send(200, blob, head) if blob is not None else self._error(404, "EntryNotFound")
            if path.startswith("/api/models/"):
                return self._api(path.removeprefix("/api/models/"), head)
            if "/resolve/" in path:
                return self._resolve(path.lstrip("/"), head)
            self._error(404, None)

        def _api(self, rest: str, head: bool) -> None:
            for kind in ("revision", "tree"):
                repo_id, sep, rev = rest.partition(f"/{kind}/")
                if sep:
                    break
            else:
                return self._error(404, None)
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound", "Repository not found")
            sha = repo.resolve(unquote(rev))
            if sha is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {unquote(rev)}")
            files = repo.commits[sha]
            if kind == "revision":
                info = {"id": repo_id, "sha": sha, "private": False, "gated": "manual" if repo.token else False}
                info["siblings"] = [{"rfilename": name} for name in sorted(files)]
                return self._json(info, head)
            entries = []
            for name, data in sorted(files.items()):
                entry = {"type": "file", "path": name, "size": len(data), "oid": git_blob_sha(data)}
                if is_lfs(name):
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                entries.append(entry)
            self._json(entries, head)

        def _resolve(self, rest: str, head: bool) -> None:
            repo_id, _, tail = rest.partition("/resolve/")
            rev, _, name = tail.partition("/")
            repo = hub.repos.get(repo_id)
            if repo is None:  # the Hub answers 401, not 404, so as not to tell private repos from missing ones
                return self._error(401, "RepoNotFound", "Repository not found")
            if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
                message = f"Access to model {repo_id} is restricted. You must have access to it and be authenticated."
                return self._error(401, "GatedRepo", message)
            sha = repo.resolve(unquote(rev))
            if sha is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {unquote(rev)}")
            data = repo.commits[sha].get(unquote(name))
            if data is None:
                return self._error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": sha})
            if is_lfs(name):
                sha256 = hashlib.sha256(data).hexdigest()
                hub.blobs[sha256] = data
                headers = {"X-Repo-Commit": sha, "X-Linked-Etag": f'"{sha256}"', "X-Linked-Size": str(len(data))}
                return self._send(302, b"", head, {**headers, "Location": hub.cdn_url(sha256)})
            self._send(200, data, head, {"X-Repo-Commit": sha, "ETag": f'"{git_blob_sha(data)}"'})

        def _json(self, body: object, head: bool) -> None:
            self._send(200, json.dumps(body).encode(), head, {"Content-Type": "application/json"})

        def _error(self, status: int, code: str | None, message: str = "", extra: dict[str, str] | None = None) -> None:
            headers = {**(extra or {}), "Content-Type": "application/json"}
            if code is not None:
                headers |= {"X-Error-Code": code, "X-Error-Message": message}
            self._send(status, json.dumps({"error": message}).encode(), False, headers)

        def _send(self, status: int, body: bytes, head: bool, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head and self.command != "HEAD":
                self.wfile.write(body)

    return Handler
