"""What the benchmarks share: the TRL baseline's virtualenv (.venv-bench), the untrained models of
throughput.py's settings, saved as local Hugging Face directories, and the prompt rows in the order
distflow's loader serves them (so TRL, with shuffling off, trains on the same prompts at the same
steps). Used by throughput.py, roofline.py and learning.py; not a benchmark itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_VENV = ROOT / ".venv-bench"
REQUIREMENTS = ROOT / "benchmarks" / "requirements-trl.txt"
TORCH_PIN = "torch==2.13.0"


def log(text: str) -> None:
    print(f"[bench] {text}", file=sys.stderr, flush=True)


def run_checked(cmd: list, *, env: dict | None = None, what: str) -> str:
    """Run a command; on failure show its output and stop. Returns stdout."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-5000:])
        raise SystemExit(f"[bench] {what} failed (exit {proc.returncode}): {' '.join(map(str, cmd))}")
    return proc.stdout


def ensure_bench_venv() -> Path:
    """.venv-bench with TRL; rebuilt only when requirements-trl.txt changes."""
    python = BENCH_VENV / "bin" / "python"
    stamp = BENCH_VENV / ".installed"
    wanted = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    if stamp.is_file() and stamp.read_text() == wanted:
        return python
    log(f"setting up {BENCH_VENV.name} (TRL baseline; first run only)")
    if not python.exists():
        run_checked(["python3", "-m", "venv", BENCH_VENV], what="creating the benchmark venv")
    # torch first and alone, so pip picks the local CPU wheel; the constraint then stops
    # TRL's dependencies from pulling in any other torch build.
    run_checked([python, "-m", "pip", "install", "--quiet", TORCH_PIN], what="installing torch")
    constraints = BENCH_VENV / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    run_checked(
        [python, "-m", "pip", "install", "--quiet", "-c", constraints, "-r", REQUIREMENTS], what="installing TRL"
    )
    stamp.write_text(wanted)
    return python


def build_model(kind: str):
    """(model, tokenizer) of a setting, untrained: `tiny`, `long` (EOS rarely sampled), `wide` or
    `qwen0.5b`."""
    import torch

    from distflow.tasks.tiny_model import build_tiny_model
    from distflow.tasks.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    if kind == "qwen0.5b":
        return qwen_model(tokenizer), tokenizer
    if kind == "wide":
        return build_tiny_model(
            tokenizer, seed=0, hidden_size=384, num_layers=8, num_heads=6, num_kv_heads=2
        ), tokenizer
    model = build_tiny_model(tokenizer, seed=0, max_positions=128)
    if kind == "long":
        with torch.no_grad():  # tied: the same rows embed the input and score the output
            weight = model.get_input_embeddings().weight
            weight.mul_(2.0)
            weight[tokenizer.eos_token_id] = 0.0
    return model, tokenizer


def qwen_model(tokenizer):
    """Qwen2-0.5B's architecture (its config.json's sizes) over the character vocabulary, random init."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def save_model(directory: Path, kind: str) -> Path:
    """A setting's model as a local Hugging Face directory, loaded from there by every system."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model, tokenizer = build_model(kind)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def prompt_rows(prompts: int, steps: int) -> list[dict]:
    """Every prompt row of a run, in the order distflow's loader serves them."""
    from distflow.data.loader import PromptLoader
    from distflow.tasks.arithmetic import ArithmeticTask

    task = ArithmeticTask.build(num_digits=2, num_heldout=100, seed=0)
    loader = PromptLoader(
        task.train.__getitem__, len(task.train), prompts_per_step=prompts, seed=0, rank=0, world_size=1
    )
    return [row for _ in range(steps) for row in loader.next_batch()["sample"]]


def write_prompts(path: Path, args: argparse.Namespace) -> Path:
    """The run's prompts as jsonl (so TRL, with shuffling off, trains on the same prompts at the same steps)."""
    path.write_text("".join(json.dumps(row) + "\n" for row in prompt_rows(args.prompts, args.steps)))
    return path
