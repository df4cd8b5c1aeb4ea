"""``kvsnap store``: look after a block store (kvsnap/store.py) from the shell. No model, no torch.

Every command but ``import`` opens the store with ``create=False``, so a mistyped DIR is an error
rather than a new, empty store. DIR is optional: the one store setting (``cli/store_args.py``).
Reports go to stdout (one JSON object with ``--json``), errors to stderr as one line with exit code 1
(``guarded``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvsnap_cli import store_explain, store_interchange, store_ui, ui
from kvsnap_cli.common import guarded
from kvsnap_cli.store_args import Dir, Json, args, open_store, split, store_dir

if TYPE_CHECKING:
    from kvsnap.models.locate import LightTokenizer

app = typer.Typer(
    help=(
        "Look after a block store: a folder of KV blocks shared by many sessions, each block stored once, "
        "kept under a budget by evicting least recently used leaves (never a shared prefix still in use, "
        "never a pinned session's blocks). DIR defaults to $KVSNAP_STORE, else $KVSNAP_HOME/store: the store "
        "serve uses, and run and chat use when KVSNAP_STORE is set."
    ),
    no_args_is_help=True,
)

NameArgs = args("NAME", "NAME: a session's name in the store (see `kvsnap store sessions`).")
SizeArgs = args("SIZE|none", "SIZE: the new budget (200MB, 2GB, 1.5GiB, a byte count, or `none` for no limit).")


# -- stats and sessions -------------------------------------------------------------------------


@app.command("stats")
@guarded
def stats(given_dir: Dir = None, json_out: Json = False) -> None:
    """Counts of a store: blocks, bytes (stored and raw), budget, sessions, pins, lookups, hits and evictions."""
    info = open_store(store_dir(given_dir)).stats()
    if json_out:
        ui.print_json(info)
        return
    store_ui.print_store_stats(info)


@app.command("sessions")
@guarded
def sessions(given_dir: Dir = None, json_out: Json = False) -> None:
    """List the named sessions: tokens, blocks still stored, pinned, chat turns."""
    index = open_store(store_dir(given_dir)).read_index()
    rows = []
    for s in sorted(index.sessions.values(), key=lambda s: s.name):
        rows.append(
            {
                "name": s.name,
                "model": index.chains[s.root].model if s.root in index.chains else None,
                "tokens": len(s.token_ids),
                "blocks": len(s.hashes),
                "present_blocks": index.present_blocks(s),
                "pinned": s.pinned,
                "chat_turns": len(s.messages) if s.messages is not None else None,
            }
        )
    if json_out:
        ui.print_json({"sessions": rows})
        return
    store_ui.print_store_sessions(rows)


# -- tree ----------------------------------------------------------------------------------------


@app.command("tree")
@guarded
def tree(
    given_dir: Dir = None,
    depth: Annotated[
        int | None, typer.Option(min=1, help="Show this many levels below each chain root (default: all).")
    ] = None,
    json_out: Json = False,
) -> None:
    """The radix view: a shared prefix once, the branches below it, with token counts, sizes, pins and last use.

    Token text is shown when the model's tokenizer is on this machine; token counts otherwise.

    `last use` counts on the store's use clock: the evictable leaf with the lowest goes first.
    """
    from kvsnap.models.locate import find_tokenizer

    path = store_dir(given_dir)
    view = open_store(path).tree()
    tokenizers = {r["model"]: find_tokenizer(r["model"]) for r in view["roots"]}
    roots = [{**r, "children": _annotate(r["children"], tokenizers[r["model"]], depth, 1)} for r in view["roots"]]
    if json_out:
        ui.print_json({"path": str(path), "clock": view["clock"], "roots": roots})
        return
    store_ui.print_store_tree(path, view["clock"], roots)


def _annotate(nodes: list[dict[str, Any]], tok: LightTokenizer | None, depth: int | None, level: int) -> list:
    """The library's tree nodes plus ``tokens`` and, with a tokenizer, ``text``; cut below ``depth``."""
    annotated = []
    for node in nodes:
        extra: dict[str, Any] = {"tokens": len(node["token_ids"])}
        if tok is not None:
            extra["text"] = tok.decode(node["token_ids"])
        if depth is not None and level >= depth:
            children = []
            if node["children"]:
                extra["hidden_nodes"] = _count(node["children"])
        else:
            children = _annotate(node["children"], tok, depth, level + 1)
        annotated.append({**node, **extra, "children": children})
    return annotated


def _count(nodes: list[dict[str, Any]]) -> int:
    return sum(1 + _count(n["children"]) for n in nodes)


# -- explain (cli/store_explain.py) --------------------------------------------------------------

app.command("explain")(store_explain.explain)


# -- upkeep --------------------------------------------------------------------------------------


@app.command("gc")
@guarded
def gc(given_dir: Dir = None, json_out: Json = False) -> None:
    """Tidy the store, and report what went.

    Removes crash leftovers and block files the index does not name, drops blocks a run could not use
    (missing, damaged, not decoding; with those below), drops unpinned sessions left with no block, then
    evicts to the budget.

    Deletes only files kvsnap writes: anything else in the folder is listed, never deleted. Refused while the
    index is missing or unreadable: `kvsnap store check --repair DIR` rebuilds it first.
    """
    store = open_store(store_dir(given_dir))
    report = dataclasses.asdict(store.gc())
    after = store.stats()
    info = {**report, "unknown": list(report["unknown"]), "blocks": after["blocks"], "bytes": after["bytes"]}
    if json_out:
        ui.print_json(info)
        return
    ui.say(
        f"removed {ui.plural(report['temp_files'], 'temp file')} and "
        f"{ui.plural(report['orphan_files'], 'orphan file')}; "
        f"dropped {ui.plural(report['dropped_blocks'], 'missing or damaged block')} and "
        f"{ui.plural(report['dropped_sessions'], 'empty session')}; evicted {ui.plural(report['evicted'], 'block')}. "
        f"Store: {ui.plural(after['blocks'], 'block')}, {ui.human_bytes(after['bytes'])}."
    )
    _left_alone(report["unknown"])


def _left_alone(unknown: list[str] | tuple[str, ...]) -> None:
    if unknown:
        ui.note(f"left alone {ui.plural(len(unknown), 'file')} kvsnap did not write: {', '.join(unknown)}")


@app.command("check")
@guarded
def check(
    given_dir: Dir = None,
    repair: Annotated[
        bool,
        typer.Option(
            "--repair",
            help="First rebuild the index from what the block files prove (deletes nothing), then check.",
        ),
    ] = False,
    json_out: Json = False,
) -> None:
    """Read the whole store as runs read it: index invariants, every block read, checked and decoded, every
    session's logits, and anything in the folder kvsnap did not write.

    Exits 1 when it finds a problem. `kvsnap store gc DIR` drops what cannot be used; `--repair` rebuilds a
    lost or damaged index from the block files (sessions, pins and the budget live only in the index).
    """
    path = store_dir(given_dir)
    store = open_store(path)
    info: dict[str, Any] = {"path": str(path)}
    if repair:
        report = dataclasses.asdict(store.repair())
        info["repair"] = {**report, "unproven": list(report["unproven"]), "unknown": list(report["unknown"])}
        if not json_out:
            _say_repair(report)
    problems = store.check()
    info.update(ok=not problems, problems=problems)
    if json_out:
        ui.print_json(info)
    elif not problems:
        stats = store.stats()
        ui.say(
            f"{path}: sound ({ui.plural(stats['blocks'], 'block')} verified, {ui.plural(stats['sessions'], 'session')})"
        )
    else:
        for p in problems:
            ui.say(f"- {p}")
    if problems:
        ui.error(
            f"{path}: {ui.plural(len(problems), 'problem')} found (kvsnap store gc drops what cannot be used; "
            "kvsnap store check --repair rebuilds a lost or damaged index)"
        )
        raise typer.Exit(1)


def _say_repair(report: dict[str, Any]) -> None:
    if report["index"] != "sound":
        kept = f"; kept as {report['damaged_index']}" if report["damaged_index"] else ""
        ui.say(f"index was {'missing' if report['index'] == 'missing' else 'unreadable'}{kept}")
    ui.say(
        f"repair: kept {ui.plural(report['kept_blocks'], 'block')}, "
        f"recovered {ui.plural(report['recovered_blocks'], 'block')} from the block files, "
        f"dropped {ui.plural(report['dropped_blocks'], 'missing or damaged block')}"
    )
    if report["index"] != "sound" and report["recovered_blocks"]:
        ui.note("session records, pins and the budget were in the index: the recovered blocks are plain cache now")
    for line in report["unproven"]:
        ui.say(f"- not recovered (file kept): {line}")


@app.command("budget")
@guarded
def budget(given: SizeArgs, json_out: Json = False) -> None:
    """Set the store's budget (kept in the store) and evict least recently used leaves at once to fit it."""
    from kvsnap_cli.sizes import parse_size

    path, (size,) = split(given, "SIZE|none")
    budget_bytes = None if size.strip().lower() == "none" else parse_size(size)
    store = open_store(path)
    evicted = store.set_budget(budget_bytes)
    after = store.stats()
    info = {
        "budget_bytes": budget_bytes,
        "evicted": len(evicted),
        "blocks": after["blocks"],
        "bytes": after["bytes"],
        "pinned_bytes": after["pinned_bytes"],
    }
    if json_out:
        ui.print_json(info)
        return
    shown = ui.human_bytes(budget_bytes) if budget_bytes is not None else "none"
    ui.say(
        f"budget {shown}: evicted {ui.plural(len(evicted), 'block')}; "
        f"store now {ui.plural(after['blocks'], 'block')}, {ui.human_bytes(after['bytes'])}"
    )
    if budget_bytes is not None and after["bytes"] > budget_bytes:
        ui.note(
            f"still over the budget: pinned sessions hold {ui.human_bytes(after['pinned_bytes'])} "
            "(unpin one to let it go)"
        )


# -- sessions: pin, unpin, rm --------------------------------------------------------------------


@app.command("pin")
@guarded
def pin(given: NameArgs, json_out: Json = False) -> None:
    """Keep a session's blocks from eviction, whatever the budget (pins are counted per block)."""
    path, (name,) = split(given, "NAME")
    open_store(path).pin(name)
    if json_out:
        ui.print_json({"session": name, "pinned": True})
    else:
        ui.say(f"pinned session {name!r}: its blocks are kept from eviction")


@app.command("unpin")
@guarded
def unpin(given: NameArgs, json_out: Json = False) -> None:
    """Let a session's blocks be evicted again; evicts to the budget at once and says what went."""
    path, (name,) = split(given, "NAME")
    evicted = open_store(path).unpin(name)
    if json_out:
        ui.print_json({"session": name, "pinned": False, "evicted": len(evicted)})
    else:
        ui.say(f"unpinned session {name!r}; evicted {ui.plural(len(evicted), 'block')}")


@app.command("rm")
@guarded
def rm(given: NameArgs, json_out: Json = False) -> None:
    """Forget a session. Its blocks stay as cache for later prompts until evicted."""
    path, (name,) = split(given, "NAME")
    evicted = open_store(path).remove_session(name)
    if json_out:
        ui.print_json({"session": name, "removed": True, "evicted": len(evicted)})
    else:
        ui.say(f"removed session {name!r} (its blocks stay as cache); evicted {ui.plural(len(evicted), 'block')}")


# -- .kv interchange (cli/store_interchange.py) -----------------------------------------------------

app.command("export")(store_interchange.export)
app.command("import")(store_interchange.import_)
