"""`distflow.train(dataset=rows)` with a bad row names the row as the user indexes their list,
`dataset[i]` (or `heldout[i]`), and the missing field, not the temporary file the rows were
written to (removed when the call returns)."""

import string

import pytest

import distflow
from distflow.tasks.math_answers import SIMPLE_CHAT_TEMPLATE
from distflow.tasks.tiny_model import build_tiny_model
from distflow.tasks.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("model")
    tokenizer = build_char_tokenizer("".join(c for c in string.printable if c not in "\n\r\t\x0b\x0c"))
    tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE
    build_tiny_model(tokenizer, seed=0, max_positions=128).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _train(model_dir, tmp_path, **given):
    overrides = {
        "model.path": str(model_dir),
        "trainer.total_steps": 1,
        "trainer.prompts_per_step": 2,
        "rollout.num_samples": 2,
        "rollout.max_new_tokens": 4,
        "trainer.eval_every": 0,
        "trainer.eval_samples": 1,
        "trainer.progress_bar": False,
        "checkpoint.at_end": False,
        "trainer.output_dir": str(tmp_path),
    }
    return distflow.train(overrides=overrides, rewards=lambda prompt, completion, sample: 0.0, **given)


def _rows(n):
    return [{"prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(n)]


def _one_line(err) -> str:
    message = str(err)
    assert "\n" not in message and "distflow-rows" not in message and ".jsonl" not in message, message
    return message


def test_a_row_without_a_prompt_is_named_by_its_index_in_the_list(model_dir, tmp_path):
    rows = _rows(20)
    rows[0] = {"question": "What is 0+1?", "answer": "1"}
    with pytest.raises(distflow.ConfigError) as raised:
        _train(model_dir, tmp_path, dataset=rows)
    assert _one_line(raised.value).startswith("dataset[0]: missing field 'prompt'"), raised.value


def test_a_later_row_and_a_missing_answer_are_named_too(model_dir, tmp_path):
    rows = _rows(20)
    del rows[5]["answer"]
    with pytest.raises(distflow.ConfigError) as raised:
        _train(model_dir, tmp_path, dataset=rows)
    assert _one_line(raised.value).startswith("dataset[5]: missing field 'reward_model.ground_truth' or 'answer'"), (
        raised.value
    )


def test_held_out_rows_are_named_by_the_list_they_came_from(model_dir, tmp_path):
    rows = _rows(20)  # the last 2 (a tenth) are held out: the bad one is still dataset[19]
    rows[19] = {"prompt": "", "answer": "20"}
    with pytest.raises(distflow.ConfigError) as raised:
        _train(model_dir, tmp_path, dataset=rows)
    assert _one_line(raised.value).startswith("dataset[19]: empty prompt"), raised.value
    held = _rows(3)
    held[2] = {"answer": "3"}
    with pytest.raises(distflow.ConfigError) as raised:
        _train(model_dir, tmp_path, dataset=_rows(20), heldout=held)
    assert _one_line(raised.value).startswith("heldout[2]: missing field 'prompt'"), raised.value
    with pytest.raises(distflow.ConfigError) as raised:
        _train(model_dir, tmp_path, dataset={"train": _rows(20), "test": held})
    assert _one_line(raised.value).startswith("dataset['test'][2]: missing field 'prompt'"), raised.value


def test_the_rows_written_carry_the_names_the_caller_gave_them():
    from distflow.inputs import Inputs

    inputs = Inputs(launched=False, nproc=1)
    try:
        data = {"task": {}, "env": {}}
        inputs.apply(data, num_heldout=1000, dataset=_rows(30))
        assert data["task"]["given_rows"] == {"train": "dataset", "heldout": "dataset", "heldout_start": 27}
        inputs.apply(data, num_heldout=1000, dataset={"train": _rows(5), "validation": _rows(2)})
        assert data["task"]["given_rows"] == {
            "train": "dataset['train']",
            "heldout": "dataset['validation']",
            "heldout_start": 0,
        }
        rows = _rows(4)
        rows[2]["answer"] = {1, 2}
        with pytest.raises(distflow.ConfigError, match=r"^heldout\[2\] is not JSON-serializable"):
            inputs.apply(data, num_heldout=1000, dataset=_rows(5), heldout=rows)
    finally:
        inputs.close()


@pytest.mark.parametrize("bad", [False, True])
def test_a_run_on_rows_leaves_no_file_open(model_dir, tmp_path, bad):
    """The task's row files are closed when the run ends, or when its rows fail a check: none is
    left for the garbage collector to warn about (ResourceWarning: unclosed file)."""
    import gc
    import warnings

    rows = _rows(20)
    if bad:
        rows[3] = {"prompt": "", "answer": "4"}
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        if bad:
            with pytest.raises(distflow.ConfigError):
                _train(model_dir, tmp_path, dataset=rows)
        else:
            _train(model_dir, tmp_path, dataset=rows)
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == [], unclosed
