"""Reward models: a local `AutoModelForSequenceClassification` scores (prompt, completion).

Each rank scores its own samples (no rank gathers them), in batches of `batch_size`, on its
own device, in float32 on CPU and the model's stored dtype on CUDA. The text a reward model
reads is the conversation user: prompt, assistant: completion through its tokenizer's chat
template when it has one, else prompt + completion; rows are right-padded with an attention
mask, and the score is the single label's logit (a model read by Hugging Face's sequence
classification head takes the last non-padding token). The model is loaded on first use, so
ranks that never score (train-only ranks of a disaggregated run) never hold it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


class RewardModel:
    def __init__(self, path: str, *, batch_size: int, device: torch.device) -> None:
        self.path = Path(path).expanduser()
        self.batch_size = batch_size
        self.device = device
        self._model = None
        self._tokenizer = None

    def _load(self) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        dtype = "auto" if self.device.type == "cuda" else torch.float32
        self._model = AutoModelForSequenceClassification.from_pretrained(self.path, dtype=dtype).to(self.device).eval()
        self._tokenizer = AutoTokenizer.from_pretrained(self.path)
        self._tokenizer.padding_side = "right"
        if self._tokenizer.pad_token is None:
            self._tokenizer.pad_token = self._tokenizer.eos_token
        if self._model.config.pad_token_id is None:  # the head finds each row's last token by it
            self._model.config.pad_token_id = self._tokenizer.pad_token_id

    def texts(self, prompts: Sequence[str], completions: Sequence[str]) -> list[str]:
        if self._tokenizer.chat_template:
            return [
                self._tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}, {"role": "assistant", "content": c}], tokenize=False
                )
                for p, c in zip(prompts, completions, strict=True)
            ]
        return [p + c for p, c in zip(prompts, completions, strict=True)]

    @torch.no_grad()
    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> torch.Tensor:
        """One float32 score per (prompt, completion)."""
        if self._model is None:
            self._load()
        texts = self.texts(prompts, completions)
        out = []
        for start in range(0, len(texts), self.batch_size):
            encoded = self._tokenizer(
                texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                add_special_tokens=not self._tokenizer.chat_template,
            ).to(self.device)
            out.append(self._model(**encoded).logits[:, 0].float().cpu())
        return torch.cat(out) if out else torch.zeros(0)
