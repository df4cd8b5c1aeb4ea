"""A Hugging Face hub on 127.0.0.1 for the download tests: the few endpoints ``huggingface_hub`` calls.

- ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}``: the model's info (``sha``, ``siblings``)
- ``GET /api/models/{repo}/tree/{rev}``: its files (``snapshot_download`` lists them)
- ``HEAD`` / ``GET /{repo}/resolve/{rev}/{file}``: a file, with ``X-Repo-Commit`` and ``ETag``; ``Range:
  bytes=N-`` answers 206 from N (how ``huggingface_hub`` resumes a download)

An unknown repo is a 404 with ``X-Error-Code: RepoNotFound``, an unknown file one with ``EntryNotFound``,
as the hub answers. ``drop_once`` names files whose first GET stops halfway and closes the connection.
Every request is logged as ``(method, path, Range header)``.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.drop_once: set[str] = set()
        self.log: list[tuple[str, str, str | None]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def add_folder(self, repo: str, folder: Path, extra: dict[str, bytes] | None = None) -> None:
        """Serve every file of ``folder`` (and ``extra``) as repo ``repo``."""
        files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        self.repos[repo] = {**files, **(extra or {})}

    def sha(self, repo: str) -> str:
        h = hashlib.sha1(repo.encode())
        for name, data in sorted(self.repos[repo].items()):
            h.update(name.encode() + hashlib.sha1(data).digest())
        return h.hexdigest()

    def gets(self, suffix: str = "") -> list[tuple[str, str, str | None]]:
        return [entry for entry in self.log if entry[0] == "GET" and entry[1].endswith(suffix)]

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            hub.log.append((self.command, path, self.headers.get("Range")))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                self._api(parts[2] + "/" + parts[3], parts[4:])
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._file(parts[0] + "/" + parts[1], "/".join(parts[4:]), body)
            else:
                self._error(404, "RepoNotFound")

        def _api(self, repo: str, rest: list[str]) -> None:
            files = hub.repos.get(repo)
            if files is None:
                return self._error(404, "RepoNotFound")
            if rest[:1] == ["tree"]:
                listing = [
                    {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in sorted(files.items())
                ]
                return self._json(listing)
            siblings = [{"rfilename": name} for name in sorted(files)]
            self._json({"id": repo, "modelId": repo, "sha": hub.sha(repo), "private": False, "siblings": siblings})

        def _file(self, repo: str, name: str, body: bool) -> None:
            files = hub.repos.get(repo)
            if files is None:
                return self._error(404, "RepoNotFound")
            if name not in files:
                return self._error(404, "EntryNotFound", commit=hub.sha(repo))
            data = files[name]
            start = 0
            ranged = self.headers.get("Range")
            if ranged and ranged.startswith("bytes=") and ranged.endswith("-"):
                start = int(ranged[len("bytes=") : -1])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", hub.sha(repo))
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            if name in hub.drop_once and not start:
                hub.drop_once.discard(name)
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(data[start:])

        def _json(self, value) -> None:
            data = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, code: str, commit: str | None = None) -> None:
            data = json.dumps({"error": f"{code}: not here"}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", f"{code}: not here")
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler
