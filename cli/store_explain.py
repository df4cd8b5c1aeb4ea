"""``kvsnap store explain``: which stored prefix a prompt comes closest to, and why reuse stops there.
No model, no torch: the tokenizer is read from the model's folder (``kvsnap.engine.describe``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvsnap.config import DEFAULT_BLOCK_SIZE, DEFAULT_MODEL
from kvsnap_cli import ui
from kvsnap_cli.common import guarded
from kvsnap_cli.store_args import Dir, Json, store_dir


@guarded
def explain(
    given_dir: Dir = None,
    prompt: Annotated[str | None, typer.Option(help="The raw prompt text.")] = None,
    prompt_file: Annotated[Path | None, typer.Option(help="Read the prompt from a file (then --prompt).")] = None,
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            help="The model a run would use: its tokenizer reads the prompt, its fingerprint (with --namespace and "
            "--block-size) names the chain a run keys its KV under. Its KV dtype is taken to be the chain's.",
        ),
    ] = DEFAULT_MODEL,
    namespace: Annotated[str, typer.Option(help="The namespace a run would use.")] = "",
    block_size: Annotated[int, typer.Option(min=1, help="The block size a run would use.")] = DEFAULT_BLOCK_SIZE,
    json_out: Json = False,
) -> None:
    """Which stored prefix a prompt comes closest to, where it diverges and why (no model is loaded).

    Every chain in the store is searched by token ids, so a prefix stored under another namespace, block size or
    model is found too, and named as the reason a run would not reuse it.
    """
    from kvsnap import provenance
    from kvsnap.engine.explain import running_model
    from kvsnap.engine.explain_sources import against_store, closest_stored
    from kvsnap.errors import ConfigError
    from kvsnap.models.locate import locate_tokenizer
    from kvsnap_cli.batch import check_text, read_prompt_file

    if prompt is None and prompt_file is None:
        raise ConfigError("give --prompt or --prompt-file")
    check_text("--prompt", prompt)
    check_text("--namespace", namespace)
    tokenizer, why = locate_tokenizer(model)
    if tokenizer is None:
        raise ConfigError(f"{why}; the prompt cannot be tokenized" if why else f"model {model} is not on this machine")
    ids = tokenizer.encode((read_prompt_file(str(prompt_file)) if prompt_file else "") + (prompt or ""))
    from kvsnap.store import BlockStore

    path = store_dir(given_dir)
    index = BlockStore(path, create=False).read_index()
    running = running_model(model, namespace, block_size)
    found = closest_stored(index, ids, running)
    miss = against_store(index, ids, tokenizer.decode, running, found)
    made_by = sorted({t for t in found.made_by if t}) if found is not None else []
    info = {
        "path": str(path),
        "prompt_tokens": len(ids),
        "matched_blocks": found.matched_blocks if found is not None else 0,
        "made_by": [provenance.parse(t) for t in made_by],
        "miss": miss.as_dict() if miss is not None else None,
    }
    if json_out:
        ui.print_json(info)
        return
    if miss is None:
        ui.say(f"{path}: the store holds no blocks")
        return
    for line in ui.miss_lines(info["miss"]):
        ui.say(line)
    if made_by:
        ui.say(f"  its blocks were made by {'; '.join(provenance.describe(t) for t in made_by)}")
