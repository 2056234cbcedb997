import json
import random

import pytest

from distflow.config.schema import ConfigError
from distflow.data.loader import PromptLoader
from distflow.data.sources import JsonlRows, ParquetRows, open_rows

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

NUM_ROWS = 1000
ROWS_PER_GROUP = 100


def verl_row(i: int) -> dict:
    """A row in verl's dataset format: nested chat prompt, reward spec and extra info."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": "Think step by step."},
            {"role": "user", "content": f"What is {i} + {i}?"},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
        "extra_info": {"split": "train", "index": i, "scores": [0.5, float(i)]},
    }


ROWS = [verl_row(i) for i in range(NUM_ROWS)]


def write_jsonl(path, rows, blank_every=0):
    with path.open("w") as file:
        for i, row in enumerate(rows):
            file.write(json.dumps(row) + "\n")
            if blank_every and i % blank_every == 0:
                file.write("\n   \n")
    return path


@pytest.fixture
def jsonl_path(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", ROWS, blank_every=97)


@pytest.fixture
def parquet_path(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path, row_group_size=ROWS_PER_GROUP)
    return path


def test_both_formats_give_the_same_rows(jsonl_path, parquet_path):
    with open_rows(jsonl_path) as jsonl, open_rows(parquet_path) as parquet:
        assert isinstance(jsonl, JsonlRows) and isinstance(parquet, ParquetRows)
        assert len(jsonl) == len(parquet) == NUM_ROWS
        for i in range(NUM_ROWS):
            assert jsonl[i] == parquet[i] == ROWS[i]


def test_random_access_out_of_order(jsonl_path, parquet_path):
    order = list(range(NUM_ROWS))
    random.Random(0).shuffle(order)
    with JsonlRows(jsonl_path) as jsonl, ParquetRows(parquet_path) as parquet:
        for i in order[:50] + [NUM_ROWS - 1, 0, NUM_ROWS - 1]:
            assert jsonl[i] == parquet[i] == ROWS[i]
        for source in (jsonl, parquet):
            with pytest.raises(IndexError):
                source[NUM_ROWS]
            with pytest.raises(IndexError):
                source[-1]


def test_reading_five_rows_touches_only_those_rows(jsonl_path, parquet_path):
    wanted = [3, 250, 251, 777, 999]  # 4 distinct row groups of 100
    with JsonlRows(jsonl_path) as jsonl, ParquetRows(parquet_path) as parquet:
        assert jsonl.rows_read == parquet.rows_read == 0  # building the index parses nothing
        for i in wanted:
            assert jsonl[i] == parquet[i]
        assert jsonl.rows_read == len(wanted)
        assert parquet.rows_read == 4 * ROWS_PER_GROUP
        assert parquet.rows_read <= len(wanted) * ROWS_PER_GROUP < NUM_ROWS


def test_parquet_reads_only_requested_columns(parquet_path):
    with ParquetRows(parquet_path, columns=["prompt", "reward_model"]) as parquet:
        assert parquet[42] == {"prompt": ROWS[42]["prompt"], "reward_model": ROWS[42]["reward_model"]}
    with pytest.raises(ConfigError, match="no column"):
        ParquetRows(parquet_path, columns=["answer"])


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": \n[1, 2]\n')
    with JsonlRows(path) as source:
        assert len(source) == 4
        assert source[1] == {"prompt": "b"}
        with pytest.raises(ConfigError, match=r"bad\.jsonl:4 is not valid JSON"):
            source[2]
        with pytest.raises(ConfigError, match=r"bad\.jsonl:5 must hold one JSON object"):
            source[3]


def test_json_suffix_and_missing_trailing_newline(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('{"prompt": "a"}\r\n{"prompt": "b"}')
    with open_rows(path) as source:
        assert isinstance(source, JsonlRows)
        assert [source[0], source[1]] == [{"prompt": "a"}, {"prompt": "b"}]


def test_bad_paths_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.csv.*\.parquet, \.jsonl, \.json"):
        open_rows(tmp_path / "train.csv")
    for name in ("missing.jsonl", "missing.parquet"):
        with pytest.raises(ConfigError, match=f"not found: .*{name}"):
            open_rows(tmp_path / name)
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(ConfigError, match="no rows"):
        open_rows(tmp_path / "empty.jsonl")
    pq.write_table(pa.Table.from_pylist([], schema=pa.schema([("prompt", pa.string())])), tmp_path / "empty.parquet")
    with pytest.raises(ConfigError, match="no rows"):
        open_rows(tmp_path / "empty.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(ConfigError, match="not a readable Parquet file"):
        open_rows(tmp_path / "junk.parquet")


def test_two_ranks_parse_only_their_rows_and_cover_one_rank(jsonl_path):
    num_steps, per_step = 3, 8

    def make_loader(source, rank, world_size):
        return PromptLoader(
            source.__getitem__, len(source), prompts_per_step=per_step, seed=0, rank=rank, world_size=world_size
        )

    with JsonlRows(jsonl_path) as whole, JsonlRows(jsonl_path) as first, JsonlRows(jsonl_path) as second:
        single = make_loader(whole, 0, 1)
        pair = [make_loader(first, 0, 2), make_loader(second, 1, 2)]
        for _ in range(num_steps):
            batch = single.next_batch()
            halves = [loader.next_batch() for loader in pair]
            assert batch["uid"] == halves[0]["uid"] + halves[1]["uid"]
            assert batch["prompt"] == halves[0]["prompt"] + halves[1]["prompt"]
        assert first.rows_read == second.rows_read == num_steps * per_step // 2
        assert whole.rows_read == num_steps * per_step
