"""The demo's code world (`demo.task: code`, rlhf/demo/code.py): its records, its hidden gold by hand,
and the agreement between the gold and the reward the policy sees (the record's tests, run in the sandbox)."""

from __future__ import annotations

import pytest

from rlhf.demo.code import asked, asserts_for, code_text, gold_code_score
from rlhf.demo.locations import DemoWorldConfig
from rlhf.demo.world import build_records, build_world, judge_evaluation

SMALL = DemoWorldConfig(task="code", n_sft=60, n_sft_eval=10, n_pairs=20, n_pairs_eval=10, n_prompts=30,
                        n_prompts_eval=6)


def test_the_gold_reads_the_answer_by_hand():
    prompt = "Write f(x) that returns x plus 3."
    assert asked(prompt) == ("+", 3) and asked("Define f(x) as x times 12. Please.") == ("*", 12)
    assert gold_code_score(prompt, "def f(x):\n    return x + 3") == 1.0
    assert gold_code_score(prompt, "def f(x):\n    return x + 4") == 0.0  # another constant
    assert gold_code_score(prompt, "def f(x):\n    return x * 3") == 0.0  # another operator
    assert gold_code_score(prompt, "def f(x): return x + 3") == -1.0  # not the form asked for
    assert gold_code_score(prompt, "The cat is warm.") == -1.0
    assert asserts_for("-", 7) == "assert f(2) == -5\nassert f(5) == -2"
    with pytest.raises(ValueError, match="not a code-world prompt"):
        asked("Describe the cat.")


def test_the_records_hold_prompts_with_their_tests_and_demonstrations_half_right():
    records = build_records(DemoWorldConfig(task="code"))
    assert {name: len(rows) for name, rows in records.items()} == {
        "sft": 2000, "sft_eval": 200, "preferences": 4000, "preferences_eval": 400, "prompts": 512,
        "prompts_eval": 64}
    assert not {r["prompt"] for r in records["prompts"]} & {r["prompt"] for r in records["prompts_eval"]}
    assert all(r["tests"] == asserts_for(*asked(r["prompt"])) for r in records["prompts"])
    right = sum(gold_code_score(r["prompt"], r["response"]) == 1.0 for r in records["sft"]) / len(records["sft"])
    assert 0.4 < right < 0.55  # `correct_rate` 0.5, a little less after duplicates are dropped
    assert all(gold_code_score(r["prompt"], r["response"]) >= 0 for r in records["sft"])  # always the form


@pytest.mark.multiprocess  # the sandbox's server is a process
def test_the_tests_in_the_sandbox_agree_with_the_gold():
    """The reward the policy trains on (`tests_pass`: the answer and its record's asserts, run confined)
    is 1 exactly where the hidden gold says the answer is right, on the demonstrations."""
    from stages.sandbox.code import tests_pass

    demos = build_records(SMALL)["sft"][:24]
    tests = [asserts_for(*asked(d["prompt"])) for d in demos]
    rewards = tests_pass([[{"role": "user", "content": d["prompt"]}] for d in demos], [d["response"] for d in demos],
                         tests)
    golds = [gold_code_score(d["prompt"], d["response"]) for d in demos]
    assert rewards == golds and 0 < sum(rewards) < len(demos)


def test_the_world_builds_a_tokenizer_that_writes_the_code_back(tmp_path):
    import pandas as pd

    from stages.runtime.models import load_tokenizer

    world = build_world(tmp_path, SMALL)
    tokenizer = load_tokenizer(str(world / "model"))
    answer = code_text("*", 42)
    assert tokenizer.decode(tokenizer(answer, add_special_tokens=False)["input_ids"]) == answer
    table = pd.DataFrame({"prompt_messages": ['[{"role": "user", "content": "Define f(x) as x times 42."}]'] * 2,
                          "policy_response": [answer, code_text("+", 42)],
                          "sft_response": [code_text("+", 42)] * 2, "tests": [asserts_for("*", 42)] * 2})
    gold = judge_evaluation(table)
    assert gold["eval/gold_reward"] == 0.5 and gold["eval/gold_win_rate"] == 0.75
