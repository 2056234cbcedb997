"""User code for `config.yaml`: a reward function and a stage, found by `module:function`
names (this directory is the working directory, so `my_code` is importable)."""


def well_formed(prompt: str, completion: str, sample: dict) -> dict:
    """A format reward: 1 when the completion is a plain number. The dict's other entries are
    logged as `reward/well_formed/<key>`."""
    text = completion.strip()
    return {"score": float(text.isdigit()), "length": len(completion)}


def drop_truncated(batch, ctx):
    """A filter stage: samples cut off at rollout.max_new_tokens (no end-of-sequence token)
    stay in the batch but leave the loss, and the metrics say how many there were."""
    last_token = batch["input_ids"][:, -1]
    truncated = batch["response_mask"][:, -1].bool() & (last_token != ctx.tokenizer.eos_token_id)
    ctx.metrics.mean("custom/truncated_fraction", float(truncated.sum()), len(batch))
    return batch.updated(sample_mask=batch["sample_mask"] * (~truncated).float())
