"""Bad data files and rows, through the row sources the loader reads them with and the
loader's validation: every invalid row is named with its number, or skipped and counted."""

import json

import pytest

from distflow.config import ConfigError
from distflow.data.loader import RowRules, ValidRows
from distflow.data.sources import open_rows

NO_TRUTH_ROW = json.dumps({"prompt": [{"role": "user", "content": "2+2="}], "extra": 1})
SURROGATE_ROW = '{"prompt": [{"role": "user", "content": "2+2=\\ud800"}], "reward_model": {"ground_truth": "4"}}'


def rows_of(path, **rules):
    source = open_rows(path)  # left open: the view reads kept rows from it later
    return ValidRows(
        source.__getitem__,
        len(source),
        RowRules(**rules),
        tokenize=lambda prompts: [list(p) for p in prompts],
        where=str(path),
    )


def jsonl(tmp_path, *lines, name="train.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = json.dumps({"prompt": "1+1=", "answer": "2", "reward_model": {"ground_truth": "2"}})
DATA = [  # (id, lines after one good row, rules, needle)
    ("invalid json", ['{"prompt": "1+'], {}, "row 2 of 2: {path}:2 is not valid JSON"),
    ("not an object", ['["1+1="]'], {}, "must hold one JSON object per line (got list)"),
    ("missing prompt", ['{"answer": "2"}'], {}, "row 2 of 2: missing field 'prompt'"),
    ("empty prompt", ['{"prompt": "   ", "answer": "2"}'], {}, "row 2 of 2: empty prompt"),
    ("empty chat prompt", ['{"prompt": [{"role": "user", "content": ""}]}'], {}, "row 2 of 2: empty prompt"),
    ("prompt type", ['{"prompt": 12}'], {}, "row 2 of 2: prompt is of type int, not text or chat messages"),
    (
        "missing required",
        ['{"prompt": "2+2="}'],
        {"required_fields": ("answer",)},
        "row 2 of 2: missing field 'answer'",
    ),
    (
        "missing nested",
        ['{"prompt": "2+2=", "reward_model": {}}'],
        {"required_fields": ("reward_model.ground_truth",)},
        "row 2 of 2: missing field 'reward_model.ground_truth'",
    ),
    (
        "null required",
        ['{"prompt": "2+2=", "answer": null}'],
        {"required_fields": ("answer",)},
        "missing field 'answer'",
    ),
    (
        "overlong",
        ['{"prompt": "12345678+1=", "answer": "2"}'],
        {"max_prompt_tokens": 5},
        "row 2 of 2: prompt has 11 tokens > data.max_prompt_tokens=5",
    ),
]


@pytest.mark.parametrize("lines, rules, needle", [c[1:] for c in DATA], ids=[c[0] for c in DATA])
def test_invalid_data_rows_name_the_row(tmp_path, lines, rules, needle):
    path = jsonl(tmp_path, GOOD, *lines)
    with pytest.raises(ConfigError) as err:
        rows_of(path, **rules)
    assert needle.replace("{path}", str(path)) in str(err.value)
    assert "data.on_invalid_row=skip" in str(err.value) or "JSON" in str(err.value)
    kept = rows_of(path, **rules, skip_invalid=True)
    assert len(kept) == 1 and kept[0]["prompt"] == "1+1=" and sum(kept.skipped.values()) == 1


@pytest.mark.parametrize(
    "name, text, needle",
    [
        ("empty.jsonl", "\n\n", "dataset file has no rows"),
        ("train.csv", "prompt\n1+1=\n", "the extension must be one of"),
    ],
    ids=["empty file", "unsupported format"],
)
def test_unusable_data_files(tmp_path, name, text, needle):
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=needle):
        rows_of(tmp_path / name)
    with pytest.raises(ConfigError, match="dataset file not found"):
        rows_of(tmp_path / "missing.jsonl")


def test_parquet_rows_are_validated_too(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "", "2+2="], "answer": ["2", "0", None]}), path, row_group_size=2)
    with pytest.raises(ConfigError, match="row 2 of 3: empty prompt"):
        rows_of(path)
    kept = rows_of(path, required_fields=("answer",), skip_invalid=True)
    assert kept.kept == [0] and kept.skipped == {"empty prompt": 1, "missing 'answer'": 1}
    assert kept.describe_skipped() == "1 empty prompt, 1 missing 'answer'"


def test_loader_state_of_another_dataset_is_rejected():
    from distflow.data.loader import PromptLoader

    rows = [{"prompt": f"{i}+1="} for i in range(12)]
    saved = PromptLoader(rows.__getitem__, 10, prompts_per_step=4, seed=0, rank=0, world_size=1)
    saved.next_batch()
    other = PromptLoader(rows.__getitem__, 12, prompts_per_step=4, seed=0, rank=0, world_size=1)
    with pytest.raises(ConfigError, match=r"does not fit this dataset of 12 valid rows"):
        other.load_state_dict(saved.state_dict())


def _validate_shard(comm, path, skip):
    """Each rank checks its 1/N of the rows; returns what it keeps (or the error it raises)."""
    source = open_rows(path)
    read = []

    def read_row(i):
        read.append(i)
        return source[i]

    try:
        view = ValidRows(
            read_row,
            len(source),
            RowRules(skip_invalid=skip),
            where=str(path),
            shard=(comm.rank, comm.world_size),
            gather=comm.all_gather_object,
        )
    except ConfigError as err:
        return {"error": str(err), "read": read}
    return {"kept": view.kept, "skipped": view.skipped, "read": read}


@pytest.mark.parametrize("skip", [False, True], ids=["error", "skip"])
def test_rows_are_validated_by_shards_with_one_outcome(tmp_path, skip):
    from distflow.runtime.launcher import run_local

    lines = [json.dumps({"prompt": f"{i}+1="}) for i in range(9)]
    lines[4] = json.dumps({"prompt": ""})  # checked by rank 0 of 2
    lines[7] = json.dumps({"answer": "1"})  # checked by rank 1 of 2
    path = jsonl(tmp_path, *lines)
    results = run_local(_validate_shard, 2, path, skip)
    assert [sorted(r["read"]) for r in results] == [[0, 2, 4, 6, 8], [1, 3, 5, 7]]  # each row read once
    if skip:
        assert results[0]["kept"] == results[1]["kept"] == [0, 1, 2, 3, 5, 6, 8]
        assert results[0]["skipped"] == results[1]["skipped"] == {"empty prompt": 1, "missing 'prompt'": 1}
    else:  # both ranks stop on the same (first) invalid row, though only rank 0 read it
        assert results[0]["error"] == results[1]["error"]
        assert "row 5 of 9: empty prompt" in results[0]["error"]


def test_rows_the_task_cannot_use_can_be_skipped(tmp_path):
    path = jsonl(tmp_path, GOOD, NO_TRUTH_ROW, SURROGATE_ROW.replace("reward_model", "x"))
    kept = rows_of(path, task_fields=(("reward_model.ground_truth", "answer"),), skip_invalid=True)
    assert kept.kept == [0] and kept.skipped == {"missing 'reward_model.ground_truth'": 1, "prompt not UTF-8": 1}
