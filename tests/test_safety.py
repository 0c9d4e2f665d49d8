"""Safe defaults: local-only servers, no unpickling of arbitrary objects, no remote code, by default."""

from __future__ import annotations

import os
import pickle
import subprocess

import pytest
import torch

from rlhf.config import load_config
from tests.helpers import ppo_inputs
from tests.stack import STACK


def test_the_stack_binds_to_localhost_unless_told_otherwise(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLHF_HOST")} | {"RLHF_HOME": str(tmp_path)}
    exported = subprocess.run([str(STACK), "env"], env=env, capture_output=True, text=True, check=True).stdout
    assert 'PREFECT_API_URL="http://127.0.0.1:' in exported and 'MLFLOW_TRACKING_URI="http://127.0.0.1:' in exported
    script = STACK.read_text()
    assert 'HOST="${RLHF_HOST:-127.0.0.1}"' in script
    assert script.count('--host "$HOST"') == 2  # the MLflow and the Prefect server


def test_remote_code_is_off_unless_the_config_turns_it_on():
    cfg = load_config("configs/demo.yaml")
    assert not (cfg.sft.trust_remote_code or cfg.reward.trust_remote_code or cfg.ppo.trust_remote_code)


def test_weights_load_from_safetensors_only(world, tokenizer, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from stages.runtime.models import load_causal_lm

    model = AutoModelForCausalLM.from_pretrained(world / "model", use_safetensors=True)
    AutoConfig.from_pretrained(world / "model").save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")  # the same weights as a pickle
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(OSError, match="safetensors"):
        load_causal_lm(str(tmp_path), tokenizer)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_resumed_training_state_never_unpickles_arbitrary_objects(tiny_config, trained, tmp_path):
    """The PPO full-state checkpoint's optimizer state loads with weights_only=True."""
    from stages.ppo import train_ppo

    cfg = tiny_config.ppo.model_copy(update={"num_iterations": 1, "checkpoint_every": 1})
    train_ppo(cfg, ppo_inputs(trained), tmp_path)
    marker = tmp_path / "pwned"
    (tmp_path / "state" / "optimizer.pt").write_bytes(pickle.dumps({"state": _Payload(marker)}))
    with pytest.raises(pickle.UnpicklingError):
        train_ppo(cfg, ppo_inputs(trained),
                  tmp_path)
    assert not marker.exists()
