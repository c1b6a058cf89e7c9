"""How much of a PPO step's reward variance can a linear critic explain before the update?

The done-when of a fitting critic asks for an explained variance above 0.3 by the middle
of the laptop PPO run. This script asks what a critic of the same form (a linear value
head on the policy's last hidden state, one value per policy token, every token's return
the dialogue's trained reward: ``credit: final``, gamma = lambda = 1) could reach on the
samples of a recorded run, with every advantage it is not given in training:

- **ridge, earlier steps**: a ridge regression fitted in closed form on every token of
  the steps before, scored on the step's own new samples. This is the logged
  ``explained_variance`` (before the update) with the optimizer taken out: the best
  linear critic on these features, the penalty chosen in hindsight over ``--alphas``;
- **ridge, this step in-sample**: the same fitted on the steps up to and including this
  one, scored on it: the logged ``explained_variance_after`` with the optimizer taken out;
- **scenario memory**: each token valued at its scenario's mean reward in the steps
  before (the mean of every earlier reward for a scenario not seen yet): a critic that
  learned each training scenario's value exactly and knows nothing of the reply;
- **scenario oracle**: each token valued at its scenario's mean reward in this very
  step (the between-scenario share, what a critic that knew each scenario could explain).

Any constant critic scores 0 (``1 - Var(R - V) / Var(R)``). The features are the base
policy's (no LoRA adapter) last hidden states over each policy turn, the turn's context
rendered from the recorded transcript as the rollout rendered it and the recorded reply
tokenized again (so the ids can differ from the sampled ones by a token where a
tokenizer would split the text differently). Prints one row a step and writes JSON
with ``--json``:

    python benchmarks/critic_ceiling.py outputs/laptop-ppo
    python benchmarks/critic_ceiling.py outputs/ppo-a outputs/ppo-b --json critic.json

Results: docs/MEASURED.md "What a linear critic can explain".
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from rlver_lib.algorithms import explained_variance
from rlver_lib.backends import TransformersBackend
from rlver_lib.files import RunFolder, iter_jsonl
from rlver_lib.learner import train_reward
from rlver_lib.models import load_policy
from rlver_lib.params import load_run_config
from rlver_lib.rollout import policy_messages
from rlver_lib.scenarios import load_scenarios

ALPHAS = (10.0, 100.0, 1000.0, 10000.0, 100000.0)


def policy_turns(record: dict) -> list[tuple[list[dict], str, bool]]:
    """``(history before the turn, reply text, cut)`` for each policy turn of a recorded dialogue."""
    turns, history = [], []
    for message in record["transcript"]:
        if message["role"] == "assistant":
            turns.append((list(history), message.get("raw", message["content"]), bool(message.get("cut"))))
        if message.get("content") is not None:
            history.append({"role": message["role"], "content": message["content"]})
    return turns


@torch.no_grad()
def token_features(policy: TransformersBackend, record: dict, scenario, think: bool) -> np.ndarray:
    """``[N, H]`` last hidden states at the positions whose next token is a policy token
    (N = the dialogue's policy tokens, as the value head sees them)."""
    rows = []
    for history, reply, cut in policy_turns(record):
        context = policy.prompt_ids(policy_messages(scenario, history, think))
        completion = policy.tokenizer(reply, add_special_tokens=False)["input_ids"]
        if not cut:
            completion = completion + [policy.eos_ids[0]]
        ids = torch.tensor([context + completion])
        hidden = policy.model.get_decoder()(input_ids=ids).last_hidden_state[0]
        rows.append(hidden[len(context) - 1:ids.shape[1] - 1].float().numpy())
    return np.concatenate(rows)


def load_run(run_dir: Path, policy: TransformersBackend) -> list[dict]:
    """Per training step: token features ``X`` [N, H], token returns ``y`` [N], the
    dialogues' scenario per token ``group`` and the logged explained variances."""
    folder = RunFolder(run_dir)
    cfg = load_run_config(folder.config)
    if cfg.training.credit != "final":
        raise SystemExit(f"{run_dir}: training.credit is {cfg.training.credit!r}; this script reads 'final'")
    scenarios = {s.id: s for s in load_scenarios(folder.scenarios("train"))}
    logged = {row["step"]: row for _, row in iter_jsonl(folder.metrics)}
    steps = []
    for path in sorted(folder.train_dialogues.glob("step_*.jsonl")):
        xs, ys, groups = [], [], []
        for _, rec in iter_jsonl(path):
            if rec["termination"] == "error":
                continue
            x = token_features(policy, rec, scenarios[rec["scenario_id"]], cfg.policy.think)
            reward = train_reward(SimpleNamespace(**rec), cfg.training.format_penalty, cfg.training.reward_scale)
            xs.append(x)
            ys.append(np.full(len(x), reward))
            groups += [rec["scenario_id"]] * len(x)
        step = int(path.stem.split("_")[1])
        row = logged.get(step, {})
        steps.append({"step": step, "X": np.concatenate(xs), "y": np.concatenate(ys), "group": groups,
                      "logged_before": row.get("explained_variance", math.nan),
                      "logged_after": row.get("explained_variance_after", math.nan)})
    return steps


def ev(values: np.ndarray, returns: np.ndarray) -> float:
    """The learner's own explained variance over one step's tokens."""
    v, r = torch.as_tensor(values)[None], torch.as_tensor(returns)[None]
    return explained_variance(v, r, torch.ones_like(r))


def ridge_ev(train: list[dict], test: dict, alpha: float) -> float:
    """Explained variance on ``test`` of a ridge critic fitted on ``train``'s tokens."""
    from sklearn.linear_model import Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    fit = make_pipeline(StandardScaler(), Ridge(alpha=alpha))
    fit.fit(np.concatenate([s["X"] for s in train]), np.concatenate([s["y"] for s in train]))
    return ev(fit.predict(test["X"]), test["y"])


def oracle_ev(step: dict) -> float:
    """Each token valued at its scenario's mean reward over this step's tokens (weighted
    as the learner weighs; the logged ``reward_between_group_share`` weighs dialogues)."""
    groups = np.array(step["group"])
    values = np.empty_like(step["y"])
    for g in set(step["group"]):
        values[groups == g] = step["y"][groups == g].mean()
    return ev(values, step["y"])


def memory_ev(earlier: list[dict], step: dict) -> float:
    """Each token valued at its scenario's mean reward over the earlier steps' tokens, or
    at the mean of all earlier tokens for a scenario not seen before."""
    past_y = np.concatenate([s["y"] for s in earlier])
    past_group = np.array([g for s in earlier for g in s["group"]])
    values = np.array([past_y[past_group == g].mean() if (past_group == g).any() else past_y.mean()
                       for g in step["group"]])
    return ev(values, step["y"])


def ceiling(steps: list[dict], alphas: tuple[float, ...]) -> dict:
    """One row a step (the critics of the module notes) and the penalty with the best
    mean explained variance on new samples."""
    rows = []
    for i, step in enumerate(steps):
        row = {"step": step["step"], "tokens": len(step["y"]), "reward_sd": float(step["y"].std()),
               "logged_before": step["logged_before"], "logged_after": step["logged_after"],
               "scenario_oracle": oracle_ev(step)}
        row["before"] = {a: ridge_ev(steps[:i], step, a) for a in alphas} if i else {}
        row["scenario_memory"] = memory_ev(steps[:i], step) if i else math.nan
        row["seen_before"] = len({g for g in step["group"]} & {g for s in steps[:i] for g in s["group"]})
        row["in_sample"] = {a: ridge_ev(steps[:i + 1], step, a) for a in alphas}
        rows.append(row)
    best = max(alphas, key=lambda a: np.mean([r["before"][a] for r in rows[1:]]))
    return {"rows": rows, "best_alpha": best}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="PPO or GRPO run folders with train/dialogues")
    ap.add_argument("--alphas", type=float, nargs="+", default=list(ALPHAS), help="ridge penalties to try")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()
    cfg = load_run_config(RunFolder(args.runs[0]).config)
    policy = TransformersBackend(*load_policy(cfg.policy.model_copy(update={"adapter": None, "dtype": "float32"})))
    out = {}
    for run in args.runs:
        result = ceiling(load_run(run, policy), tuple(args.alphas))
        out[str(run)] = result
        a = result["best_alpha"]
        print(f"\n{run}  (ridge penalty {a:g}, the best over {args.alphas} on the steps' mean)")
        print("step  tokens  reward s.d.  logged before/after  ridge earlier steps  ridge in-sample  "
              "scenario memory (seen)  scenario oracle")
        for r in result["rows"]:
            before = f"{r['before'][a]:+.2f}" if r["before"] else "   -"
            print(f"{r['step']:4d}  {r['tokens']:6d}  {r['reward_sd']:11.4f}  {r['logged_before']:+8.2f} / "
                  f"{r['logged_after']:+.2f}  {before:>19}  {r['in_sample'][a]:+15.2f}  "
                  f"{r['scenario_memory']:+15.2f} ({r['seen_before']:2d})  {r['scenario_oracle']:+15.2f}")
        half = result["rows"][1:len(result["rows"]) // 2 + 1]
        print(f"mean over steps 2-{len(half) + 1}: ridge earlier steps "
              f"{np.mean([r['before'][a] for r in half]):+.2f}, scenario memory "
              f"{np.mean([r['scenario_memory'] for r in half]):+.2f}, scenario oracle "
              f"{np.mean([r['scenario_oracle'] for r in half]):+.2f}")
        print("ridge earlier steps by penalty, mean over steps 2-" + f"{len(half) + 1}: " + ", ".join(
            f"{alpha:g}: {np.mean([r['before'][alpha] for r in half]):+.2f}" for alpha in args.alphas))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=float), encoding="utf-8")


if __name__ == "__main__":
    main()
