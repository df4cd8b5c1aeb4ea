"""``kvsnap serve`` under clients that ask too much: a huge request, hundreds of trickling
connections, a shutdown with requests in line, keys asking for each other's figures.

Real servers in subprocesses (``test_serve.Server``), every connection to 127.0.0.1, every load
bounded in count and in time; each server is killed at the end of its test or module.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time

import pytest
from test_serve import Server, model  # noqa: F401  (model: the module's fixture)

HEALTH_S = 0.5  # /health and /v1/models answer within this, whatever else the server is doing


def answered_at_once(latencies: list[float]) -> None:
    """Every probe within ``HEALTH_S``, but for the odd one on a shared machine whose CPU went to
    other work (never past 4x): a blocked event loop, what these tests catch, holds them all for
    seconds."""
    slow = [t for t in latencies if t >= HEALTH_S]
    assert len(slow) <= len(latencies) // 20 and max(latencies) < 4 * HEALTH_S, sorted(latencies)[-5:]


GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):  # noqa: F811
    folder = tmp_path_factory.mktemp("serve-limits")
    running = Server(folder / "server.log", model, folder / "store", "--max-queue", "2", "--max-connections", "100")
    yield running
    running.kill()


def timed(server: Server, path: str) -> float:
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", path)
    response = conn.getresponse()
    response.read()
    conn.close()
    assert response.status == 200
    return time.monotonic() - started


def busy_stream(server: Server, key: str = "unused"):
    """A streamed answer that runs until closed (the tiny model never ends its turn)."""
    stream = server.client(key).chat.completions.create(
        model="tiny-endless",
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=3000,
        temperature=0,
        stream=True,
    )
    next(c for c in stream if c.choices and c.choices[0].delta.content)  # it is running
    return stream


def raw_post(port: int, body: bytes, out: dict, key: str) -> None:
    """POST a body in 1 MiB pieces; ``out[key]``: (seconds, status or the error that ended it)."""
    started = time.monotonic()
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode())
        try:
            for i in range(0, len(body), 1 << 20):
                sock.sendall(body[i : i + (1 << 20)])
        except OSError:
            pass  # the server answered and closed before taking it all: read what it said
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.partition(b"\r\n\r\n")[2]) < _length(reply):
            piece = sock.recv(65536)
            if not piece:
                break
            reply += piece
        status = int(reply.split()[1]) if reply.startswith(b"HTTP/1.1") else "closed"
        out[key] = (time.monotonic() - started, status, reply)
    except OSError as exc:
        out[key] = (time.monotonic() - started, type(exc).__name__, b"")
    finally:
        sock.close()


def _length(reply: bytes) -> int:
    """The content-length a response's headers declare (0 until they are all in)."""
    head = reply.partition(b"\r\n\r\n")[0].lower()
    for line in head.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def test_a_huge_request_is_refused_at_once_while_health_answers(server):
    stream = busy_stream(server)
    try:
        huge = json.dumps(
            {"messages": [{"role": "user", "content": "lorem ipsum dolor " * ((31 << 20) // 18 + 1000)}]}
        ).encode()
        over = json.dumps({"messages": [{"role": "user", "content": "lorem ipsum dolor " * 20_000}]}).encode()
        assert (31 << 20) <= len(huge) < (32 << 20)
        out: dict = {}
        posts = [
            threading.Thread(target=raw_post, args=(server.port, b, out, k))
            for k, b in (("huge", huge), ("over", over))
        ]
        for t in posts:
            t.start()
        latencies = []
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline or any(t.is_alive() for t in posts):
            latencies += [timed(server, "/health"), timed(server, "/v1/models")]
            assert time.monotonic() < deadline + 20, "a huge request was not refused within 20 s"
            time.sleep(0.05)
        for t in posts:
            t.join()
    finally:
        stream.close()
    answered_at_once(latencies)
    took, status, _ = out["huge"]
    assert status in (413, "closed", "ConnectionResetError", "BrokenPipeError") and took < 10, out["huge"]
    took, status, reply = out["over"]
    assert status == 400 and b"context_length_exceeded" in reply and took < 10, out["over"]
    after = server.request("POST", "/v1/chat/completions", GOOD)
    assert after[0] == 200, after


def test_trickling_connections_are_closed_and_health_answers(server):
    """300 connections each sending a header byte every half second, against a cap of 100 and a
    10 s header deadline: the oldest make room for new ones, the rest are closed at the deadline."""
    conns: list[socket.socket] = []
    latencies = []
    try:
        for i in range(300):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.sendall(b"G")
            conns.append(s)
            if i % 50 == 0:
                latencies.append(timed(server, "/health"))
        started = time.monotonic()
        request = b"ET /health HTTP/1.1\r\nHost: x\r\n"
        closed: set[int] = set()
        sent = 1
        while time.monotonic() - started < 14 and len(closed) < len(conns):
            for i, s in enumerate(conns):
                if i in closed:
                    continue
                try:
                    s.sendall(request[sent % len(request) : sent % len(request) + 1])
                    s.setblocking(False)
                    if s.recv(1) == b"":
                        closed.add(i)
                except BlockingIOError:
                    pass
                except OSError:
                    closed.add(i)
                finally:
                    s.setblocking(True)
            sent += 1
            latencies.append(timed(server, "/health"))
            if time.monotonic() - started < 2:
                early = len(closed)
            time.sleep(0.5)
    finally:
        for s in conns:
            s.close()
    assert early >= 200, early  # past the cap of 100, within two seconds
    assert len(closed) == 300, len(closed)  # every one, at its deadline
    answered_at_once(latencies)


def test_a_request_in_line_at_shutdown_gets_a_503(model, tmp_path):  # noqa: F811
    running = Server(tmp_path / "server.log", model, tmp_path / "store", "--max-queue", "2")
    try:
        stream = busy_stream(running)
        waiting: dict = {}
        body = {**GOOD, "stream": True}

        def ask() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", running.port, timeout=60)
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode())
            response = conn.getresponse()
            waiting["r"] = (response.status, response.read())

        thread = threading.Thread(target=ask)
        thread.start()
        running.wait_for(lambda s: s["queue"]["waiting"] == 1)
        running.proc.send_signal(signal.SIGINT)
        thread.join(30)
        stream.close()
        status, raw = waiting["r"]
        assert status == 503, raw
        assert json.loads(raw)["error"]["code"] == "server_shutting_down"
        assert running.proc.wait(30) is not None
    finally:
        running.kill()


def test_each_key_sees_its_own_figures_and_the_admin_key_all(model, tmp_path):  # noqa: F811
    keys = ["alpha-key", "beta-key"]
    running = Server(
        tmp_path / "server.log",
        model,
        tmp_path / "store",
        *("--api-key", keys[0], "--api-key", keys[1], "--admin-key", "admin-key"),
    )
    try:
        running.client(keys[0]).chat.completions.create(model="tiny-endless", messages=GOOD["messages"], max_tokens=2)
        mine, theirs = running.stats(keys[0]), running.stats(keys[1])
        assert mine["ledger"]["requests"] == 1 and theirs["ledger"]["requests"] == 0
        for view in (mine, theirs):
            assert view["view"] == "key"
            assert not {"hot_sessions", "store", "queue"} & set(view), view
            assert str(tmp_path) not in json.dumps(view)
        admin = running.stats("admin-key")
        assert admin["view"] == "admin" and admin["hot_sessions"] == 1 and admin["ledger"]["requests"] == 1
        assert admin["store"]["path"] == str(tmp_path / "store") and admin["store"]["lookups"] >= 1
        assert running.request("GET", "/v1/kvsnap/stats")[0] == 401  # no key: not even from this machine
        status, _, _ = running.request("POST", "/v1/chat/completions", GOOD, key="admin-key")
        assert status == 401  # the admin key reads figures, it answers nothing
    finally:
        running.kill()
