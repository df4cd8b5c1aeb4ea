"""Which operation of the native forward makes a token's values depend on how the prompt was cut.

The same tokens are prefilled twice, in two cuts (say one forward, and chunks of 7); hooks record, per
position, what every operation of every layer took and gave. An operation is a source of difference
where its inputs were bitwise equal in both runs and its output was not (for the attention core: the
q/k/v projections equal at every position up to this one, the o_proj input not; for the MLP's
activation: gate and up equal, the down_proj input not). Everything downstream of a source differs too
and is not listed.

As a script, on any model the native forward takes (the default model by default):

    .venv/bin/python tests/exact_diagnosis.py [--model smollm2-135m] [--dtype bfloat16] [--tokens 96]
        [--cut 7] [--exact]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# One layer's operations in the order they run: (name, what its input is, what its output is).
# "in:NAME" / "out:NAME": the input or output of the submodule NAME of the layer.
LAYER_OPS = (
    ("input_layernorm", "in:input_layernorm", "out:input_layernorm"),
    ("q_proj", "in:self_attn.q_proj", "out:self_attn.q_proj"),
    ("k_proj", "in:self_attn.k_proj", "out:self_attn.k_proj"),
    ("v_proj", "in:self_attn.v_proj", "out:self_attn.v_proj"),
    ("attention (rope + softmax(qk)v)", "qkv", "in:self_attn.o_proj"),
    ("o_proj", "in:self_attn.o_proj", "out:self_attn.o_proj"),
    ("post_attention_layernorm", "in:post_attention_layernorm", "out:post_attention_layernorm"),
    ("gate_proj", "in:mlp.gate_proj", "out:mlp.gate_proj"),
    ("up_proj", "in:mlp.up_proj", "out:mlp.up_proj"),
    ("silu(gate) * up", "gate_up", "in:mlp.down_proj"),
    ("down_proj", "in:mlp.down_proj", "out:mlp.down_proj"),
)


def cuts(total: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` chunks of ``total`` tokens, their sizes taken from ``sizes`` in turn."""
    out, start, i = [], 0, 0
    while start < total:
        end = min(total, start + sizes[i % len(sizes)])
        out.append((start, end))
        start, i = end, i + 1
    return out


def prefill_kv(lm, ids: Sequence[int], chunks: Sequence[tuple[int, int]], exact: bool):
    """Every layer's KV ([layers, 2, kv heads, tokens, dim]) and the last logits after prefilling ``ids``
    in ``chunks`` through the runner (what a session runs)."""
    from kvsnap.engine.cache import cache_for
    from kvsnap.engine.runner import Runner

    runner, cache = Runner(lm, exact=exact), cache_for(lm)
    logits = runner.prefill(cache, list(ids), list(chunks))
    return cache.span(0, len(ids)), logits


class _Recorder:
    """Per submodule: input and output rows by position, from forward hooks."""

    def __init__(self, model) -> None:
        self.rows: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
        self.positions: list[int] = []
        self.handles = [model.register_forward_pre_hook(self._start, with_kwargs=True)]
        for name, module in model.named_modules():
            if name.startswith("model.layers.") and not list(module.children()):
                self.handles.append(module.register_forward_hook(self._hook(name)))

    def _start(self, module, args, kwargs) -> None:
        positions = kwargs.get("position_ids")
        self.positions = [int(p) for p in positions[0]]

    def _hook(self, name: str):
        def hook(module, args, output) -> None:
            for kind, tensor in (("in", args[0]), ("out", output)):
                rows = tensor.reshape(-1, tensor.shape[-1])
                for pos, row in zip(self.positions, rows):
                    self.rows[f"{kind}:{name}"][pos] = row.detach().clone()

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _record(lm, ids: Sequence[int], chunks: Sequence[tuple[int, int]], exact: bool) -> dict[str, dict]:
    recorder = _Recorder(lm.model)
    try:
        prefill_kv(lm, ids, chunks, exact)
    finally:
        recorder.close()
    return recorder.rows


def sources(lm, ids: Sequence[int], cut_a, cut_b, exact: bool = False) -> list[tuple[int, str, int]]:
    """(layer, operation, tokens it changed) for every operation that is a source of difference
    between prefilling ``ids`` in ``cut_a`` and in ``cut_b``."""
    a, b = _record(lm, ids, cut_a, exact), _record(lm, ids, cut_b, exact)
    positions = range(len(ids))

    def same(key: str, pos: int) -> bool:
        return torch.equal(a[key][pos], b[key][pos])

    found = []
    for layer in range(lm.config.num_hidden_layers):
        prefix = f"model.layers.{layer}."

        def key(ref: str, prefix: str = prefix) -> str:
            kind, name = ref.split(":", 1)
            return f"{kind}:{prefix}{name}"

        qkv_equal_so_far = True
        for name, source, result in LAYER_OPS:
            changed = 0
            for pos in positions:
                if source == "qkv":
                    qkv_equal_so_far = qkv_equal_so_far and all(
                        same(key(f"out:self_attn.{p}_proj"), pos) for p in "qkv"
                    )
                    inputs_equal = qkv_equal_so_far
                elif source == "gate_up":
                    inputs_equal = same(key("out:mlp.gate_proj"), pos) and same(key("out:mlp.up_proj"), pos)
                else:
                    inputs_equal = same(key(source), pos)
                if inputs_equal and not same(key(result), pos):
                    changed += 1
            if changed:
                found.append((layer, name, changed))
    return found


def report(found: list[tuple[int, str, int]], tokens: int) -> str:
    if not found:
        return "no operation depends on the cut: every token's values are bitwise the same"
    per_op: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for layer, name, changed in found:
        per_op[name].append((layer, changed))
    lines = []
    for name, hits in per_op.items():
        worst = max(changed for _, changed in hits)
        lines.append(f"{name}: in {len(hits)} layers (first: layer {hits[0][0]}), up to {worst} of {tokens} tokens")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--cut", type=int, nargs="+", default=[7], help="chunk sizes of the second run, in turn")
    parser.add_argument("--exact", action="store_true", help="the batch-invariant forward (kvsnap.models.exact)")
    args = parser.parse_args()
    from kvsnap.models import load_model

    lm = load_model(args.model, device="cpu", dtype=args.dtype)
    if lm.backend != "native":
        raise SystemExit(f"{args.model} runs the {lm.backend} forward: this diagnosis hooks the native one")
    ids = [(i * 7919) % (lm.config.vocab_size - 10) + 5 for i in range(args.tokens)]
    one, other = [(0, args.tokens)], cuts(args.tokens, args.cut)
    kv_a, logits_a = prefill_kv(lm, ids, one, args.exact)
    kv_b, logits_b = prefill_kv(lm, ids, other, args.exact)
    equal = torch.equal(kv_a, kv_b)
    print(
        f"{args.model} {args.dtype}, {'exact' if args.exact else 'plain'} forward, {args.tokens} tokens: "
        f"one forward against chunks of {args.cut}: KV {'bitwise equal' if equal else 'differs'}"
        f"{'' if equal else f' (max {float((kv_a.float() - kv_b.float()).abs().max()):.3g})'}, "
        f"last logits {'equal' if torch.equal(logits_a, logits_b) else 'differ'}"
    )
    print(report(sources(lm, ids, one, other, args.exact), args.tokens))


if __name__ == "__main__":
    main()
