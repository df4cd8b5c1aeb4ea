"""Terminal rendering (rich): status on stderr, model text on stdout; the store's tables are in ``store_ui``."""

from __future__ import annotations

import contextlib
import json
import math
import re
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

if TYPE_CHECKING:  # imported where used: every command starts without it (~30 ms)
    from rich.table import Table

err = Console(stderr=True, highlight=False)
# Below this many uncached tokens a prefill is too short for a progress bar to be worth drawing.
PROGRESS_MIN_TOKENS = 1024
# Without a terminal, long work logs one line at most this often.
LOG_EVERY_S = 3.0


# C0 and C1 controls but newline and tab, DEL, and lone surrogates (bytes of a name that is not UTF-8).
_UNPRINTABLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def printable(text: str) -> str:
    """``text`` safe for a terminal: control characters shown as ``\\x..`` escapes, newline and tab kept.

    Snapshot, store and file-name text is someone else's data: an ESC in it would start a terminal
    escape sequence (set the window title, move the cursor, rewrite the screen).
    """
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)


def error(message: str) -> None:
    # Text, not markup: a message quotes names and file contents, whose brackets are not rich tags.
    err.print(Text.assemble(("error:", "bold red"), " ", printable(message)), soft_wrap=True)


def note(message: str) -> None:
    err.print(Text(printable(message), style="dim"), soft_wrap=True)


def emit(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def print_json(obj: Any) -> None:
    """One line of strict JSON: a number JSON cannot hold (NaN, Infinity) is written as a string, and
    text that is not valid Unicode (a lone surrogate) as ``\\u`` escapes rather than failing the write."""
    obj = _json_safe(obj)
    try:
        line = json.dumps(obj, ensure_ascii=False, allow_nan=False)
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(obj, allow_nan=False)
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


@contextlib.contextmanager
def status(message: str) -> Iterator[Any]:
    """A spinner with an updatable message; the callable it yields sets the message."""
    if not err.is_terminal:
        # Without a terminal a spinner cannot redraw: print each stage once, then its counter at most
        # every few seconds (a 30 s conversion must not look hung in a log).
        seen: dict[str, Any] = {"stage": None, "at": 0.0}

        def print_stage(msg: str) -> None:
            stage = re.sub(r"\d+", "#", msg)
            now = time.monotonic()
            if stage != seen["stage"] or now - seen["at"] >= LOG_EVERY_S:
                seen["stage"], seen["at"] = stage, now
                note(msg)

        yield print_stage
        return
    with err.status(message) as st:
        yield lambda msg: st.update(msg)


@contextlib.contextmanager
def prefill_progress(label: str = "prefill") -> Iterator[Any]:
    """A progress bar for long prefills, drawn only once a prefill proves long enough."""
    holder: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        if total < PROGRESS_MIN_TOKENS:
            return
        if not err.is_terminal:
            # A log gets a line every few seconds instead of a bar.
            now = time.monotonic()
            start = holder.setdefault("start", now)
            if done < total and now - holder.get("at", start) >= LOG_EVERY_S:
                holder["at"] = now
                note(f"{label}: {done:,}/{total:,} tokens ({done / total:.0%}, {now - start:.0f} s)")
            return
        if "bar" not in holder:
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

            bar = Progress(
                TextColumn(f"[dim]{label}[/]"),
                BarColumn(),
                TaskProgressColumn(),
                TextColumn("{task.completed}/{task.total} tokens"),
                TimeRemainingColumn(),
                console=err,
                transient=True,
            )
            bar.start()
            holder["bar"] = bar
            holder["task"] = bar.add_task(label, total=total)
        holder["bar"].update(holder["task"], completed=done)

    try:
        yield update
    finally:
        if "bar" in holder:
            holder["bar"].stop()


def turn_stats(result: Any) -> str:
    rate = ""
    if result.new_tokens > 1 and result.decode_s > 0:
        rate = f", {result.new_tokens / result.decode_s:.1f} tok/s"
    ttft = f", ttft {result.ttft_s:.2f} s" if result.ttft_s is not None else ""
    source = " (logits from snapshot)" if result.logits_source == "snapshot" else ""
    decided = f" (recomputed, not loaded: {result.reuse_reason})" if result.reuse_decision == "recompute" else ""
    # An answer that ended any other way than by the model's own end of turn says how it ended.
    stop = "" if result.stop_reason in ("eos", "stop", "none") else f", stop_reason {result.stop_reason}"
    return (
        f"[{result.prompt_tokens:,} prompt tokens: {result.hit_tokens:,} reused{decided}, {result.prefill_tokens:,} "
        f"prefilled in {plural(result.chunks, 'chunk')}{source}{ttft}; {result.new_tokens} new{rate}{stop}]"
    )


def dropped_line(dropped_turns: int, in_view: int, turns: int) -> str:
    return (
        f"the context is full: {_oldest(dropped_turns)} left the model's view "
        f"({in_view:,} of {plural(turns, 'turn')} in view; the conversation keeps them all)"
    )


def _oldest(turns: int) -> str:
    return "the oldest turn" if turns == 1 else f"the {turns:,} oldest turns"


def refit_line(refit: Any, source: str, context: tuple[int, str], in_view: tuple[int, int] | None) -> str:
    size, what = context
    if in_view is None:
        return (
            f"{source} holds {refit.held_tokens:,} tokens, more than {what} ({size:,}) leaves room for: "
            f"only its first {refit.kept_tokens:,} are kept for reuse"
        )
    shown, turns = in_view
    return (
        f"{source} does not fit {what} ({size:,} tokens): {_oldest(refit.dropped_turns)} left "
        f"the model's view ({shown:,} of {plural(turns, 'turn')} in view; the conversation keeps them all); "
        f"{refit.kept_tokens:,} of its {refit.held_tokens:,} tokens are reused"
    )


def resume_line(stats: Any, recomputed: int = 0, decided: Any = None) -> str:
    """The line a resume says; ``decided``: the load-or-recompute decision, when it chose to recompute."""
    if decided is not None and decided.decision == "recompute" and not stats.hit_tokens:
        return (
            f"read the conversation from {stats.path}; its {stats.snapshot_tokens:,} tokens are recomputed on the "
            f"next turn, not loaded ({decided.reason})"
        )
    return f"resumed {stats.hit_tokens:,} tokens from {stats.path} in {stats.seconds:.2f} s ({recomputed:,} recomputed)"


def stop_words(reason: str) -> str:
    """Why generation stopped, in words, for a stop that is not the end of the answer."""
    return {
        "context": "the model's context is full",
        "length": "--max-new-tokens reached",
        "repetition": "the model started repeating itself",
        "interrupted": "interrupted",
    }.get(reason, reason)


def save_line(stats: Any) -> str:
    return (
        f"saved {stats.tokens:,} tokens to {stats.path} ({human_bytes(stats.file_bytes)}, "
        f"{plural(stats.blocks_encoded, 'new block')}, {stats.seconds:.2f} s)"
    )


def _made_by(made_by: dict[str, str] | None) -> str:
    from kvsnap.provenance import describe

    return describe(made_by) if made_by else "not recorded (a resume spot checks one block)"


def _narrower(info: dict[str, Any]) -> str:
    stored = info.get("storage_dtype")
    if stored and stored != info["layout"]["dtype"]:
        return f", KV stored as {stored} (lossy)"
    return ""


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{n} B"


def print_inspect(info: dict[str, Any]) -> None:
    console = out()
    lay = info["layout"]
    ratio = f" ({info['ratio']:.2f}x raw)" if info.get("ratio") else ""
    rows = [
        ("file", info["path"]),
        ("model", info["model"]),
        ("fingerprint", info["fingerprint"]),
        ("format", f"version {info['format_version']}" + _sealed(info)),
        ("tokens", f"{info['tokens']:,}"),
        ("blocks", f"{info['blocks']:,} x {info['block_size']} tokens"),
        ("cache", f"{lay['layers']} layers x {lay['kv_heads']} kv heads x {lay['head_dim']} ({lay['dtype']})"),
        ("codec", f"{info['codec']} level {info['level']}" + _narrower(info)),
        ("raw KV", human_bytes(info["kv_bytes"])),
        ("file", f"{human_bytes(info['file_bytes'])}{ratio}"),
        ("last logits", "stored" if info["last_logits"] else "absent (a full hit recomputes one token)"),
    ]
    if info.get("chat_turns") is not None:
        hidden = info.get("dropped_messages") or 0
        view = f", the oldest {hidden} (system messages aside) out of the model's view" if hidden else ""
        rows.append(("chat", f"{info['chat_turns']} messages{view}"))
    if "made_by" in info:
        rows.append(("made by", _made_by(info["made_by"])))
    if "verified" in info:
        rows.append(("integrity", "all blocks verified" if info["verified"] else "; ".join(info["problems"])))
    if info.get("no_preview"):
        rows.append(("preview", info["no_preview"]))
    console.print(key_value_table(rows))
    # Everything below is the snapshot's own text: printed as Text (no markup), controls escaped.
    if "preview_start" in info:
        console.print(Text.assemble(("start", "bold"), " ", repr(info["preview_start"])))
        if info.get("preview_end"):
            console.print(Text.assemble(("end", "bold"), "   ", repr(info["preview_end"])))
    for m in info.get("messages") or []:
        content = m["content"] if len(m["content"]) <= 100 else m["content"][:97] + "..."
        console.print(Text.assemble((f"  {printable(m['role'])}:", "dim"), " ", printable(content)))
    if "prompt_tokens" in info:
        console.print(Text.assemble(("prompt", "bold"), " ", prompt_plan(info)), soft_wrap=True)
    for line in miss_lines(info["miss"]) if info.get("miss") else ():
        console.print(Text(line), soft_wrap=True)  # already escaped; Text: no markup


def _sealed(info: dict[str, Any]) -> str:
    sealed = info.get("encrypted")
    return f", encrypted ({sealed['cipher']}, key {sealed['key_id']})" if sealed else ""


def print_sealed(info: dict[str, Any]) -> None:
    """What an encrypted snapshot shows without its key."""
    rows = [
        ("file", info["file"]),
        ("format", f"version {info['format_version']}, encrypted ({info['cipher']}, key {info['key_id']})"),
        ("blocks", f"{info['blocks']:,}"),
        ("file", human_bytes(info["file_bytes"])),
    ]
    out().print(key_value_table(rows))


def prompt_plan(info: dict[str, Any]) -> str:
    """What a prompt would reuse from a snapshot, in one readable line."""
    sizes = info["chunk_sizes"]
    shown = ", ".join(map(str, sizes[:8])) + (", ..." if len(sizes) > 8 else "")
    line = (
        f"{plural(info['prompt_tokens'], 'token')}: {info['hit_tokens']:,} reused from the snapshot "
        f"({info['reuse_ratio']:.0%}, read from {plural(info['blocks_to_read'], 'block')}), "
        f"{info['prefill_tokens']:,} to prefill"
    )
    if info["chunks"] == 1:
        line += " in 1 chunk"
    elif info["chunks"]:
        line += f" in {info['chunks']:,} chunks ({shown} tokens)"
    if info["logits_source"] == "snapshot":
        line += "; the whole prompt is in the snapshot, with the logits to start answering"
    elif info["logits_source"] == "backoff":
        line += "; the whole prompt is in the snapshot, but its last token is run again for the logits to answer from"
    return line


# -- why a reuse missed, whether it was right (--explain, --verify) ------------------------------------


def miss_lines(miss: dict[str, Any]) -> list[str]:
    """Where reuse stopped and why, then the text on both sides of it (from » on, each side's own)."""
    source = miss["source"]
    if miss["cause"] == "none":
        return [f"nothing missed: {miss['why']}"]
    if source == "store":
        reused = f"{miss['reused_tokens']:,} prompt tokens reused from the store"
    else:
        reused = f"{miss['reused_tokens']:,} of {miss['source_tokens']:,} {source} tokens reused"
    chain = miss["cause"] in ("model", "block_size", "namespace")  # nothing of it is reused, whatever the tokens
    if miss["position"] is None:
        return [f"{reused}: {miss['why']}" + ("; the tokens agree as far as both go" if chain else "")]
    where = f"token {miss['position']:,} (block {miss['block']:,}, {miss['block_size']}-token blocks)"
    if chain:
        lines = [f"{reused}: {miss['why']}", f"  and the tokens part at {where}:"]
    else:
        lines = [f"reuse stopped at {where}, {reused}: {miss['why']}"]
    if miss.get("where"):
        lines.append(f"  closest stored prefix: {miss['where']}")
    width = max(len(source), len("prompt"))
    for name, after in ((source, miss["source_after"]), ("prompt", miss["prompt_after"])):
        lines.append(f"  {name:<{width}}: ...{_shown(miss['before'])}»{_shown(after)}...")
    if miss["cause"] in ("tokenization", "template"):
        sides = ((source, miss["source_next"]), ("prompt", miss["prompt_next"]))
        pieces = [f"{name} {' | '.join(map(repr, tokens))}" for name, tokens in sides]
        lines.append(f"  {'tokens':<{width}}: {'; '.join(pieces)}")
    return lines


def rerender_lines(rerender: dict[str, Any]) -> list[str]:
    """A chat kept the ids it ran where rendering the conversation again would tokenize it otherwise."""
    pos = rerender["position"]
    at = f"token {pos:,}" if pos is not None else "its end"
    lines = [f"kept the {rerender['source_tokens']:,} tokens the model saw; rendering again would differ at {at}: "
             f"{rerender['why']}"]  # fmt: skip
    if pos is not None:
        lines.append(f"  kept    : ...{_shown(rerender['before'])}»{_shown(rerender['source_after'])}...")
        lines.append(f"  rendered: ...{_shown(rerender['before'])}»{_shown(rerender['prompt_after'])}...")
    return lines


def _shown(text: str) -> str:
    return printable(text.replace("\n", "\\n").replace("\t", "\\t"))


def verify_line(row: dict[str, Any]) -> str:
    """One line on a spot check of reused KV (--verify, or automatic after a version change)."""
    v = row["verify"]
    verdict = "passed" if v["passed"] else "refused, recomputed"
    blocks = v.get("blocks") or [v["block"]]
    which = f"block {blocks[0]:,}" if len(blocks) == 1 else f"blocks {', '.join(f'{b:,}' for b in blocks)}"
    worst = f" (worst: block {v['block']:,})" if len(blocks) > 1 else ""
    return (
        f"verified {which}, every layer ({v['reason']}){worst}: K/V max |diff| {row['verify_max_abs_diff']:.3g} "
        f"(allowed {v['max_abs_allowed']:.3g}), logits {v['logits_max_abs_diff']:.3g} "
        f"(allowed {v['logits_max_abs_allowed']:.3g}); {verdict}; {v['tokens']} tokens, {row['verify_s']:.3f} s"
    )


# -- the block store (kvsnap store ...) ------------------------------------------------------------


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def out() -> Console:
    return Console(highlight=False)


def say(text: str) -> None:
    """A one-line report on stdout, never wrapped (scripts grep it); no markup, so names print as they are."""
    out().print(printable(text), markup=False, soft_wrap=True)


def key_value_table(rows: list[tuple[str, str]]) -> Table:
    from rich.table import Table

    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, Text(printable(str(value))))  # values quote files and names: no markup
    return table
