"""A local stand-in for the Hugging Face hub's HTTP API, so that huggingface_hub's real download
code (``snapshot_download``: repo info, tree listing, HEAD + GET of each file, its cache layout)
runs without internet. Point a process at it with ``HF_ENDPOINT=mirror.url``.

It serves the endpoints huggingface_hub 2.x calls, with the hub's error headers
(``X-Error-Code``: RepoNotFound, RevisionNotFound, GatedRepo), and can require a token
(``Authorization: Bearer ...``) for file downloads, as a gated repo does.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class MirroredRepo:
    """One repo: its files at one commit, reachable by ``revisions`` (names -> that commit)."""

    directory: Path
    revisions: tuple[str, ...] = ("main",)
    token: str | None = None  # required for file downloads when set (a gated repo)
    files: dict[str, bytes] = field(default_factory=dict)
    commit: str = ""

    def __post_init__(self) -> None:
        self.files = {str(p.relative_to(self.directory)): p.read_bytes()
                      for p in sorted(self.directory.rglob("*")) if p.is_file()}
        digest = hashlib.sha1()
        for name, data in self.files.items():
            digest.update(name.encode() + hashlib.sha1(data).digest())
        self.commit = digest.hexdigest()

    def resolves(self, revision: str) -> bool:
        return revision in self.revisions or revision == self.commit


class HubMirror:
    """``repos``: repo id -> ``MirroredRepo``. Start with ``with HubMirror(...) as mirror``."""

    def __init__(self, repos: dict[str, MirroredRepo]) -> None:
        self.repos = repos
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Authorization)
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                mirror._handle(self, send_body=False)

            def do_GET(self) -> None:
                mirror._handle(self, send_body=True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "HubMirror":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ---- the API ------------------------------------------------------------------------------
    def _handle(self, request: BaseHTTPRequestHandler, send_body: bool) -> None:
        path = unquote(urlparse(request.path).path)
        self.requests.append((request.command, path, request.headers.get("Authorization")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"]:
            self._api(request, parts[2:], send_body)
        elif len(parts) >= 5 and parts[2] == "resolve":
            self._resolve(request, "/".join(parts[:2]), parts[3], "/".join(parts[4:]), send_body)
        else:
            self._error(request, 404, "EntryNotFound")

    def _api(self, request, parts: list[str], send_body: bool) -> None:
        # models/{org}/{name}/revision/{rev}  or  models/{org}/{name}/tree/{rev}[/path]
        repo_id, verb, revision = "/".join(parts[:2]), parts[2] if len(parts) > 2 else "", \
            parts[3] if len(parts) > 3 else "main"
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._error(request, 404, "RepoNotFound")
        if not repo.resolves(revision):
            return self._error(request, 404, "RevisionNotFound")
        if verb == "revision":
            body = {"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
                    "gated": "manual" if repo.token else False,
                    "siblings": [{"rfilename": name} for name in repo.files]}
        elif verb == "tree":
            body = [{"type": "file", "path": name, "size": len(data),
                     "oid": hashlib.sha1(data).hexdigest()} for name, data in repo.files.items()]
        else:
            return self._error(request, 404, "EntryNotFound")
        self._send(request, 200, json.dumps(body).encode(), {"Content-Type": "application/json"}, send_body)

    def _resolve(self, request, repo_id: str, revision: str, name: str, send_body: bool) -> None:
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._error(request, 404, "RepoNotFound")
        if repo.token and request.headers.get("Authorization") != f"Bearer {repo.token}":
            return self._error(request, 401, "GatedRepo")
        if not repo.resolves(revision):
            return self._error(request, 404, "RevisionNotFound")
        if name not in repo.files:
            return self._error(request, 404, "EntryNotFound")
        data = repo.files[name]
        etag = f'"{hashlib.sha1(data).hexdigest()}"'
        self._send(request, 200, data, {"X-Repo-Commit": repo.commit, "ETag": etag,
                                        "Content-Type": "application/octet-stream"}, send_body)

    @staticmethod
    def _error(request, status: int, code: str) -> None:
        body = json.dumps({"error": code}).encode()
        HubMirror._send(request, status, body, {"X-Error-Code": code, "X-Error-Message": code,
                                                "Content-Type": "application/json"}, True)

    @staticmethod
    def _send(request, status: int, body: bytes, headers: dict[str, str], send_body: bool) -> None:
        request.send_response(status)
        for key, value in headers.items():
            request.send_header(key, value)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        if send_body:
            request.wfile.write(body)
