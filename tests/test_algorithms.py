"""Advantage estimators and losses against hand-computed values and against TRL 1.16;
the PPO and GRPO objects (:mod:`rlver_lib.algorithm_objects`)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import get_args

import pytest
import torch
from source_support import literal_comparisons

from rlver_lib import algorithm_objects as algo
from rlver_lib import algorithms as alg
from rlver_lib import credit
from rlver_lib.config import TrainingConfig

# ---------------------------------------------------------------- GAE

def test_gae_skips_user_tokens_and_handles_uneven_lengths():
    # Row 0: a two-turn dialogue in one row; positions 0, 3, 4, 7 are user/template
    # tokens. Policy tokens at 1, 2 (turn 1) and 5, 6 (turn 2); reward 1.0 at the last.
    # Row 1: a shorter dialogue (3 policy tokens) then padding with junk values.
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0, 0]])
    values = torch.tensor([[7.0, 0.1, 0.2, 7.0, 7.0, 0.3, 0.4, 7.0],
                           [0.5, 0.5, 0.5, 9.0, 9.0, 9.0, 9.0, 9.0]])
    rewards = torch.zeros(2, 8)
    rewards[0, 6] = 1.0
    rewards[1, 2] = 0.2
    adv, ret = alg.gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # Hand computation, γλ = 0.45, chaining policy tokens only:
    # row 0: A6 = 1 - .4 = .6; A5 = (.9*.4 - .3) + .45*.6 = .33;
    #        A2 = (.9*.3 - .2) + .45*.33 = .2185; A1 = (.9*.2 - .1) + .45*.2185 = .178325
    # row 1: A2 = .2 - .5 = -.3; A1 = (.45 - .5) + .45*(-.3) = -.185; A0 = -.05 + .45*(-.185)
    exp_adv = torch.tensor([[0, .178325, .2185, 0, 0, .33, .6, 0],
                            [-.13325, -.185, -.3, 0, 0, 0, 0, 0]])
    torch.testing.assert_close(adv, exp_adv, atol=1e-6, rtol=0)
    exp_ret = torch.tensor([[0, .278325, .4185, 0, 0, .63, 1.0, 0],
                            [.36675, .315, .2, 0, 0, 0, 0, 0]])
    torch.testing.assert_close(ret, exp_ret, atol=1e-6, rtol=0)


def test_gae_paper_defaults_give_reward_minus_value():
    mask = torch.tensor([[1, 0, 1, 1]])
    values = torch.tensor([[0.2, 5.0, 0.3, 0.6]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.8]])
    adv, ret = alg.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.6, 0.0, 0.5, 0.2]]))
    torch.testing.assert_close(ret, torch.tensor([[0.8, 0.0, 0.8, 0.8]]))


def test_gae_rejects_reward_on_user_token_and_bad_shapes():
    with pytest.raises(ValueError, match="masked"):
        alg.gae(torch.tensor([[1.0, 0.0]]), torch.zeros(1, 2), torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="shape"):
        alg.gae(torch.zeros(1, 3), torch.zeros(1, 2), torch.ones(1, 2))


# ---------------------------------------------------------------- GRPO advantages

def test_masked_whiten_hand_computed():
    # policy tokens 1, 2, 3 (mean 2, population variance 2/3); the masked 100 is ignored
    values = torch.tensor([[1.0, 100.0, 2.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    s = math.sqrt(2 / 3)
    expected = torch.tensor([[-1 / s, 0.0, 0.0], [1 / s, 0.0, 0.0]])
    torch.testing.assert_close(alg.masked_whiten(values, mask), expected, atol=1e-6, rtol=0)


def test_grpo_advantages_hand_computed():
    rewards = torch.tensor([0.2, 0.4, 0.9, 0.5, 0.5, 0.7])
    groups = ["a", "a", "a", "b", "b", "c"]
    adv, zero = alg.grpo_advantages(rewards, groups, scale_rewards=True, eps=1e-4)
    std_a = math.sqrt((0.09 + 0.01 + 0.16) / 2)  # unbiased sample std of group a
    exp = torch.tensor([-0.3, -0.1, 0.4, 0, 0, 0]) / torch.tensor([std_a + 1e-4] * 3 + [1] * 3)
    torch.testing.assert_close(adv, exp, atol=1e-6, rtol=0)
    assert zero == 2  # group b (equal rewards) and c (single member)

    adv_dr, zero_dr = alg.grpo_advantages(rewards, torch.tensor([0, 0, 0, 1, 1, 2]), scale_rewards=False)
    torch.testing.assert_close(adv_dr, torch.tensor([-0.3, -0.1, 0.4, 0, 0, 0]), atol=1e-6, rtol=0)
    assert zero_dr == 2


def test_grpo_advantages_errors():
    with pytest.raises(ValueError, match="group ids"):
        alg.grpo_advantages(torch.tensor([1.0, 2.0]), ["a"])
    with pytest.raises(ValueError, match="1-D"):
        alg.grpo_advantages(torch.zeros(2, 2), ["a", "b"])


# ---------------------------------------------------------------- losses

def test_clipped_policy_loss_hand_computed():
    old = torch.zeros(1, 5)
    logp = torch.log(torch.tensor([[1.5, 0.5, 0.5, 1.5, 3.0]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    out = alg.clipped_policy_loss(logp, old, adv, mask, clip_eps=0.2, aggregation="token_mean")
    # per token: -min(1.5, 1.2) = -1.2; -min(.5, .8) = -.5; -min(-.5, -.8) = .8; -min(-1.5, -1.2) = 1.5
    assert out.loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 1.5) / 4, abs=1e-6)
    assert out.clip_fraction.item() == pytest.approx(0.5)  # tokens 0 and 2
    out.loss.backward()
    # clipped tokens (0 and 2) and the masked token get no gradient; d(-ρA)/dlogp = -ρA / 4
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5 / 4, 0.0, 1.5 / 4, 0.0]]))


def test_aggregation_token_vs_sequence_mean():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert alg.aggregate(per_token, mask, "token_mean").item() == pytest.approx(16 / 4)
    assert alg.aggregate(per_token, mask, "seq_mean").item() == pytest.approx((2 + 10) / 2)
    with pytest.raises(ValueError, match="aggregation"):
        alg.aggregate(per_token, mask, "sum")


def test_masked_tokens_get_exactly_zero_gradient():
    torch.manual_seed(0)
    mask = torch.tensor([[0, 0, 1, 1, 0, 1], [1, 1, 0, 0, 0, 0]])
    logp = (-torch.rand(2, 6)).requires_grad_()
    values = torch.randn(2, 6).requires_grad_()
    adv, ret = alg.gae(torch.tensor([[0, 0, 0, 0, 0, 1.0], [0, 0.3, 0, 0, 0, 0]]), values.detach(), mask)
    for aggregation in ("token_mean", "seq_mean"):
        logp.grad = None
        out = alg.clipped_policy_loss(logp, logp.detach() - 0.05, adv, mask, aggregation=aggregation)
        out.loss.backward()
        assert torch.all(logp.grad[mask == 0] == 0)
        assert torch.all(logp.grad[mask == 1] != 0)
    vloss, _ = alg.clipped_value_loss(values, values.detach() + 0.1, ret, mask)
    vloss.backward()
    assert torch.all(values.grad[mask == 0] == 0)
    assert torch.all(values.grad[mask == 1] != 0)


def test_clipped_value_loss_hand_computed():
    values = torch.tensor([[0.5, 0.0, 50.0]])
    old = torch.tensor([[0.2, 0.1, 0.0]])
    returns = torch.tensor([[1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, frac = alg.clipped_value_loss(values, old, returns, mask, clip_eps=0.2)
    # token 0: max((.5-1)^2, (.4-1)^2) = .36; token 1: 0; token 2 masked
    assert loss.item() == pytest.approx(0.5 * 0.36 / 2)
    assert frac.item() == pytest.approx(0.5)


def test_entropy_and_token_logprobs_match_torch_distributions():
    torch.manual_seed(1)
    logits = torch.randn(2, 4, 7)
    ids = torch.randint(0, 7, (2, 4))
    dist = torch.distributions.Categorical(logits=logits)
    torch.testing.assert_close(alg.entropy_from_logits(logits), dist.entropy())
    torch.testing.assert_close(alg.token_logprobs(logits, ids), dist.log_prob(torch.roll(ids, -1, 1))[:, :-1])


def test_kl_estimators_are_unbiased_for_exact_kl():
    torch.manual_seed(2)
    p_logits, q_logits = torch.randn(9), torch.randn(9)
    logp, logq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    exact = torch.sum(logp.exp() * (logp - logq))
    for est in ("k1", "k3"):
        expectation = torch.sum(logp.exp() * alg.kl_penalty(logp[None], logq[None], est)[0])
        assert expectation.item() == pytest.approx(exact.item(), abs=1e-6)
    assert torch.all(alg.kl_penalty(logp[None], logq[None], "k3") >= 0)
    with pytest.raises(ValueError, match="estimator"):
        alg.kl_penalty(logp, logq, "k2")


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert alg.explained_variance(returns, returns, mask) == pytest.approx(1.0)
    # V = mean(R) everywhere: Var(R - V) = Var(R) -> 0
    assert alg.explained_variance(torch.full_like(returns, 2.0), returns, mask) == pytest.approx(0.0)


# ---------------------------------------------------------------- parity with TRL 1.16

def _tiny_trl_trainer(tmp_path, loss_type):
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    vocab = {f"w{i}": i for i in range(30)}
    vocab.update({"<pad>": 30, "<eos>": 31})
    tok_core = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok_core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok_core, pad_token="<pad>", eos_token="<eos>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, pad_token_id=30, eos_token_id=31))
    # bf16=False: TRL would otherwise autocast the forward pass, so log-probs would differ by rounding.
    args = GRPOConfig(output_dir=str(tmp_path / loss_type), loss_type=loss_type, beta=0.0, epsilon=0.2,
                      num_generations=2, per_device_train_batch_size=2, max_completion_length=4,
                      report_to=[], use_cpu=True, bf16=False, logging_steps=1)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=Dataset.from_list([{"prompt": "w1 w2"}] * 2),
                          processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    return trainer


# One batch, as TRL lays it out: left-padded prompts, right-padded completions of uneven length.
PROMPT_IDS = torch.tensor([[30, 5, 6, 7], [8, 9, 10, 11]])
COMPLETION_IDS = torch.tensor([[12, 13, 31, 30], [14, 15, 16, 17]])
COMPLETION_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
OLD_LOGPS = torch.tensor([[-3.0, -3.5, -2.9, 0.0], [-3.2, -3.4, -3.6, -3.3]])


@pytest.fixture
def trl_parity(tmp_path):
    """``parity(loss_type, advantages, settings={}, **inputs) -> (trainer, trl_loss, logp)``:
    TRL's ``_compute_loss`` on the fixed batch (:data:`PROMPT_IDS`, :data:`COMPLETION_IDS`,
    :data:`COMPLETION_MASK`, :data:`OLD_LOGPS`) with ``advantages`` and the extra ``inputs``,
    by a tiny GRPOTrainer of ``loss_type`` with the attributes ``settings``, and our token
    log-probs ``[2, 4]`` of the completions from a second forward pass of the same model
    (train mode); both keep their graphs, for gradients."""
    def parity(loss_type, advantages, settings=None, **inputs):
        trainer = _tiny_trl_trainer(tmp_path, loss_type)
        for name, value in (settings or {}).items():
            setattr(trainer, name, value)
        model = trainer.model
        prompt_mask = (PROMPT_IDS != 30).long()
        batch = dict(prompt_ids=PROMPT_IDS, prompt_mask=prompt_mask, completion_ids=COMPLETION_IDS,
                     completion_mask=COMPLETION_MASK, advantages=advantages, old_per_token_logps=OLD_LOGPS,
                     num_items_in_batch=COMPLETION_MASK.sum(), **inputs)
        model.train()
        trl_loss = trainer._compute_loss(model, batch)
        input_ids = torch.cat([PROMPT_IDS, COMPLETION_IDS], 1)
        logits = model(input_ids=input_ids, attention_mask=torch.cat([prompt_mask, COMPLETION_MASK], 1)).logits
        return trainer, trl_loss, alg.token_logprobs(logits, input_ids)[:, PROMPT_IDS.shape[1] - 1:]

    return parity


@pytest.mark.parametrize("loss_type,aggregation", [("grpo", "seq_mean"), ("bnpo", "token_mean")])
def test_grpo_loss_equals_trl(trl_parity, loss_type, aggregation):
    advantages, _ = alg.grpo_advantages(torch.tensor([0.3, 0.8]), [0, 0])
    trainer, trl_loss, logp = trl_parity(loss_type, advantages)
    trl_grads = torch.autograd.grad(trl_loss, list(trainer.model.parameters()))
    ours = alg.clipped_policy_loss(logp, OLD_LOGPS, advantages, COMPLETION_MASK, clip_eps=0.2,
                                   aggregation=aggregation).loss
    our_grads = torch.autograd.grad(ours, list(trainer.model.parameters()))
    assert ours.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-6)
    for g_ours, g_trl in zip(our_grads, trl_grads):
        torch.testing.assert_close(g_ours, g_trl, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- Dr. GRPO: a constant normaliser

def test_dr_grpo_loss_equals_trl(trl_parity):
    advantages, _ = alg.grpo_advantages(torch.tensor([0.3, 0.8]), [0, 0], scale_rewards=False)
    trainer, trl_loss, logp = trl_parity("dr_grpo", advantages)
    ours = alg.clipped_policy_loss(logp, OLD_LOGPS, advantages, COMPLETION_MASK, aggregation="dr_grpo",
                                   max_tokens=trainer.max_completion_length).loss
    assert ours.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-7)
    # the normaliser is rows x budget (2 x 4), not the 7 real tokens
    token_mean = alg.clipped_policy_loss(logp, OLD_LOGPS, advantages, COMPLETION_MASK, aggregation="token_mean").loss
    assert ours.item() == pytest.approx(token_mean.item() * 7 / 8, rel=1e-5)


def test_micro_batch_numerators_add_up_to_the_batch_aggregate():
    torch.manual_seed(3)
    per_token = torch.randn(5, 6)
    mask = (torch.rand(5, 6) > 0.3).float()
    mask[2] = 0  # a row without policy tokens
    for mode in ("token_mean", "seq_mean", "dr_grpo"):
        whole = alg.aggregate(per_token, mask, mode, max_tokens=6)
        normaliser = alg.aggregation_denominator(mode, tokens=float(mask.sum()), rows=5, max_tokens=6)
        parts = sum(alg.aggregate(per_token[rows], mask[rows], mode, normaliser=normaliser)
                    for rows in (slice(0, 2), slice(2, 3), slice(3, 5)))
        torch.testing.assert_close(parts, whole)
    expected = {"token_mean": (per_token * mask).sum() / mask.sum(),
                "seq_mean": ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean(),
                "dr_grpo": (per_token * mask).sum() / 30}
    for mode, value in expected.items():
        torch.testing.assert_close(alg.aggregate(per_token, mask, mode, max_tokens=6), value)
    with pytest.raises(ValueError, match="max_tokens"):
        alg.aggregate(per_token, mask, "dr_grpo")


# ---------------------------------------------------------------- KL as a loss: gradients

def test_k3_loss_gradient_depends_on_the_reference_and_k1_does_not():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mask = torch.ones(1, 3)

    def grad(estimator, ref):
        logp.grad = None
        alg.masked_mean(alg.kl_penalty(logp, ref, estimator), mask).backward()
        return logp.grad.clone()

    ref_a, ref_b = torch.tensor([[-1.5, -1.0, -0.5]]), torch.tensor([[-0.2, -3.0, -2.0]])
    # d/dlogp [exp(ref - logp) - 1 - (ref - logp)] = 1 - exp(ref - logp), over 3 tokens
    for ref in (ref_a, ref_b):
        torch.testing.assert_close(grad("k3", ref), (1 - torch.exp(ref - logp.detach())) / 3)
    assert not torch.allclose(grad("k3", ref_a), grad("k3", ref_b))
    # k1 = logp - ref: gradient 1/3 everywhere, whatever the reference (why the config refuses it)
    torch.testing.assert_close(grad("k1", ref_a), torch.full((1, 3), 1 / 3))
    torch.testing.assert_close(grad("k1", ref_b), grad("k1", ref_a))


def test_config_refuses_k1_as_a_loss_term():
    from rlver_lib.config import ConfigError
    from rlver_lib.params import build_config

    with pytest.raises(ConfigError, match="k1 cannot be a loss term"):
        build_config({"training": {"kl_coef": 0.05, "kl_estimator": "k1"}})
    assert build_config({"training": {"kl_coef": 0.05, "kl_estimator": "k3"}}).training.kl_coef == 0.05
    assert build_config({"training": {"kl_coef": 0.0, "kl_estimator": "k1"}}).training.kl_estimator == "k1"


# ---------------------------------------------------------------- distributed statistics

def test_whitening_from_summed_moments_equals_whitening_the_whole_batch():
    torch.manual_seed(4)
    values = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.4).float()
    whole = alg.masked_whiten(values, mask)
    # two "processes" holding rows 0-3 and 4-5: their moments add up
    moments = alg.masked_moments(values[:4], mask[:4]) + alg.masked_moments(values[4:], mask[4:])
    torch.testing.assert_close(alg.whiten_with_moments(values[4:], mask[4:], moments), whole[4:])
    sel = values[mask.bool()]
    expected = (values - sel.mean()) / torch.sqrt(sel.var(unbiased=False) + 1e-8) * mask
    torch.testing.assert_close(whole, expected, atol=1e-5, rtol=1e-5)
    returns, estimate = torch.randn(6, 5), torch.randn(6, 5)
    split = alg.explained_variance_from_moments(
        alg.masked_moments(returns[:3], mask[:3]) + alg.masked_moments(returns[3:], mask[3:]),
        alg.masked_moments((returns - estimate)[:3], mask[:3]) + alg.masked_moments((returns - estimate)[3:], mask[3:]))
    r, e = returns[mask.bool()], estimate[mask.bool()]
    assert split == pytest.approx(float(1 - (r - e).var(unbiased=False) / r.var(unbiased=False)), rel=1e-5)


def test_informative_groups_marks_groups_with_differing_rewards():
    rewards = torch.tensor([0.2, 0.4, 0.5, 0.5, 0.7, 0.1, 0.1])
    keep = alg.informative_groups(rewards, ["a", "a", "b", "b", "c", "d", "d"])
    assert keep.tolist() == [True, True, False, False, False, False, False]


# ---------------------------------------------------------------- PPO over turns

def test_dialogue_gae_chains_turns_across_the_boundary():
    # Dialogue 0: turn 0 has policy tokens at positions 1, 2 (position 0 is context),
    # turn 1 at positions 2, 3 (0, 1 are context); reward 1.0 at its last token.
    # Laid out in one row the policy tokens are [.1, .2 | .3, .4], as in
    # test_gae_skips_user_tokens_and_handles_uneven_lengths (γ = .9, λ = .5):
    # A = [.178325, .2185 | .33, .6], R = A + V.
    values = [[torch.tensor([7.0, 0.1, 0.2]), torch.tensor([7.0, 7.0, 0.3, 0.4])],
              [torch.tensor([9.0, 0.5])]]
    masks = [[torch.tensor([0.0, 1, 1]), torch.tensor([0.0, 0, 1, 1])], [torch.tensor([0.0, 1])]]
    adv, ret = alg.dialogue_gae(values, masks, [1.0, 0.2], gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv[0][0], torch.tensor([0.0, 0.178325, 0.2185]))
    torch.testing.assert_close(adv[0][1], torch.tensor([0.0, 0.0, 0.33, 0.6]))
    torch.testing.assert_close(ret[0][1], torch.tensor([0.0, 0.0, 0.63, 1.0]))
    # the last token of turn 0 bootstraps from the first token of turn 1: δ = 0 + .9 * .3 - .2
    assert adv[0][0][2].item() == pytest.approx((0.9 * 0.3 - 0.2) + 0.45 * 0.33)
    torch.testing.assert_close(adv[1][0], torch.tensor([0.0, 0.2 - 0.5]))
    with pytest.raises(ValueError, match="rewards"):
        alg.dialogue_gae(values, masks, [1.0])


# ---------------------------------------------------------------- rollout-engine mismatch

def _trl_is_ratio(old, sampling, mask, cap):
    """TRL's own vLLM importance-sampling ratio, ``token_truncate`` mode. TRL computes it
    inline in ``GRPOTrainer._generate_and_score_completions`` (no function to call), so the
    block is cut out of that method's source, from the log-prob difference to the
    reference-model comment after it, and run on these tensors."""
    import inspect
    import textwrap
    from types import SimpleNamespace

    from trl import GRPOTrainer

    lines = inspect.getsource(GRPOTrainer._generate_and_score_completions).splitlines()
    first = next(i for i, line in enumerate(lines)
                 if "per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask" in line)
    last = next(i for i in range(first, len(lines)) if "log probabilities for the reference model" in lines[i])
    block = textwrap.dedent("\n".join(lines[first:last]))
    assert "token_truncate" in block and "torch.clamp" in block, block  # the block this test means to run
    scope = {"torch": torch, "math": math, "old_per_token_logps": old, "sampling_per_token_logps": sampling,
             "mask": mask, "self": SimpleNamespace(vllm_importance_sampling_mode="token_truncate",
                                                   vllm_importance_sampling_clip_min=None,
                                                   vllm_importance_sampling_clip_max=cap)}
    exec(compile(block, "trl GRPOTrainer IS block", "exec"), scope)
    return scope["vllm_importance_sampling_ratio"]


def test_truncated_is_weights_hand_computed_and_equal_to_trls_token_truncate():
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.1, -6.0, -2.0, -1.0]])
    sampling = torch.tensor([[-1.2, -0.5, float("nan"), -3.0], [-0.3, -1.0, -2.5, float("nan")]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    w = alg.truncated_is_weights(old, sampling, mask, cap=3.0)
    # exp(.2), exp(-1.5), NaN -> 1, masked -> 1; row 1: exp(.2), exp(-5), exp(.5), NaN -> 1
    torch.testing.assert_close(w, torch.tensor([[math.exp(0.2), math.exp(-1.5), 1.0, 1.0],
                                                [math.exp(0.2), math.exp(-5.0), math.exp(0.5), 1.0]]))
    assert alg.truncated_is_weights(old, torch.tensor([[-4.0, -2.0, -0.5, -3.0]] * 2), mask, cap=3.0)[0, 0] == 3.0
    pytest.importorskip("trl")
    for cap in (3.0, 1.1):
        torch.testing.assert_close(alg.truncated_is_weights(old, sampling, mask, cap=cap),
                                   _trl_is_ratio(old, sampling, mask, cap))
    total, largest, count = alg.logprob_gap(old[:1], sampling[:1], mask[:1])
    assert (float(total), float(largest), float(count)) == pytest.approx((0.2 + 1.5, 1.5, 2))


def test_is_weights_scale_the_per_token_policy_loss():
    logp = torch.zeros(1, 2, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    w = torch.tensor([[2.0, 0.5]])
    out = alg.clipped_policy_loss(logp, torch.zeros(1, 2), adv, mask, is_weights=w)
    assert out.loss.item() == pytest.approx((-2.0 * 1 + 0.5 * 1) / 2)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, 0.25]]))


def test_is_weighted_policy_loss_equals_trls(trl_parity):
    """Our clipped loss with IS weights against TRL's ``_compute_loss`` fed TRL's own ratio."""
    pytest.importorskip("trl")
    advantages, _ = alg.grpo_advantages(torch.tensor([0.3, 0.8]), [0, 0])
    sampling = OLD_LOGPS + torch.tensor([[0.4, -1.5, float("nan"), 0.0], [-0.2, 0.1, 2.0, -0.3]])
    ratio = _trl_is_ratio(OLD_LOGPS, sampling, COMPLETION_MASK.float(), 3.0)
    _, trl_loss, logp = trl_parity("bnpo", advantages, {"use_vllm": True, "vllm_importance_sampling_correction": True},
                                   importance_sampling_ratio=ratio)
    weights = alg.truncated_is_weights(OLD_LOGPS, sampling, COMPLETION_MASK, cap=3.0)
    ours = alg.clipped_policy_loss(logp, OLD_LOGPS, advantages, COMPLETION_MASK, is_weights=weights).loss
    assert ours.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-6)
    unweighted = alg.clipped_policy_loss(logp, OLD_LOGPS, advantages, COMPLETION_MASK).loss
    assert abs(unweighted.item() - trl_loss.item()) > 1e-3  # the weights matter here


# ---------------------------------------------------------------- chunked log-probs and entropy

def _head_case(n=300, hidden=8, vocab=97, seed=0):
    torch.manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(n, hidden, requires_grad=True)
    ids = torch.randint(0, vocab, (n,))
    return head, h, ids


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_entropy_equal_trls_and_the_full_computation(temperature):
    head, h, ids = _head_case()
    lp, ent = alg.chunked_logprobs_and_entropy(h, head, ids, temperature=temperature, chunk_rows=64)
    logits = head(h) / temperature
    full = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lp, full.gather(-1, ids[:, None]).squeeze(-1))
    torch.testing.assert_close(ent, -(full.exp() * full).sum(-1))
    # gradients through the checkpointed chunks equal those of the full computation
    grad_ours = torch.autograd.grad((lp * 0.3 + ent).sum(), h)[0]
    grad_full = torch.autograd.grad((full.gather(-1, ids[:, None]).squeeze(-1) * 0.3
                                     - (full.exp() * full).sum(-1)).sum(), h)[0]
    torch.testing.assert_close(grad_ours, grad_full)
    trl_utils = pytest.importorskip("trl.trainer.utils")
    with torch.no_grad():
        trl_lp, trl_ent = trl_utils.selective_log_softmax_and_entropy(head(h), ids, temperature=temperature)
        ours_lp, ours_ent = alg.chunked_logprobs_and_entropy(h, head, ids, temperature=temperature, chunk_rows=64)
    torch.testing.assert_close(ours_lp, trl_lp)
    torch.testing.assert_close(ours_ent, trl_ent)


def test_chunked_logprobs_keep_no_full_vocabulary_tensor_for_backward():
    head, h, ids = _head_case(n=512, vocab=211)
    saved = []

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    for entropy_grad in (True, False):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            lp, ent = alg.chunked_logprobs_and_entropy(h, head, ids, entropy_grad=entropy_grad, chunk_rows=64)
        assert lp.requires_grad and ent.requires_grad == entropy_grad
        largest = max(math.prod(shape) for shape in saved)
        assert largest <= 512 * 8, (entropy_grad, sorted(set(saved)))  # hidden states, not [N, V] logits
        (lp.sum() + (ent.sum() if entropy_grad else 0)).backward()
    # no entropy asked: none computed
    with torch.no_grad():
        lp, ent = alg.chunked_logprobs_and_entropy(h, head, ids, entropy=False)
    assert ent is None and lp.shape == (512,)
    empty_lp, empty_ent = alg.chunked_logprobs_and_entropy(h[:0], head, ids[:0])
    assert empty_lp.shape == empty_ent.shape == (0,)


def test_gather_logprobs_matches_log_softmax():
    torch.manual_seed(5)
    logits = torch.randn(7, 11)
    ids = torch.randint(0, 11, (7,))
    torch.testing.assert_close(alg.gather_logprobs(logits, ids),
                               torch.log_softmax(logits, -1)[torch.arange(7), ids])


# ---------------------------------------------------------------- one object per algorithm


def _sample(dialogue, turn, mask, old_values, group="g"):
    """A stand-in for the learner's ``Sample``: the fields the algorithm objects read."""
    return SimpleNamespace(dialogue_id=dialogue, group_id=group, turn=turn, mask=torch.tensor(mask),
                           old_values=torch.tensor(old_values), advantages=None, returns=None)


class _Sum:
    """One process's ``Collectives``: a sum over processes is the value itself."""

    def sum(self, tensor):
        return tensor.double()


def test_the_registry_has_one_object_per_configured_algorithm_and_the_lookup_reads_the_name():
    names = set(get_args(TrainingConfig.model_fields["algorithm"].annotation))
    assert set(algo.ALGORITHMS) == names
    for name, algorithm in algo.ALGORITHMS.items():
        assert algorithm.name == name
        assert algo.algorithm_for(TrainingConfig(algorithm=name)) is algorithm
    assert isinstance(algo.algorithm_for(TrainingConfig(algorithm="ppo")), algo.PPO)


def test_no_library_module_compares_the_algorithm_name():
    """The algorithm is decided in one place (``algorithm_for``): nothing compares a
    string to ``"ppo"`` or ``"grpo"``."""
    assert literal_comparisons(algo.ALGORITHMS) == []


def test_grpo_has_no_critic_and_adds_nothing_to_the_loss():
    grpo, training = algo.GRPO(), TrainingConfig(algorithm="grpo")
    assert not grpo.critic and grpo.value_head(16) is None and grpo.update_sums == ()
    assert grpo.critic_moments([]).shape == (0,) and grpo.critic_statistics(torch.zeros(0)) == {}
    loss = torch.tensor(0.3, requires_grad=True)
    assert grpo.loss_terms(loss, {}, {}, training, tokens=4.0) == (loss, {})
    assert grpo.update_metrics({}, windows=1, tokens=4.0) == {}


def test_grpo_objects_advantages_follow_the_credit():
    samples = [_sample("a#0", 0, [0.0, 1.0], [0.0, 0.0]), _sample("a#0", 1, [0.0, 1.0], [0.0, 0.0]),
               _sample("a#1", 0, [0.0, 1.0], [0.0, 0.0])]
    final = TrainingConfig(algorithm="grpo", credit="final_minus_initial", scale_rewards=False)
    kept, zero_variance, groups = algo.GRPO().assign_advantages(
        samples, {}, {"a#0": [0.1, 0.3], "a#1": [0.2]}, final, _Sum())
    # final_minus_initial: a dialogue's turn rewards summed, 0.4 against 0.2 (mean 0.3)
    assert (len(kept), zero_variance, groups) == (3, 0, 1)
    torch.testing.assert_close(torch.stack([s.advantages for s in kept]),
                               torch.tensor([[0.0, 0.1], [0.0, 0.1], [0.0, -0.1]]))
    per_turn = final.model_copy(update={"credit": "per_turn"})
    kept, _, _ = algo.GRPO().assign_advantages(samples, {}, {"a#0": [0.1, 0.3], "a#1": [0.2]}, per_turn, _Sum())
    expected, _ = credit.grpo_turn_advantages([[0.1, 0.3], [0.2]], ["g", "g"], scale_rewards=False)
    assert [float(s.advantages[1]) for s in kept] == pytest.approx([expected[0][0], expected[0][1], expected[1][0]])


def test_ppo_value_head_starts_at_zero_and_its_loss_term_is_the_clipped_value_loss():
    ppo = algo.PPO()
    head = ppo.value_head(16)
    assert ppo.critic and head.weight.shape == (1, 16) and not head.weight.any() and not head.bias.any()
    training = TrainingConfig(algorithm="ppo", ppo={"vf_coef": 0.25, "value_clip_eps": 0.2})
    batch = {"mask": torch.tensor([[1.0, 1.0, 0.0]]), "old_values": torch.tensor([[0.2, 0.1, 0.0]]),
             "returns": torch.tensor([[1.0, 0.0, 0.0]])}
    out = {"values": torch.tensor([[0.5, 0.0, 50.0]])}
    loss, parts = ppo.loss_terms(torch.tensor(1.0), out, batch, training, tokens=2.0)
    value_loss, clipped = alg.clipped_value_loss(out["values"], batch["old_values"], batch["returns"],
                                                 batch["mask"], clip_eps=0.2, normaliser=2.0)
    assert loss.item() == pytest.approx(1.0 + 0.25 * value_loss.item())
    assert set(parts) == set(ppo.update_sums)
    assert parts == {"value_loss": pytest.approx(value_loss.item()), "value_clipped": pytest.approx(clipped * 2)}
    assert ppo.update_metrics({"value_loss": 3.0, "value_clipped": 1.0}, windows=2, tokens=4.0) \
        == {"value_loss": 1.5, "value_clip_fraction": 0.25}


def test_ppo_objects_advantages_are_gae_whitened_and_its_critic_statistics_those_of_the_whole_batch():
    samples = [_sample("d#0", 0, [0.0, 1.0, 1.0], [9.0, 0.1, 0.2]), _sample("d#0", 1, [0.0, 1.0], [9.0, 0.3]),
               _sample("e#0", 0, [1.0, 1.0], [0.5, -0.2], group="e")]
    training = TrainingConfig(algorithm="ppo", ppo={"gamma": 0.9, "lam": 0.5, "whiten_advantages": True})
    ppo = algo.PPO()
    kept, zero_variance, groups = ppo.assign_advantages(samples, {"d#0": 1.0, "e#0": 0.0}, None, training, _Sum())
    assert kept is samples and (zero_variance, groups) == (0, 0)
    mask = torch.cat([s.mask for s in samples])
    advantages = torch.cat([s.advantages for s in samples])
    assert float(alg.masked_mean(advantages, mask)) == pytest.approx(0.0, abs=1e-6)
    returns, values = torch.cat([s.returns for s in samples]), torch.cat([s.old_values for s in samples])
    stats = ppo.critic_statistics(ppo.critic_moments(samples))
    assert stats["explained_variance"] == pytest.approx(alg.explained_variance(values, returns, mask))
    assert stats["return_mean"] == pytest.approx(float(alg.masked_mean(returns, mask)))
    assert stats["value_mean"] == pytest.approx(float(alg.masked_mean(values, mask)))
