"""A chat that outgrew its context: recompute the kept turns, or shift their KV? Time and accuracy.

A conversation fills most of the context; the next message makes the chat drop its oldest turns
from the model's view (``kvsnap.engine.chat_view``: down to half the context). Two ways to get the KV
of what is kept, each followed by the new message's prefill:

- recompute (what kvsnap does): the system prompt's KV is reused, the kept turns and the new message
  are prefilled at their new positions; exact: the same KV and answer as a cold run over the kept messages.
- shift (llama.cpp's context shift): the dropped turns' KV is cut out and the kept keys re-rotated by
  RoPE to their new positions, then only the new message is prefilled. The kept tokens' KV still holds
  what the dropped turns contributed through attention, so it differs from the KV of the kept messages.

Reported per context: both times, the largest K/V difference between the shifted and the recomputed KV
(layer 0 alone shows the rotation's rounding: its KV depends on the token only), the logits' difference
at the end of the prompt and how many of the next ``--answer`` greedy tokens agree.

    .venv/bin/python benchmarks/context_shift.py [--contexts 1024 2048 4096] [--answer 32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    best_of_each,
    describe,
    document,
    machine,
    model_arguments,
    synced,
    table,
    write_json,
)
from kvsnap.config import SamplingParams  # noqa: E402
from kvsnap.engine.cache import cache_from_buffer  # noqa: E402
from kvsnap.engine.chat_template import render_chat as render  # noqa: E402
from kvsnap.engine.chat_view import answer_room, fit  # noqa: E402
from kvsnap.engine.runner import Runner, generate  # noqa: E402
from kvsnap.engine.session import Session  # noqa: E402
from kvsnap.models import load_model  # noqa: E402
from kvsnap.types import chat_view  # noqa: E402


def conversation(lm, context: int, room: int) -> tuple[list[dict[str, str]], dict[str, str]]:
    """A system message and as many turns of pseudo-prose as fit ``context`` with ``room`` to spare, and a
    next message that, with ``room`` for its answer, does not fit any more: the turn that drops."""
    tok = lm.tokenizer
    size = max(8, context // 16)

    def text(seed: int, n: int = size) -> str:
        return tok.decode(document(tok, n, seed=seed)).strip()

    messages = [{"role": "system", "content": text(0)}]
    seed = 1
    while True:
        turn = [{"role": "user", "content": text(seed)}, {"role": "assistant", "content": text(seed + 1)}]
        seed += 2
        if len(render(lm, messages + turn, False)) + room > context:
            break
        messages += turn
    free = context - room - len(render(lm, messages, False))
    return messages, {"role": "user", "content": text(seed, max(size, free + 8))}


def inv_freq(lm) -> torch.Tensor | None:
    """RoPE's inverse frequencies of a plain (unscaled) RoPE model, else None."""
    decoder = lm.model.model
    freq = getattr(decoder, "inv_freq", None)
    if freq is None:
        rotary = getattr(decoder, "rotary_emb", None)
        if rotary is None or getattr(rotary, "attention_scaling", 1.0) != 1.0:
            return None
        freq = rotary.inv_freq
    return freq.float()


def shift(lm, cache, a: int, b: int, length: int, capacity: int, freq: torch.Tensor):
    """A new cache: tokens ``[0, a)`` as they are, ``[b, length)`` moved to ``a..`` with their keys re-rotated
    by ``-(b - a)`` positions (RoPE: rotating by p then by -d is rotating by p - d)."""
    layers = cache.layers
    first = layers[0].keys
    kept = length - (b - a)
    buf = torch.empty(
        (len(layers), 2, first.shape[1], capacity, first.shape[3]), dtype=first.dtype, device=first.device
    )
    angle = -(b - a) * freq.to(first.device)
    emb = torch.cat((angle, angle))
    cos, sin = emb.cos(), emb.sin()
    half = first.shape[3] // 2
    for i, layer in enumerate(layers):
        k, v = layer.keys[0], layer.values[0]
        buf[i, 0, :, :a] = k[:, :a]
        buf[i, 1, :, :a] = v[:, :a]
        moved = k[:, b:length].float()
        rotated = torch.cat((-moved[..., half:], moved[..., :half]), dim=-1)
        buf[i, 0, :, a:kept] = (moved * cos + rotated * sin).to(first.dtype)
        buf[i, 1, :, a:kept] = v[:, b:length]
    return cache_from_buffer(lm.config, buf, kept)


def measure(lm, context: int, answer: int, repeats: int) -> dict:
    room = answer_room(context, answer)
    history, message = conversation(lm, context, room)
    view = fit(lambda m: render(lm, m), [*history, message], 0, context, room)
    kept_history = chat_view(history, view.dropped)
    held = render(lm, history, False)  # what the session holds when the message comes
    shown = render(lm, kept_history, False)
    prompt = view.ids
    a = len(render(lm, history[:1], False))
    b = a + len(held) - len(shown)
    row = {
        "context": context,
        "held_tokens": len(held),
        "dropped_turns": view.dropped_turns,
        "dropped_tokens": b - a,
        "kept_tokens": len(shown) - a,
        "prompt_tokens": len(prompt),
    }
    # A shift moves token ids as they are: the kept view must be the held tokens with the dropped span cut
    # out (a template that renders turns on their own), and the prompt must extend it.
    if held[:a] + held[b:] != shown or prompt[: len(shown)] != shown:
        return {**row, "shift": "not applicable: the kept view is not the held tokens with a span cut out"}
    freq = inv_freq(lm)
    if freq is None:
        return {**row, "shift": "not applicable: RoPE with scaling"}
    source = Session(lm)
    source.prefill(held)
    runner = Runner(lm)
    params = SamplingParams(max_new_tokens=answer, temperature=0, stop_loops=False)
    system = render(lm, history[:1], False)

    def recompute():
        s = Session(lm)
        s.prefill(system)  # what stays of the held KV: the system prompt
        s.prefill(prompt)
        return s

    def shifted():
        cache = shift(lm, source.cache, a, b, len(held), len(prompt) + answer + 1, freq)
        logits = runner.forward(cache, prompt[len(shown) :], len(shown))
        return cache, logits

    dev = lm.device
    times = best_of_each(repeats, {"recompute": synced(dev, recompute), "shift": synced(dev, shifted)})
    exact = times["recompute"][1][-1]
    cache, logits = times["shift"][1][-1]
    cold = Session(lm)
    cold.prefill(prompt)
    k_diff = [
        (layer.keys[0, :, : len(prompt)] - ref.keys[0, :, : len(prompt)]).abs().max().item()
        for layer, ref in zip(cache.layers, exact.cache.layers)
    ]
    v_diff = [
        (layer.values[0, :, : len(prompt)] - ref.values[0, :, : len(prompt)]).abs().max().item()
        for layer, ref in zip(cache.layers, exact.cache.layers)
    ]
    k_scale = max(ref.keys[0, :, : len(prompt)].abs().max().item() for ref in exact.cache.layers)
    ref_logits = exact.last_logits
    want = exact.generate(params).token_ids
    got = generate(runner, cache, logits, len(prompt), params).token_ids
    same = next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), min(len(want), len(got)))
    return {
        **row,
        "shift": "measured",
        "recompute_s": times["recompute"][0],
        "shift_s": times["shift"][0],
        "recompute_vs_shift": times["recompute"][0] / times["shift"][0],
        "recompute_equals_cold": cold.generate(params).token_ids == want,
        "k_diff_layer0": k_diff[0],
        "kv_max_diff": max(k_diff + v_diff),
        "k_max_abs": k_scale,
        "logits_max_diff": (logits - ref_logits).abs().max().item(),
        "top1_same": int(logits.argmax()) == int(ref_logits.argmax()),
        "answer_tokens": len(want),
        "same_answer_tokens": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--answer", type=int, default=32, help="greedy tokens compared after the prompt")
    model_arguments(parser)
    args = parser.parse_args()
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    Session(lm).prefill(document(lm.tokenizer, 64))  # warm up kernels and allocator
    rows = []
    for context in args.contexts:
        rows.append(measure(lm, context, args.answer, args.repeats))
        print(f"  context {context}: {rows[-1]['shift']}", file=sys.stderr)
    info = machine()
    print(describe(info))
    print(f"model {args.model}, {lm.device}, {lm.layout.dtype}, best of {args.repeats}, {args.answer} greedy tokens")
    cols = [
        ("context", "context", "d"),
        ("held_tokens", "held", "d"),
        ("dropped_tokens", "dropped", "d"),
        ("kept_tokens", "kept", "d"),
        ("prompt_tokens", "prompt", "d"),
        ("recompute_s", "recompute s", ".3f"),
        ("shift_s", "shift s", ".4f"),
        ("k_diff_layer0", "K diff L0", ".2g"),
        ("kv_max_diff", "KV max diff", ".3g"),
        ("k_max_abs", "max |K|", ".3g"),
        ("logits_max_diff", "logits diff", ".3g"),
        ("top1_same", "top-1 same", ""),
        ("same_answer_tokens", "same tokens", "d"),
    ]
    print(table(rows, cols))
    for row in rows:
        if row["shift"] != "measured":
            print(f"context {row['context']}: shift {row['shift']}")
    payload = {"machine": info, "model": args.model, "dtype": lm.layout.dtype, "answer_tokens": args.answer}
    path = write_json("context_shift", {**payload, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
