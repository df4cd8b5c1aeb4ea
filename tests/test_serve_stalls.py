"""A client that stops reading stalls nobody: ``kvsnap serve``'s app and connection guard in this
process (uvicorn in a thread), on 127.0.0.1, with the tiny model whose answers run to max_tokens.

The served model's name is long, so every streamed chunk is about 8 kB and a few hundred tokens
make a stream of megabytes: far more than the stalled client's 4 kB receive buffer, the server
socket's 4 kB send buffer and the transport's 64 kB write buffer can hold, so the server's writes
to it are paused for good. Every wait is bounded.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest
from test_serve import model  # noqa: F401  (model: the module's fixture)

from kvsnap.config import SessionConfig
from kvsnap.serve import ApiKeys, Service, Turns
from kvsnap_cli.serve_app import ServerState, build_app
from kvsnap_cli.serve_conn import guarded_protocol

LONG_NAME = "m" * 8000
BUFFER = 4096
STALLED_TOKENS = 400  # ~3 MB of events


class InProcessServer:
    """The serve app under uvicorn in a thread; ``write_timeout`` as the connection guard's."""

    def __init__(self, lm, write_timeout: float):
        import uvicorn

        self.logged: list[str] = []
        self.service = Service(lm, SessionConfig(block_size=16, chunk_size=32), model_id=LONG_NAME)
        self.state = ServerState(self.service, ApiKeys(), Turns(4), self.logged.append)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)  # accepted sockets inherit it
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(
            build_app(self.state),
            http=guarded_protocol(16, write_timeout=write_timeout, log=self.logged.append),
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def post(self, body: dict, timeout: float = 60) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode())
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    def wait_for(self, what, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, self.service.ledger()
            time.sleep(0.05)

    def close(self) -> None:
        self.state.cancel_all()
        self.server.should_exit = True
        self.thread.join(30)
        self.state.executor.shutdown(wait=True, cancel_futures=True)
        self.sock.close()


@pytest.fixture(scope="module")
def lm(model):  # noqa: F811
    from kvsnap.models import load_model

    return load_model(str(model), device="cpu", dtype="float32")


def stalled_client(port: int, max_tokens: int) -> socket.socket:
    """A streamed chat request from a socket with a small receive buffer that never reads."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
    sock.connect(("127.0.0.1", port))
    body = json.dumps(
        {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": max_tokens, "stream": True}
    ).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)
    return sock


def read_all(sock: socket.socket, timeout: float = 60) -> bytes:
    """Everything the server sent until it closed the connection or ended the (chunked) stream."""
    sock.settimeout(timeout)
    got = bytearray()
    try:
        while not got.endswith(END):
            piece = sock.recv(1 << 20)
            if not piece:
                break
            got += piece
    except ConnectionResetError:
        pass
    return bytes(got)


def sse_events(raw: bytes) -> list[str]:
    """The data of each server-sent event in a chunked HTTP response."""
    body, rest = bytearray(), raw.partition(b"\r\n\r\n")[2]
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        body += rest[:n]
        rest = rest[n + 2 :]
    return [e.removeprefix("data: ") for e in body.decode().split("\n\n") if e]


END = b"\r\n0\r\n\r\n"  # the last chunk of a chunked response
SHORT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_a_client_that_stops_reading_holds_no_one_else(lm):
    server = InProcessServer(lm, write_timeout=600)  # never dropped here: only the turn is at stake
    stalled = stalled_client(server.port, STALLED_TOKENS)
    try:
        server.wait_for(lambda: server.state.turns.busy)
        status, body = server.post(SHORT)  # waits behind the stalled request's generation, not its socket
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        assert server.service.ledger()["completion_tokens"] == STALLED_TOKENS + 2
        # The stalled client lost nothing: reading at last, it gets its whole stream.
        stream = read_all(stalled)
        assert len(stream) > 2_000_000 and stream.endswith(b"data: [DONE]\n\n" + END)
        events = [json.loads(e) for e in sse_events(stream)[:-1]]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert all(e["model"] == LONG_NAME for e in events)
    finally:
        stalled.close()
        server.close()


def test_a_client_that_takes_nothing_for_the_write_timeout_is_disconnected(lm):
    server = InProcessServer(lm, write_timeout=1)
    stalled = stalled_client(server.port, 3000)  # a long generation: cancelled when the client is dropped
    try:
        server.wait_for(lambda: server.service.ledger()["cancelled"] == 1)
        assert any("disconnected" in line for line in server.logged), server.logged
        stream = read_all(stalled)
        assert b"data: [DONE]" not in stream and not stream.endswith(END)  # cut off, not finished
        status, _ = server.post(SHORT)
        assert status == 200
    finally:
        stalled.close()
        server.close()
