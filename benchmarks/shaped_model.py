"""Write a random-weight model with a real model's config and tokenizer: the same shapes, the same
speed, none of its 500 MB of weights to carry.

For machines that cannot fetch or carry the default model (the lent GPU machine takes 64 MiB of
files): copy the converted model's small files there, and build the weights on the spot.

    .venv/bin/python benchmarks/shaped_model.py --export DIR     # here: copy config + tokenizer into DIR
    python3 benchmarks/shaped_model.py DIR OUT                   # there: OUT = DIR's files + random weights
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def export(model: str, dest: Path) -> None:
    from kvsnap.models import resolve_model

    folder = Path(resolve_model(model))
    dest.mkdir(parents=True, exist_ok=True)
    for name in SMALL_FILES:
        if (folder / name).is_file():
            shutil.copy2(folder / name, dest / name)
    print(dest)


def build(src: Path, out: Path, seed: int = 0) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(src))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in SMALL_FILES:
        if (src / name).is_file() and name != "config.json":
            shutil.copy2(src / name, out / name)
    print(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("src", nargs="?", type=Path, help="folder with a config.json and tokenizer files")
    parser.add_argument("out", nargs="?", type=Path, help="where to write the random-weight model")
    parser.add_argument("--export", type=Path, metavar="DIR", help="copy the small files of --model into DIR")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    if args.export is not None:
        export(args.model, args.export)
    elif args.src is not None and args.out is not None:
        build(args.src, args.out)
    else:
        parser.error("give --export DIR, or SRC and OUT")


if __name__ == "__main__":
    main()
