"""Data contracts: every rejection class gives a row-level error; every known format adapts."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from flows.cli import main as cli
from schemas.errors import DataContractError
from schemas.validate import LengthBudget, load_validated
from tests.helpers import BAD, BAD_CASES, GOOD


@pytest.mark.parametrize("name,kind,expected", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_gives_row_level_report(name, kind, expected):
    with pytest.raises(DataContractError) as caught:
        load_validated(str(BAD / name), kind)
    report = caught.value.report()
    assert report.startswith(str(BAD / name) + ":")
    for line in expected:
        assert line in report, report


def test_over_length_records_are_refused_after_tokenization(tokenizer):
    with pytest.raises(DataContractError) as caught:
        load_validated(str(BAD / "sft_too_long.jsonl"), "sft", tokenizer=tokenizer, budget=LengthBudget(32, 64))
    assert [(p.row, p.column) for p in caught.value.problems] == [(2, "response")]
    assert "over the budget of 64" in caught.value.report()
    # The same file fits a larger budget.
    assert len(load_validated(str(BAD / "sft_too_long.jsonl"), "sft", tokenizer=tokenizer,
                              budget=LengthBudget(32, 1024)).frame) == 2


def test_all_failing_records_are_listed_in_one_error(tmp_path):
    path = tmp_path / "many.jsonl"
    rows = [{"prompt": "ok", "response": "fine"}, {"prompt": "", "response": "x"}, {"prompt": "p", "response": None},
            {"prompt": 1, "response": "y"}, {"prompt": "ok", "response": "fine"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataContractError) as caught:
        load_validated(str(path), "sft")
    assert sorted({p.row for p in caught.value.problems}) == [2, 3, 4, 5]


def test_jsonl_rows_are_numbered_by_line_even_after_blank_lines(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n\n\n{"prompt": "c", "response": " "}\n')
    with pytest.raises(DataContractError) as caught:
        load_validated(str(path), "sft")
    assert caught.value.problems[0].row == 4


def test_duplicates_can_be_dropped_and_are_counted():
    data = load_validated(str(BAD / "sft_duplicate.jsonl"), "sft", duplicates="drop")
    assert len(data.frame) == 2 and data.dropped_duplicates == 1
    assert "1 duplicates dropped" in data.summary()


def test_plain_pairs_keep_margin_and_ignore_known_extra_columns():
    data = load_validated(str(GOOD / "pairs_plain.jsonl"), "preference")
    assert data.format == "plain"
    assert list(data.frame.columns) == ["prompt", "prompt_messages", "chosen", "rejected", "margin"]
    assert data.frame["margin"].tolist() == [1.5]


def test_hh_transcripts_split_into_shared_prompt_and_replies(tokenizer):
    data = load_validated(str(GOOD / "pairs_hh.jsonl"), "preference", tokenizer=tokenizer)
    assert data.format == "hh"
    second = data.frame.iloc[1]
    assert json.loads(second["prompt_messages"]) == [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Describe the dog."}]
    assert (second["chosen"], second["rejected"]) == ("The dog is kind.", "The dog is rude.")
    assert second["prompt"] == "<s><|user|>Hi<|assistant|>Hello!</s><|user|>Describe the dog.<|assistant|>"


def test_chat_pairs_render_with_the_tokenizer_chat_template(tokenizer):
    data = load_validated(str(GOOD / "pairs_chat.jsonl"), "preference", tokenizer=tokenizer)
    assert data.format == "chat"
    row = data.frame.iloc[0]
    assert row["prompt"] == "<s><|system|>Be nice.<|user|>Describe the cat.<|assistant|>"
    assert (row["chosen"], row["rejected"]) == ("The cat is warm.", "The cat is cold.")


def test_chat_sft_and_plain_prompts_and_other_readers():
    assert load_validated(str(GOOD / "sft_chat.jsonl"), "sft").frame.iloc[0]["response"] == "The cat is warm."
    assert len(load_validated(str(GOOD / "prompts.jsonl"), "prompt").frame) == 2
    assert load_validated(str(GOOD / "sft.csv"), "sft").frame.iloc[0]["response"] == "The cat is warm, kind."
    assert load_validated(str(GOOD / "pairs.json"), "preference").frame.iloc[0]["chosen"] == "The cat is warm."
    assert load_validated(str(GOOD / "sft_plain.jsonl"), "sft").frame.iloc[1]["response"] == "The dog is kind."


def test_parquet_and_datasets_folder(tmp_path):
    frame = pd.DataFrame({"prompt": ["Describe the cat.", "Describe the dog."], "response": ["The cat is warm.", "  "]})
    frame.to_parquet(tmp_path / "sft.parquet")
    with pytest.raises(DataContractError, match="row 2, column 'response': must not be blank"):
        load_validated(str(tmp_path / "sft.parquet"), "sft")
    folder = tmp_path / "dataset"  # any name `datasets.load_dataset` takes; a local folder here
    folder.mkdir()
    frame.head(1).to_json(folder / "train.jsonl", orient="records", lines=True)
    assert len(load_validated(str(folder), "sft").frame) == 1


def test_missing_file_and_unknown_dataset_are_reported_not_raised_raw(tmp_path):
    with pytest.raises(DataContractError, match="file not found"):
        load_validated(str(tmp_path / "nope.jsonl"), "sft")


def test_digest_identifies_the_canonical_records():
    a = load_validated(str(GOOD / "sft_plain.jsonl"), "sft")
    b = load_validated(str(GOOD / "sft_plain.jsonl"), "sft")
    c = load_validated(str(GOOD / "sft.csv"), "sft")
    assert a.digest == b.digest and a.digest != c.digest


def test_cli_validate_exit_codes_and_reports(capsys):
    assert cli(["validate", "--kind", "preference", str(GOOD / "pairs_hh.jsonl")]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "2 valid preference records (hh format)" in out
    assert cli(["validate", "--kind", "sft", str(BAD / "sft_null.jsonl")]) == 1
    err = capsys.readouterr().err
    assert "line 2, column 'prompt': missing value (null)" in err and "Traceback" not in err


def test_cli_validate_checks_lengths_with_a_tokenizer(world, capsys):
    args = ["validate", "--kind", "sft", str(BAD / "sft_too_long.jsonl"), "--tokenizer", str(world / "model"),
            "--max-prompt-length", "32", "--max-length", "64"]
    assert cli(args) == 1
    assert "line 2, column 'response'" in capsys.readouterr().err
