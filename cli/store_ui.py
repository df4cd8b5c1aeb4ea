"""The block store's tables and tree (``kvsnap store stats|sessions|tree``), rendered with rich."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.text import Text

from kvsnap.provenance import describe
from kvsnap_cli.ui import human_bytes, key_value_table, note, out, plural, printable

if TYPE_CHECKING:  # imported where used: every command starts without them (~30 ms)
    from rich.tree import Tree

# Longest token-text preview in the store tree, in characters of its repr.
PREVIEW_CHARS = 60


def print_store_stats(info: dict[str, Any]) -> None:
    budget = info["budget_bytes"]
    used = f" ({info['bytes'] / budget:.0%} of the budget)" if budget else ""
    rows = [
        ("store", info["path"]),
        ("blocks", f"{info['blocks']:,} ({info['leaves']:,} leaves) in {plural(info['roots'], 'chain')}"),
        ("bytes", f"{human_bytes(info['bytes'])}{used}, {human_bytes(info['raw_bytes'])} raw"),
        ("budget", human_bytes(budget) if budget is not None else "none"),
        ("sessions", f"{info['sessions']:,} ({info['pinned_sessions']:,} pinned)"),
        ("pinned", human_bytes(info["pinned_bytes"])),
        (
            "lookups",
            f"{info['lookups']:,}: {info['hits']:,} of {info['lookup_blocks']:,} blocks hit "
            f"({info['block_hit_rate']:.1%}), {info['hit_tokens']:,} of {info['prompt_tokens']:,} tokens reused",
        ),
        ("evictions", f"{info['evictions']:,}"),
        ("damaged", f"{info['damaged']:,} blocks found damaged and dropped"),
    ]
    for i, maker in enumerate(info.get("made_by", [])):
        made = f"{plural(maker['blocks'], 'block')} ({human_bytes(maker['bytes'])}): {describe(maker['made_by'])}"
        rows.append(("made by" if i == 0 else "", made))
    out().print(key_value_table(rows))


def print_store_sessions(rows: list[dict[str, Any]]) -> None:
    if not rows:
        note("no sessions in the store")
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False)
    for col in ("name", "tokens", "blocks", "pinned", "chat", "model"):
        table.add_column(col, justify="right" if col in ("tokens", "blocks", "chat") else "left")
    for r in rows:
        blocks = f"{r['blocks']}" if r["present_blocks"] == r["blocks"] else f"{r['present_blocks']}/{r['blocks']}"
        chat = str(r["chat_turns"]) if r["chat_turns"] is not None else "-"
        name, model = Text(printable(r["name"])), Text(printable(r["model"] or "?"))  # store text: no markup
        table.add_row(name, f"{r['tokens']:,}", blocks, "yes" if r["pinned"] else "", chat, model)
    out().print(table)


def print_store_tree(path: Any, clock: int, roots: list[dict[str, Any]]) -> None:
    if not roots:
        note("the store holds no blocks")
        return
    console = out()
    console.print(printable(f"{path}: last use counts on the store's clock (now {clock:,})"), style="dim", markup=False)
    for root in roots:
        console.print(_render_root(root))


def _render_root(root: dict[str, Any]) -> Tree:
    lay = root["layout"]
    label = Text.assemble(
        (printable(root["model"]), "bold"),
        (f"  block size {root['block_size']}, {lay['dtype']}, root {root['root'][:12]}", "dim"),
    )
    from rich.tree import Tree

    top = Tree(label)
    _render_nodes(top, root["children"])
    return top


def _render_nodes(parent: Tree, nodes: list[dict[str, Any]]) -> None:
    for node in nodes:
        label = Text()
        if "text" in node:
            label.append(_preview(node["text"]), style="green")
            label.append("  ")
        label.append(f"{plural(node['tokens'], 'token')}", style="bold")
        details = [
            plural(node["blocks"], "block") + (" (last partial)" if node["partial"] else ""),
            human_bytes(node["bytes"]),
            f"last use {node['last_use']:,}",
        ]
        label.append("  " + ", ".join(details), style="dim")
        if node["pins"]:
            label.append(f"  pinned x{node['pins']}", style="yellow")
        if node["sessions"]:
            label.append("  <- " + printable(", ".join(node["sessions"])), style="cyan")
        branch = parent.add(label)
        _render_nodes(branch, node["children"])
        if node.get("hidden_nodes"):
            branch.add(Text(f"... {plural(node['hidden_nodes'], 'more node')} below", style="dim"))


def _preview(text: str) -> str:
    shown = repr(text)
    if len(shown) <= PREVIEW_CHARS:
        return shown
    half = (PREVIEW_CHARS - 3) // 2
    return shown[:half] + "..." + shown[-half:]
