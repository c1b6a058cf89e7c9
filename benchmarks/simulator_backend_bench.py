"""Simulator backend throughput and structured-output validity through llama.cpp.

Sends N appraise calls (the simulator's real appraise prompt: shipped test
scenarios x four kinds of policy reply, cycled) to the embedded simulator
(Qwen2.5-Coder-1.5B-Instruct Q4_K_M) through :class:`LlamaServerBackend` (one slot), twice:
without a schema (the prompt still asks for JSON) and JSON-schema constrained
(``appraisal.APPRAISAL_SCHEMA``). Per mode it reports completion tokens/s,
calls/min (wall time per call includes processing the ~700-token prompt), the
share of raw outputs that are one JSON object valid against the schema
(``jsonschema``; a code-fenced object does not count) and the share the
simulator's own parser accepts (it strips code fences); for the constrained mode also the mean
change per reply kind (a coarse check that warm replies score above dismissive).

Usage: ``python benchmarks/simulator_backend_bench.py [--n 100] [--threads 2]
[--max-new-tokens 160] [--model PATH.gguf] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from itertools import cycle, islice

import jsonschema
import pandas as pd
from tqdm.auto import tqdm

from rlver_lib.appraisal import APPRAISAL_SCHEMA, SimulatorError, parse_appraisal
from rlver_lib.config import SamplingParams, SimulatorConfig
from rlver_lib.files import atomic_write_json
from rlver_lib.models import simulator_model_path
from rlver_lib.scenarios import load_scenarios
from rlver_lib.servers import LlamaServerBackend
from rlver_lib.user_prompts import SimulatorRequest, appraise_messages

REPLY_KINDS = {
    "warm": "That sounds really painful, and it makes sense you feel this way. "
            "Do you want to tell me more about what happened?",
    "advice": "You should make a list of your options and pick the most practical one.",
    "dismissive": "Honestly, everyone has problems. Stop complaining and move on.",
    "off_topic": "By the way, have you seen the new phone that came out last week?",
}


def appraise_calls(n: int, difficulty: str) -> list[tuple[str, list[dict[str, str]]]]:
    """``n`` (reply kind, appraise conversation) pairs: test scenarios x reply kinds, cycled."""
    pairs = [(s, kind) for s in load_scenarios("builtin:test") for kind in REPLY_KINDS]
    calls = []
    for index, (scenario, kind) in enumerate(islice(cycle(pairs), n)):
        history = [{"role": "user", "content": scenario.opening_line or "I need to talk."},
                   {"role": "assistant", "content": REPLY_KINDS[kind]}]
        request = SimulatorRequest(dialogue_id=f"bench-{index}", scenario=scenario,
                                   history=history, emotion=40, turn=0)
        calls.append((kind, appraise_messages(request, difficulty)))
    return calls


def run_mode(backend, calls, *, constrained: bool, max_new_tokens: int, seed: int) -> dict:
    """Run every call one at a time; return throughput, validity and mean change by kind."""
    schema = APPRAISAL_SCHEMA if constrained else None
    tokens = valid = accepted = 0
    changes: dict[str, list[int]] = defaultdict(list)
    start = time.perf_counter()
    for index, (kind, conversation) in enumerate(tqdm(calls, desc="constrained" if constrained else "free")):
        sampling = SamplingParams(temperature=0.7, max_new_tokens=max_new_tokens, seed=seed + index)
        [gen] = backend.generate([conversation], sampling, json_schema=schema)
        tokens += gen.meta["usage"]["completion_tokens"]
        try:
            jsonschema.validate(json.loads(gen.text, strict=False), APPRAISAL_SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
        try:
            changes[kind].append(parse_appraisal(gen.text)["change"])
            accepted += 1
        except SimulatorError:
            pass
    seconds = time.perf_counter() - start
    return {
        "mode": "json_schema" if constrained else "unconstrained",
        "calls": len(calls),
        "seconds": round(seconds, 1),
        "completion_tok_per_s": round(tokens / seconds, 1),
        "calls_per_min": round(60 * len(calls) / seconds, 1),
        "valid_json_share": round(valid / len(calls), 3),
        "parser_accepts_share": round(accepted / len(calls), 3),
        "mean_tokens_per_call": round(tokens / len(calls), 1),
        **{f"mean_change_{k}": round(sum(v) / len(v), 2) if v else None
           for k in REPLY_KINDS for v in [changes[k]]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100, help="calls per mode")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 2)))
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--model", default=SimulatorConfig().model,
                        help="GGUF path (default: the embedded simulator)")
    parser.add_argument("--difficulty", default="moderate", choices=["easy", "moderate", "hard"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the figures to this JSON file")
    args = parser.parse_args()
    if args.n < 1:
        parser.error("--n must be at least 1")

    path = simulator_model_path(SimulatorConfig(model=args.model))
    backend = LlamaServerBackend(path, n_ctx=4096, parallel=1, threads=args.threads, seed=args.seed)
    calls = appraise_calls(args.n, args.difficulty)
    rows = [run_mode(backend, calls, constrained=c, max_new_tokens=args.max_new_tokens, seed=args.seed)
            for c in (False, True)]
    table = pd.DataFrame(rows).set_index("mode").T
    print(f"\nmodel: {path.name}, threads: {args.threads}, calls per mode: {args.n}")
    print(table.to_string())
    if args.json:
        atomic_write_json(args.json, {"model": path.name, "threads": args.threads, "rows": rows})


if __name__ == "__main__":
    main()
