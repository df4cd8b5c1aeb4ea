"""``kvsnap calibrate``: measure, on this machine, what a prefill and a restore cost (for --reuse auto)."""

from __future__ import annotations

from typing import Annotated

import typer

from kvsnap.config import DEFAULT_DEVICE, DEFAULT_DTYPE, DEFAULT_MODEL, DEFAULT_QUANTIZE, SessionConfig
from kvsnap_cli import options as o
from kvsnap_cli import ui
from kvsnap_cli.common import guarded, open_session


@guarded
def calibrate(
    model: o.Model = DEFAULT_MODEL,
    device: o.Device = DEFAULT_DEVICE,
    dtype: o.Dtype = DEFAULT_DTYPE,
    quantize: o.Quantize = DEFAULT_QUANTIZE,
    json_out: Annotated[bool, typer.Option("--json", metavar="", help="Print one JSON object.")] = False,
) -> None:
    """Measure, per machine, model and dtype, what a prefill and a restore of the same KV cost, and keep it.

    `--reuse auto` (the default of run and chat) loads a stored prefix only where loading is predicted faster
    than recomputing it. It measures once per machine, model and dtype (on each device) when a decision first
    needs it; this measures again (after a driver, library or hardware change).
    """
    from types import SimpleNamespace

    from kvsnap.engine.calibrate import calibrate as measure
    from kvsnap.engine.costs import cache_path

    opts = SimpleNamespace(model=model, device=device, dtype=dtype, quantize=quantize, ctx_size=None)
    lm = open_session(opts, SessionConfig(), store=None).lm

    with ui.status("measuring load vs recompute for this model and dtype") as update:
        cost = measure(lm, progress=update)
    rows = []
    for tokens, stored, load_s in cost.loads:
        prefill_s = dict(cost.prefill).get(tokens)
        rows.append(
            {
                "tokens": tokens,
                "prefill_s": prefill_s,
                "load_s": load_s,
                "stored_bytes": stored,
                "faster": "load" if prefill_s is None or load_s <= prefill_s else "recompute",
            }
        )
    info = {**cost.to_json(), "path": str(cache_path(lm)), "model": model, "device": str(lm.device), "rows": rows}
    if json_out:
        ui.print_json(info)
        return
    for r in rows:
        ui.say(
            f"{r['tokens']:>6,} tokens: recompute {r['prefill_s']:.4f} s, load {r['load_s']:.4f} s "
            f"({ui.human_bytes(r['stored_bytes'])}): {r['faster']} is faster"
        )
    ui.say(
        f"restore {cost.load_bytes_per_s / 1e6:,.0f} MB/s + {cost.load_overhead_s * 1e3:.1f} ms; "
        f"kept in {cache_path(lm)}"
    )
