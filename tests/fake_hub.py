"""A Hugging Face hub on 127.0.0.1 for the download tests: the few endpoints ``huggingface_hub`` calls.

- ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}``: the model's info (``sha``, ``siblings``;
  with ``?blobs=true`` each sibling's ``size``)
- ``GET /api/models/{repo}/tree/{rev}``: its files (``snapshot_download`` lists them)
- ``HEAD`` / ``GET /{repo}/resolve/{rev}/{file}``: a file, with ``X-Repo-Commit`` and ``ETag``; ``Range:
  bytes=N-`` answers 206 from N (how ``huggingface_hub`` resumes a download)

An unknown repo is a 404 with ``X-Error-Code: RepoNotFound``, an unknown file one with ``EntryNotFound``,
as the hub answers. ``drop_once`` names files whose first GET stops halfway and closes the connection.
Every request is logged as ``(method, path, Range header)``.

A hostile hub, for the tests that it cannot write outside the cache or send more than it listed:
``etags`` replaces a file's ETag, ``sizes`` the size its listing declares, ``bodies`` what a GET sends
(with no Content-Length, ended by closing the connection, unless ``lengths`` says what to declare),
``commit`` the commit id the listing and the answers name.
"""

from __future__ import annotations

import contextlib
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
        self.etags: dict[str, str] = {}
        self.sizes: dict[str, int] = {}
        self.bodies: dict[str, bytes] = {}
        self.lengths: dict[str, int] = {}
        self.commit: str | None = None
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
        if self.commit is not None:
            return self.commit
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
            url = urlparse(self.path)
            path = unquote(url.path)
            hub.log.append((self.command, path, self.headers.get("Range")))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                self._api(parts[2] + "/" + parts[3], parts[4:], "blobs=true" in url.query.lower())
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._file(parts[0] + "/" + parts[1], "/".join(parts[4:]), body)
            else:
                self._error(404, "RepoNotFound")

        def _api(self, repo: str, rest: list[str], blobs: bool) -> None:
            files = hub.repos.get(repo)
            if files is None:
                return self._error(404, "RepoNotFound")
            if rest[:1] == ["tree"]:
                listing = [
                    {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in sorted(files.items())
                ]
                return self._json(listing)
            siblings = [
                {"rfilename": name, **({"size": hub.sizes.get(name, len(data))} if blobs else {})}
                for name, data in sorted(files.items())
            ]
            self._json({"id": repo, "modelId": repo, "sha": hub.sha(repo), "private": False, "siblings": siblings})

        def _file(self, repo: str, name: str, body: bool) -> None:
            files = hub.repos.get(repo)
            if files is None:
                return self._error(404, "RepoNotFound")
            if name not in files:
                return self._error(404, "EntryNotFound", commit=hub.sha(repo))
            data = files[name]
            if name in hub.bodies:
                return self._hostile(name, hub.bodies[name], body)
            start = 0
            ranged = self.headers.get("Range")
            if ranged and ranged.startswith("bytes=") and ranged.endswith("-"):
                start = int(ranged[len("bytes=") : -1])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", hub.sha(repo))
            self.send_header("ETag", hub.etags.get(name, f'"{hashlib.sha256(data).hexdigest()}"'))
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

        def _hostile(self, name: str, data: bytes, body: bool) -> None:
            """A body other than the listed one: sent until the connection closes, or with the length
            ``lengths`` declares."""
            self.send_response(200)
            self.send_header("X-Repo-Commit", hub.sha(parts_repo(self.path)))
            self.send_header("ETag", hub.etags.get(name, f'"{hashlib.sha256(data).hexdigest()}"'))
            if name in hub.lengths:
                self.send_header("Content-Length", str(hub.lengths[name]))
            self.end_headers()
            self.close_connection = True  # without a length, the body ends where the connection does
            if body:
                with contextlib.suppress(OSError):  # the client may stop reading, as it should
                    for at in range(0, len(data), 1 << 16):
                        self.wfile.write(data[at : at + (1 << 16)])

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


def parts_repo(path: str) -> str:
    parts = unquote(urlparse(path).path).strip("/").split("/")
    return parts[0] + "/" + parts[1]
