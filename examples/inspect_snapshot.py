"""Look inside a .kv snapshot without loading the model, and ask what a prompt would reuse.

.venv/bin/python examples/inspect_snapshot.py FILE [--prompt TEXT]
"""

from __future__ import annotations

import argparse
import json

from kvsnap.engine import describe
from kvsnap.format import Snapshot
from kvsnap.models.locate import find_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--prompt")
    args = parser.parse_args()

    with Snapshot(args.file) as snap:
        meta = snap.meta
        print(f"{meta.num_tokens} tokens of {meta.model} in {len(meta.blocks)} blocks of {meta.block_size}")
        print(f"raw KV {meta.kv_bytes:,} bytes, stored {meta.stored_bytes:,} bytes ({meta.codec})")
        print("every block verifies" if not snap.verify() else "damaged blocks found")

    tokenizer = find_tokenizer(meta.model, meta.extra.get("model_folder"))
    prompt_ids = tokenizer.encode(args.prompt) if (args.prompt and tokenizer) else None
    info = describe.describe(args.file, prompt_ids=prompt_ids, tokenizer=tokenizer)
    keys = ["tokens", "blocks", "kv_bytes", "file_bytes", "codec", "prompt_tokens", "hit_tokens", "prefill_tokens"]
    print(json.dumps({k: info[k] for k in keys if k in info}))


if __name__ == "__main__":
    main()
