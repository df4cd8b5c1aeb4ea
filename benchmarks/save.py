"""Autosave cost per chat turn at 1k, 2k and 4k tokens of history: a full first save vs the
incremental save after one more turn (only the new blocks are compressed), to a ``.kv`` file
(rewritten whole, atomically) and to a block store (only the new blocks are written).

    .venv/bin/python benchmarks/save.py [--history 1024 2048 4096] [--turn 48]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import describe, document, machine, table, write_json  # noqa: E402
from kvsnap.engine.session import Session  # noqa: E402
from kvsnap.models import load_model  # noqa: E402
from kvsnap.store import BlockStore  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--history", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--turn", type=int, default=48, help="tokens one turn adds (question + answer)")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    lm = load_model(args.model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chat.kv"
        for n in args.history:
            ids = document(lm.tokenizer, n + args.turn, seed=n)
            session = Session(lm)
            session.prefill(ids[:n])
            first = session.save(path)
            session.prefill(ids)  # one more turn
            t0 = time.perf_counter()
            again = session.save(path)
            incremental = time.perf_counter() - t0
            # The same turn recorded in a block store (chat --store-session): only new blocks are
            # written, each its own file, so the cost follows the turn, not the history.
            store = BlockStore(Path(tmp) / f"store{n}")
            stored = Session(lm, store=store)
            stored.prefill(ids[:n])
            stored.store_session("chat")
            stored.prefill(ids)
            t0 = time.perf_counter()
            new_in_store = stored.store_session("chat")
            store_turn = time.perf_counter() - t0
            rows.append(
                {
                    "history": n,
                    "first_save_s": first.seconds,
                    "turn_save_s": incremental,
                    "blocks": again.blocks,
                    "new_blocks": again.blocks_encoded,
                    "file_mb": again.file_bytes / 1e6,
                    "store_turn_save_s": store_turn,
                    "store_new_blocks": new_in_store,
                }
            )
    cols = [
        ("history", "history tokens", "d"),
        ("first_save_s", "first save s", ".3f"),
        ("turn_save_s", "save after a turn s", ".3f"),
        ("blocks", "blocks", "d"),
        ("new_blocks", "blocks encoded", "d"),
        ("file_mb", "file MB", ".1f"),
        ("store_turn_save_s", "store: save after a turn s", ".3f"),
        ("store_new_blocks", "store: new blocks", "d"),
    ]
    info = machine()
    print(describe(info))
    print(f"autosave after a {args.turn}-token turn, {args.model}, {lm.device}, {lm.layout.dtype}")
    print(table(rows, cols))
    print(f"wrote {write_json('save', {'machine': info, 'turn': args.turn, 'rows': rows})}")


if __name__ == "__main__":
    main()
