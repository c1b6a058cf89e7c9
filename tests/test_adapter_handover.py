"""The policy hand-over from the learner to a rollout engine, checked on CPU with the embedded
SmolLM2: a saved LoRA adapter reproduces the updated policy exactly (vllm_backend.save_policy_adapter),
the chat prompt ids match the rendered template, and a plain model is refused.

Runtime on 2 shared CPU cores: about 45 s (two SmolLM2 loads, 8-token greedy decodes).
"""

from __future__ import annotations

import pytest
import torch

from rlver_lib.config import SamplingParams
from rlver_lib.vllm_backend import chat_prompt_ids, save_policy_adapter

# ----------------------------------------------------------------- adapter hand-over (SmolLM2)

CONVERSATION = [{"role": "user", "content": "I failed my driving test again and I feel stupid."}]


@pytest.fixture(scope="module")
def policy_cfg():
    from rlver_lib.config import PolicyConfig

    return PolicyConfig(dtype="float32", max_new_tokens=8)


@pytest.fixture(scope="module")
def live_policy(policy_cfg):
    """The learner's model: SmolLM2 with a fresh LoRA adapter (peft)."""
    from peft import LoraConfig, get_peft_model

    from rlver_lib.models import load_policy

    torch.manual_seed(0)
    base, tokenizer = load_policy(policy_cfg, trainable=True)
    lora = policy_cfg.lora
    model = get_peft_model(
        base, LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=lora.target_modules)
    )
    model.eval()
    return model, tokenizer


def _greedy_and_logits(model, tokenizer):
    from rlver_lib.backends import TransformersBackend

    gen = TransformersBackend(model, tokenizer).generate(
        [CONVERSATION], SamplingParams(temperature=0.0, max_new_tokens=8, seed=0)
    )[0]
    ids = torch.tensor([gen.prompt_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1]
    return gen, logits


def test_chat_prompt_ids_match_the_rendered_template(live_policy):
    _, tokenizer = live_policy
    text = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert chat_prompt_ids(tokenizer, CONVERSATION) == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_saved_adapter_reproduces_the_updated_policy(live_policy, policy_cfg, tmp_path):
    from rlver_lib.models import load_policy

    model, tokenizer = live_policy
    before_gen, before_logits = _greedy_and_logits(model, tokenizer)

    # a LoRA update: move every B matrix away from its zero initialisation
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    live_gen, live_logits = _greedy_and_logits(model, tokenizer)

    version = save_policy_adapter(model, tmp_path, step=3)
    assert version.path == tmp_path / "policy-step000003"
    assert (version.path / "adapter_config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["policy-step000003"]  # no temp folder left
    with pytest.raises(ValueError, match="already saved"):
        save_policy_adapter(model, tmp_path, step=3)

    fresh, fresh_tok = load_policy(policy_cfg.model_copy(update={"adapter": str(version.path)}))
    fresh_gen, fresh_logits = _greedy_and_logits(fresh, fresh_tok)

    assert fresh_gen.prompt_ids == live_gen.prompt_ids
    assert fresh_gen.completion_ids == live_gen.completion_ids
    torch.testing.assert_close(fresh_logits, live_logits, rtol=1e-4, atol=1e-4)
    assert (live_logits - before_logits).abs().max().item() > 1e-2
    assert live_gen.completion_ids != before_gen.completion_ids


def test_saving_a_plain_model_is_refused(live_policy, tmp_path):
    model, _ = live_policy
    with pytest.raises(TypeError, match="PeftModel"):
        save_policy_adapter(model.get_base_model(), tmp_path, step=0)
