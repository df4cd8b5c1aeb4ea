"""``kvsnap serve``: a local OpenAI-compatible server whose prefix cache lives in the block store."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvsnap import config
from kvsnap_cli import options as o
from kvsnap_cli import ui
from kvsnap_cli.common import guarded

DEFAULT_PORT = 8080
DEFAULT_MAX_QUEUE = 16
DEFAULT_MAX_CONNECTIONS = 1000

SERVER = "Server"
Host = Annotated[
    str,
    typer.Option(
        metavar="ADDR",
        help="Address to listen on; any but loopback needs an API key (default 127.0.0.1).",
        show_default=False,
        rich_help_panel=SERVER,
    ),
]
Port = Annotated[
    int,
    typer.Option(
        callback=o.within(0, 65535),
        metavar="PORT",
        help="Port to listen on; 0: any free one, shown at start (default 8080).",
        show_default=False,
        rich_help_panel=SERVER,
    ),
]
ApiKey = Annotated[
    list[str] | None,
    typer.Option(
        "--api-key",
        envvar="KVSNAP_API_KEY",
        show_envvar=False,
        metavar="KEY",
        help="Require Authorization: Bearer KEY (repeatable; each key gets its own cache namespace, so users "
        "never share blocks). A key on the command line shows in `ps`: on a shared machine use "
        "--api-keys-file or env KVSNAP_API_KEY.",
        rich_help_panel=SERVER,
    ),
]
AdminKey = Annotated[
    list[str] | None,
    typer.Option(
        "--admin-key",
        envvar="KVSNAP_ADMIN_KEY",
        help="A key (Authorization: Bearer KEY) that opens the whole server's figures at /v1/kvsnap/stats: "
        "every key's totals, the store's stats and path. Without API keys, requests from this machine "
        "see them anyway. Not an API key: it answers no completion.",
    ),
]
ApiKeysFile = Annotated[
    Path | None,
    typer.Option(metavar="FILE", help="API keys, one per line (# comments), with --api-key's.", rich_help_panel=SERVER),
]
MaxQueue = Annotated[
    int,
    typer.Option(
        callback=o.within(0),
        metavar="N",
        help="Requests waiting while one is answered; then 503 (default 16).",
        show_default=False,
        rich_help_panel=SERVER,
    ),
]
MaxConnections = Annotated[
    int,
    typer.Option(
        min=1,
        help="Open connections at most (kept below the file limit); past that, a new connection closes the one "
        "that has owed its request longest. A request's headers must arrive within 10 s, its body within 60 s.",
    ),
]
Encrypt = Annotated[
    bool,
    typer.Option(
        help="Encrypt the block store (AES-256-GCM, names keyed) with the key in the file $KVSNAP_KEY_FILE names "
        "(`kvsnap keygen FILE`); a new store only, an encrypted store opens with its key anyway.",
    ),
]
NoStore = Annotated[
    bool,
    typer.Option(
        "--no-store", metavar="", help="The prefix cache in memory only, gone with the server.", rich_help_panel=o.STORE
    ),
]


@guarded
def serve(
    model: o.Model = config.DEFAULT_MODEL,
    host: Host = "127.0.0.1",
    port: Port = DEFAULT_PORT,
    api_key: ApiKey = None,
    api_keys_file: ApiKeysFile = None,
    admin_key: AdminKey = None,
    max_queue: MaxQueue = DEFAULT_MAX_QUEUE,
    max_connections: MaxConnections = DEFAULT_MAX_CONNECTIONS,
    store: o.Store = None,
    no_store: NoStore = False,
    encrypt: Encrypt = False,
    store_budget: o.StoreBudget = None,
    namespace: o.Namespace = "",
    block_size: o.BlockSize = config.DEFAULT_BLOCK_SIZE,
    chunk_size: o.ChunkSize = config.DEFAULT_CHUNK_SIZE,
    ctx_size: o.CtxSize = None,
    device: o.Device = config.DEFAULT_DEVICE,
    dtype: o.Dtype = config.DEFAULT_DTYPE,
    quantize: o.Quantize = config.DEFAULT_QUANTIZE,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API whose prefix cache survives restarts.

    Endpoints: POST /v1/chat/completions and /v1/completions (stream or not), GET /v1/models,
    /health and /v1/kvsnap/stats. Every request reuses the longest prefix held in memory (the last
    conversation) or in the block store (default: $KVSNAP_HOME/store), prefills only the rest, and
    adds its new blocks to the store; usage.prompt_tokens_details.cached_tokens reports the reuse.
    Requests are answered one at a time, in arrival order.

      kvsnap serve --port 8080

      curl http://127.0.0.1:8080/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'
    """
    from types import SimpleNamespace

    from kvsnap.errors import ConfigError
    from kvsnap.sealing import key_from_env
    from kvsnap.serve import ApiKeys, is_loopback, read_keys_file
    from kvsnap_cli.batch import check_text
    from kvsnap_cli.common import default_store, open_session, open_store

    keys_given = list(api_key or [])
    if api_keys_file is not None:
        keys_given += read_keys_file(api_keys_file)
    if not is_loopback(host) and not keys_given:
        raise ConfigError(
            f"--host {host} can be reached from other machines: give --api-key or --api-keys-file too "
            "(or keep the default 127.0.0.1)"
        )
    if no_store and (store is not None or store_budget is not None or encrypt):
        raise ConfigError("--no-store cannot be combined with --store, --store-budget or --encrypt")
    check_text("--namespace", namespace)
    keys = ApiKeys(keys_given, namespace, admin_keys=list(admin_key or []))
    key = key_from_env(required="--encrypt") if encrypt else None
    session_config = config.SessionConfig(block_size=block_size, chunk_size=chunk_size, namespace=namespace, key=key)
    session_config.check(with_store=not no_store)
    sock = _bind(host, port)  # a busy port fails now, not after the model load
    try:
        store_path = None if no_store else (store or default_store())
        opts = SimpleNamespace(model=model, device=device, dtype=dtype, quantize=quantize, ctx_size=ctx_size)
        block_store = open_store(store_path, store_budget, key) if store_path is not None else None
        session = open_session(opts, session_config, workload="serve", store=block_store)
        _run(session.lm, session_config, block_store, keys, max_queue, max_connections, sock, model)
    finally:
        sock.close()


def _bind(host: str, port: int):
    import socket

    from kvsnap.errors import ConfigError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"cannot listen on {host}:{port} ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    return sock


def _run(lm, session_config, block_store, keys, max_queue: int, max_connections: int, sock, spec: str) -> None:
    import uvicorn

    from kvsnap.serve import Service, Turns
    from kvsnap_cli.serve_app import ServerState, build_app
    from kvsnap_cli.serve_conn import KEEP_ALIVE_S, connection_cap, guarded_protocol

    service = Service(lm, session_config, block_store, aliases=(spec,))
    state = ServerState(service, keys, Turns(max_queue), ui.note)
    app = build_app(state)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # Ctrl-C: running answers stop at their next token instead of holding the shutdown.
            state.cancel_all()
            super().handle_exit(sig, frame)

    cfg = uvicorn.Config(
        app,
        http=guarded_protocol(connection_cap(max_connections), log=ui.note),
        timeout_keep_alive=KEEP_ALIVE_S,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=3,
    )
    # Listen before the address is announced: a client that reads it and connects at once (a script,
    # the tests) waits in the backlog for uvicorn's loop instead of being refused.
    sock.listen(128)
    host, port = sock.getsockname()[:2]
    where = f"[{host}]" if ":" in host else host
    cache = f"block store {block_store.path}" if block_store is not None else "no block store (memory only)"
    auth = f", {ui.plural(len(keys), 'API key')}" if keys.required else ""
    ui.note(f"serving {service.model_id} at http://{where}:{port}/v1 ({cache}{auth}); Ctrl-C stops")
    Server(cfg).run(sockets=[sock])
    state.executor.shutdown(wait=True, cancel_futures=True)
