"""An agent loop through `kvsnap serve`'s request path: TTFT per step, with and without the block store.

A scripted agent makes 10 tool round-trips. Every request carries the same system message and ~2k
tokens of tool schemas, the task, and every earlier call and tool result; the model's answer at
each step is a scripted `<tool_call>` (a fake sampler hands out its tokens, so every run sends the
same requests), read back by the server's parser into OpenAI `tool_calls` that the agent appends.
Four ways to serve it, each a fresh `Service` (what `kvsnap serve` runs per request, without HTTP):

- cold: no reuse at all, every step prefilled whole (a server without a prefix cache);
- memory: one server, `--no-store`: the first step pays for the whole prefix, later steps reuse
  the conversation kept in memory;
- store: one server started on a store that holds an earlier run of the same agent (another task):
  the first step already restores the fixed prefix from disk;
- store, restart each step: a new server for every step on that store (an agent started per task,
  a server that restarts): every step restores its prefix from disk.

A model whose chat template takes no tools (SmolLM2's) runs with Qwen 2.5's tool template in a
copy of its folder (the weights hard-linked where the file system allows); the output says so.

    .venv/bin/python benchmarks/agent_loop.py [--model smollm2-135m] [--steps 10] [--schema-tokens 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import describe, machine, table, write_json  # noqa: E402
from kvsnap.config import DEFAULT_BLOCK_SIZE, SessionConfig  # noqa: E402
from kvsnap.engine import runner  # noqa: E402
from kvsnap.engine.chat_template import render_chat  # noqa: E402
from kvsnap.models import load_model, load_tokenizer, resolve_model  # noqa: E402
from kvsnap.serve import CHAT, Service, parse_request, template_style  # noqa: E402
from kvsnap.store import BlockStore  # noqa: E402

# Qwen 2.5's tool template, as its tokenizer_config.json has it (system part first, then turns).
TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    '{%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}'
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == \"assistant\" %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    '{%- elif message.role == "tool" %}'
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}{{- '<|im_start|>user' }}"
    "{%- endif %}{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SYSTEM = (
    "You are the operations agent of a regional logistics company. Work step by step: call one tool at a "
    "time, read its result, and finish with a short report for the shift lead."
)
TASKS = (
    "Find why shipment 4471 is late and tell the customer.",
    "Check tomorrow's trucks for the northern depot and book any that are missing.",
    "Reconcile last week's carrier invoices against the delivered pallets.",
)
WORDS = [
    "shipment",
    "depot",
    "truck",
    "route",
    "customer",
    "invoice",
    "pallet",
    "warehouse",
    "driver",
    "schedule",
    "order",
    "stock",
    "supplier",
    "delay",
    "weather",
    "border",
    "customs",
    "manifest",
    "carrier",
    "label",
    "weight",
    "volume",
    "priority",
    "region",
    "contract",
    "report",
]


def tools_of(lm, target: int) -> list[dict[str, Any]]:
    """Tool schemas whose rendering with the system message is about ``target`` tokens."""
    rng = random.Random(0)
    tools: list[dict[str, Any]] = []

    def prose(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."

    while True:
        props = {f"{rng.choice(WORDS)}_{j}": {"type": "string", "description": prose(8)} for j in range(3)}
        schema = {"type": "object", "properties": props, "required": list(props)[:2]}
        name = f"{rng.choice(WORDS)}_{rng.choice(WORDS)}_{len(tools)}"
        tools.append({"type": "function", "function": {"name": name, "description": prose(24), "parameters": schema}})
        if len(fixed_prefix(lm, tools)) >= target:
            return tools


def fixed_prefix(lm, tools: list[dict[str, Any]]) -> list[int]:
    return render_chat(lm, [{"role": "system", "content": SYSTEM}], add_generation_prompt=False, tools=tools)


def script(tools: list[dict[str, Any]], steps: int, arguments: int) -> list[str]:
    """The model's answer at each step: a call of one of the tools, with ``arguments`` made-up arguments."""
    rng = random.Random(1)
    answers = []
    for _ in range(steps):
        fn = rng.choice(tools)["function"]
        keys = list(fn["parameters"]["properties"])[:arguments]
        args = {key: " ".join(rng.choice(WORDS) for _ in range(3)) for key in keys}
        answers.append(f"<tool_call>\n{json.dumps({'name': fn['name'], 'arguments': args})}\n</tool_call>")
    return answers


class ScriptedModel:
    """Stands in for the sampler while in a ``with``: hands out the tokens of the scripted answer,
    then the end of the turn."""

    def __init__(self, lm):
        self.tokenizer = lm.tokenizer
        self.end = min(lm.eos_token_ids)
        self.queue: list[int] = []
        self.real = runner.sample

    def __enter__(self) -> ScriptedModel:
        runner.sample = self.sample
        return self

    def __exit__(self, *exc: object) -> None:
        runner.sample = self.real

    def say(self, text: str) -> None:
        self.queue = [*self.tokenizer(text, add_special_tokens=False)["input_ids"], self.end]

    def sample(self, logits, params, generator) -> int:
        return self.queue.pop(0) if self.queue else self.end


def agent_run(tools, answers, task: str, service_for_step, model: ScriptedModel) -> list[dict[str, Any]]:
    """One agent loop: each step one request, the answer's tool call and its result appended."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    rng = random.Random(2)
    rows = []
    for step, answer in enumerate(answers, 1):
        model.say(answer)
        req = parse_request({"messages": messages, "tools": tools, "temperature": 0, "max_tokens": 256}, CHAT)
        done = service_for_step(step).complete(req)
        if not done.tool_calls:
            raise SystemExit(f"step {step}: the scripted call was not read back as a tool call: {done.text!r}")
        rows.append({"ttft_s": done.ttft_s, "prompt": done.prompt_tokens, "cached": done.cached_tokens})
        call = done.tool_calls[0]
        messages.append({"role": "assistant", "content": None, "tool_calls": [call.as_openai()]})
        result = {"status": "ok", "details": " ".join(rng.choice(WORDS) for _ in range(60))}
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    return rows


def with_tool_template(folder: Path, into: Path) -> Path:
    """A copy of a model folder that renders tools: the weights linked, the template replaced."""
    into.mkdir(parents=True)
    for item in folder.iterdir():
        if item.is_file():
            try:
                os.link(item, into / item.name)
            except OSError:
                shutil.copy2(item, into / item.name)
    config_path = into / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.unlink()  # a hard link: write a new file, not through to the original
    config_path.write_text(json.dumps(config, indent=2))
    (into / "chat_template.jinja").unlink(missing_ok=True)
    (into / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--schema-tokens", type=int, default=2000, help="system message and tool schemas, in tokens")
    parser.add_argument("--arguments", type=int, default=3, help="arguments in each call the model writes (1-3)")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    folder = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        template = "the model's own"
        if template_style(load_tokenizer(folder).chat_template) is None:
            folder = with_tool_template(folder, Path(tmp) / folder.name)
            template = "Qwen 2.5's tool template (the model's own takes no tools)"
        lm = load_model(str(folder), device=args.device, dtype=args.dtype)
        config = SessionConfig(block_size=args.block_size)
        tools = tools_of(lm, args.schema_tokens)
        fixed = len(fixed_prefix(lm, tools))
        answers = script(tools, args.steps, args.arguments)
        store = Path(tmp) / "store"

        def fresh(with_store: bool) -> Service:
            return Service(lm, config, BlockStore(store) if with_store else None)

        runs: dict[str, list[dict[str, Any]]] = {}
        with ScriptedModel(lm) as model:
            runs["cold"] = agent_run(tools, answers, TASKS[1], lambda step: fresh(False), model)
            memory = fresh(False)
            runs["memory"] = agent_run(tools, answers, TASKS[1], lambda step: memory, model)
            # An earlier run of the agent, on another task: it leaves the fixed prefix in the store.
            agent_run(tools, answers[:1], TASKS[0], lambda step: fresh(True), model)
            warm = fresh(True)
            runs["store"] = agent_run(tools, answers, TASKS[1], lambda step: warm, model)
            runs["store_restart"] = agent_run(tools, answers, TASKS[2], lambda step: fresh(True), model)

    rows = []
    for step in range(args.steps):
        row: dict[str, Any] = {"step": step + 1, "prompt": runs["cold"][step]["prompt"]}
        for name, steps in runs.items():
            row[f"{name}_ttft_s"] = steps[step]["ttft_s"]
            row[f"{name}_cached"] = steps[step]["cached"]
        rows.append(row)
    totals = {name: sum(s["ttft_s"] for s in steps) for name, steps in runs.items()}
    info = machine()
    print(describe(info))
    print(
        f"{lm.name}: {template}; {len(tools)} tools, system + schemas {fixed:,} tokens; "
        f"blocks of {args.block_size}; {args.steps} tool round-trips; TTFT in seconds (tokens reused)"
    )
    cols = [("step", "step", "d"), ("prompt", "prompt", "d")]
    for name, title in (("cold", "cold"), ("memory", "memory"), ("store", "store"), ("store_restart", "restart")):
        cols += [(f"{name}_ttft_s", title, ".3f"), (f"{name}_cached", "(reused)", "d")]
    print(table(rows, cols))
    print("sum of TTFT: " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in totals.items()))
    write_json(
        "agent_loop",
        {
            "machine": info,
            "model": lm.name,
            "template": template,
            "tools": len(tools),
            "fixed_prefix_tokens": fixed,
            "block_size": args.block_size,
            "steps": args.steps,
            "rows": rows,
            "ttft_sum_s": totals,
        },
    )


if __name__ == "__main__":
    main()
