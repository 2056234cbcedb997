"""The embedded default trained from Python with a reward written here; arguments are overrides, e.g. `python
examples/python_api.py trainer.total_steps=20`; `python -m torch.distributed.run --nproc_per_node 2 ...` too."""

import sys

import distflow


def reward(prompt, completion, sample):  # the right sum: 1; another number: 0; anything else: -0.5
    answer = completion.strip()
    return 1.0 if answer == sample["answer"] else 0.0 if answer.isdigit() else -0.5


if __name__ == "__main__":
    result = distflow.train(overrides=sys.argv[1:], rewards=reward)
    print(f"{result.run_dir}: held-out accuracy {result.summary['final_accuracy']}", file=sys.stderr)
