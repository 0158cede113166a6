"""Real-world JSON schemas through the engine: how many compile, why the others are refused,
and whether every complete constrained output validates against its schema.

Reads a directory of schema files, one JSON schema per file, in one folder per dataset (the
layout of JSONSchemaBench's ``data/``; a file ``{"schema": ..., "tests": ...}`` holds its
schema under ``schema``). Takes ``--per-dataset`` files from each folder (a seeded sample),
asks the engine's validation for each, then generates one output per accepted schema with
the bundled demo model at temperature 1 and validates those that finished with ``stop``
(``jsonschema``, the draft named by ``$schema``, formats not asserted); an output the
backend's constraint failed in (``abort``) is listed with its reason.

``--tools``: the schemas are tools' parameters instead. Each request offers one to three
of them as tools with ``tool_choice: "required"`` (the server's constraint, from
``plan_tools``); every call of a complete output must validate against its own tool's
parameters.

``--compile-only``: the acceptance and the refusals' reasons alone (the whole corpus with
``--per-dataset 100000``, a few minutes on a CPU), no model.

Usage: python scripts/schema_sweep.py --dir DATA [--per-dataset 60] [--seed 1]
       [--max-tokens 300] [--tools] [--compile-only] [--out sweep.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError  # noqa: E402
from pagedllm.entrypoints.openai.tool_choice import plan_tools  # noqa: E402
from pagedllm.structured import StructuredOutputsParams  # noqa: E402
from pagedllm.structured.llguidance_backend import LLGuidanceBackend  # noqa: E402


def load_sample(root: Path, per_dataset: int, seed: int) -> list[tuple[str, object]]:
    """(path relative to ``root``, schema) for ``per_dataset`` files of each folder."""
    rng = random.Random(seed)
    sample = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        files = sorted(folder.glob("*.json"))
        for path in rng.sample(files, min(per_dataset, len(files))):
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(doc, dict) and "schema" in doc and "tests" in doc:
                doc = doc["schema"]
            sample.append((str(path.relative_to(root)), doc))
    return sample


def as_tools(sample: list[tuple[str, object]], seed: int) -> list[tuple[str, dict]]:
    """Requests of one to three of the sampled object schemas as tools: (their files, the
    ``tool_choice: "required"`` constraint's schema, or a dict holding the 400's message
    under ``"error"``), with ``{name: parameters}`` under ``"tools"``."""
    rng = random.Random(seed)
    objects = [(name, schema) for name, schema in sample if isinstance(schema, dict)]
    requests = []
    for _ in range(len(objects) // 2):
        picks = rng.sample(objects, rng.choice([1, 2, 3]))
        tools = {f"tool{i}": schema for i, (_, schema) in enumerate(picks)}
        request = ChatCompletionRequest(
            model="m", messages=[{"role": "user", "content": "Call a tool."}],
            tool_choice="required",
            tools=[{"type": "function", "function": {"name": n, "parameters": p}}
                   for n, p in tools.items()])
        try:
            schema = plan_tools(request, None).constraint["json"]
        except OpenAIError as exc:
            schema = {"error": str(exc)}
        requests.append((" + ".join(name for name, _ in picks), {"schema": schema, "tools": tools}))
    return requests


def refusal(schema: object) -> str | None:
    """The engine's reason to refuse ``schema``, or None when it compiles."""
    if isinstance(schema, dict) and set(schema) == {"error"}:
        return schema["error"]
    try:
        LLGuidanceBackend.validate(StructuredOutputsParams(json=schema))
    except ValueError as exc:
        return str(exc).removeprefix("The json constraint cannot be compiled: ")
    return None


def invalid_reason(schema: object, text: str, tools: dict | None = None) -> str | None:
    """Why ``text`` is not an instance of ``schema`` (with ``tools``: why one of its calls'
    arguments is not an instance of its tool's parameters), or None."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    checks = [(schema, value)] if tools is None else [
        (tools[call["name"]], call["arguments"]) for call in value]
    for schema, instance in checks:
        validator = jsonschema.validators.validator_for(schema,
                                                        default=jsonschema.Draft202012Validator)
        try:
            validator(schema).validate(instance)
        except jsonschema.ValidationError as exc:
            return f"invalid: {exc.message[:200]}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, type=Path)
    parser.add_argument("--per-dataset", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--tools", action="store_true",
                        help='the schemas as tools\' parameters, tool_choice "required"')
    parser.add_argument("--compile-only", action="store_true",
                        help="count what compiles and why the rest is refused; generate nothing")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    sample = load_sample(args.dir, args.per_dataset, args.seed)
    tools = {}
    if args.tools:
        requests = as_tools(sample, args.seed)
        tools = {name: request["tools"] for name, request in requests}
        sample = [(name, request["schema"]) for name, request in requests]
    refused = {name: reason for name, schema in sample if (reason := refusal(schema))}
    accepted = [(name, schema) for name, schema in sample if name not in refused]
    outputs, seconds = [], 0.0
    if not args.compile_only:
        llm = LLM(seed=args.seed)
        params = [SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=i,
                                 structured_outputs=StructuredOutputsParams(json=schema))
                  for i, (_, schema) in enumerate(accepted)]
        start = time.perf_counter()
        outputs = llm.generate(["Write the JSON document: "] * len(accepted), params,
                               use_tqdm=False)
        seconds = time.perf_counter() - start
    finish = collections.Counter()
    failures = {}
    aborted = {}
    for (name, schema), output in zip(accepted, outputs):
        completion = output.outputs[0]
        finish[completion.finish_reason] += 1
        if completion.finish_reason == "abort":
            aborted[name] = str(completion.stop_reason)
        if completion.finish_reason == "stop" and (
                reason := invalid_reason(schema, completion.text, tools.get(name))):
            failures[name] = reason
    reasons = collections.Counter(reason.split("\n")[0][:90] for reason in refused.values())
    record = {
        "schemas": len(sample), "accepted": len(accepted), "refused": len(refused),
        "finish_reasons": dict(finish), "complete_outputs_invalid": len(failures),
        "generate_s": round(seconds, 1), "refusal_reasons": dict(reasons.most_common()),
        "refused_files": refused, "invalid_files": failures, "aborted_files": aborted,
        "settings": {"per_dataset": args.per_dataset, "seed": args.seed,
                     "max_tokens": args.max_tokens, "tools": args.tools,
                     "compile_only": args.compile_only},
    }
    print(f"{len(sample)} {'requests' if args.tools else 'schemas'}: {len(accepted)} accepted, {len(refused)} refused; "
          f"outputs {dict(finish)}; complete outputs that do not validate: {len(failures)}")
    for reason, count in reasons.most_common(15):
        print(f"  {count:4d}  {reason}")
    for name, reason in list(failures.items())[:20]:
        print(f"  INVALID {name}: {reason}")
    for name, reason in list(aborted.items())[:20]:
        print(f"  ABORTED {name}: {reason[:200]}")
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
