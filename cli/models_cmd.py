"""``kvsnap models``: the models kvsnap downloaded or converted, and ``kvsnap models rm NAME``. No torch."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.text import Text

from kvsnap_cli import ui
from kvsnap_cli.common import guarded

app = typer.Typer(
    help=(
        "The models kvsnap keeps: GGUF files it converted (the default model among them), hub models it "
        "downloaded and the quantized forms it kept of models (made by their first quantized load), with their "
        "sizes. NAME is what --model takes and what snapshots made with it record."
    ),
    invoke_without_command=True,
)

Json = Annotated[bool, typer.Option("--json", metavar="", help="Print one JSON object.")]


@app.callback()
@guarded
def models(ctx: typer.Context, json_out: Json = False) -> None:
    """List the models kvsnap keeps (see `kvsnap models rm`)."""
    if ctx.invoked_subcommand is not None:
        return
    from kvsnap.models.catalog import list_models

    entries = list_models()
    if json_out:
        ui.print_json({"models": [e.to_dict() for e in entries]})
        return
    if not entries:
        ui.note("no models yet: kvsnap pull [NAME] fetches or converts one")
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for column in ("name", "kind", "size", "quantized", "folder"):
        table.add_column(column, justify="right" if column in ("size", "quantized") else "left", overflow="fold")
    for e in entries:
        forms = " + ".join(ui.human_bytes(n) for _, n in e.quantized) or "-"
        path = Text(ui.printable(str(e.path)))
        table.add_row(Text(ui.printable(e.name)), e.kind, ui.human_bytes(e.bytes), forms, path)
    ui.out().print(table)
    if any(e.quantized for e in entries):
        ui.note("quantized: the forms kept of a model quantized once (int8, int4), mapped by later loads")
    total = sum(e.bytes for e in entries)
    ui.note(f"{ui.plural(len(entries), 'model')}, {ui.human_bytes(total)}; kvsnap models rm NAME removes one")


@app.command("rm")
@guarded
def rm(
    name: Annotated[str, typer.Argument(metavar="NAME", help="A model as `kvsnap models` lists it.")],
    json_out: Json = False,
) -> None:
    """Remove one model kvsnap converted or downloaded, and nothing else.

    A converted folder under $KVSNAP_HOME/models goes, with the quantized forms kept of it under
    $KVSNAP_HOME/quantized (a form of another folder is listed, and removed, by its file name). A hub download
    goes from the Hugging Face cache only if kvsnap made that cache entry; one that was there before is left,
    and said so. `kvsnap pull NAME` brings a model back.
    """
    from kvsnap.models.catalog import remove_model

    result = remove_model(name)
    if json_out:
        ui.print_json({"name": name, "removed": [str(p) for p in result.removed], "kept": result.kept})
        return
    for path in result.removed:
        ui.say(f"removed {path}")
    for line in result.kept:
        ui.note(line)
