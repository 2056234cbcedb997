"""The memory plan (`distflow plan --memory`) against the peak resident memory of real `distflow train` runs.

    .venv/bin/python benchmarks/memory_plan.py            # every case below (~25 min on 2 cores, 24 GiB)
    .venv/bin/python benchmarks/memory_plan.py --only qwen0.5b-fsdp2-ckpt
    .venv/bin/python benchmarks/memory_plan.py --quick    # smoke test (the embedded model, ddp, 2 ranks, 1 step)

Each case is one `distflow train` run of 2 steps (no evaluation, no checkpoint) with `--nproc N`:

    tiny-*        examples/arith_grpo.yaml, the embedded model (~1M parameters; no warm-start)
    smollm2-*     SmolLM2-135M-Instruct (`make smollm2`), examples/math_verl.yaml on its 4 sample rows
    qwen0.5b-*    a Qwen2.5-0.5B-shaped model (Qwen2Config, random weights, SmolLM2's tokenizer), the same task
    qwen1.5b-*    a Qwen2.5-1.5B shape: planned only (its ddp run would not fit this machine's RAM)

The math cases reward completions by their length's parity (a random model never answers) and set
data.max_prompt_tokens to the longest chat-formatted prompt of the rows, so that the plan sizes the
prompts the run has. Every rank records its peak resident set (VmHWM of /proc/self/status, read at
exit by a `sitecustomize` this script puts on the ranks' PYTHONPATH); the table gives the largest
over the ranks against the plan of the same config and overrides (`planner.memory_fit.plan_of`,
what `distflow plan --memory` prints), and `process baseline` is measured here too: the VmRSS of a
python that imports what a rank imports. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
MiB = 2**20
QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14)
QWEN_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12)
QWEN_COMMON = dict(vocab_size=151936, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768)
SITECUSTOMIZE = """import atexit, os
_out = os.environ.get("MEMORY_PLAN_RSS_DIR")
if _out:
    def _write_peak():
        status = open("/proc/self/status").read()
        kib = next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))
        name = os.environ.get("RANK", "main")
        open(os.path.join(_out, f"{name}-{os.getpid()}.kib"), "w").write(kib)
    atexit.register(_write_peak)
"""
PARITY = "def parity(prompt, completion, sample):\n    return float(len(completion) % 2)\n"
TWO_STEPS = [
    "trainer.total_steps=2", "trainer.evaluate=false", "checkpoint.at_end=false", "checkpoint.every=0",
    "trainer.progress_bar=false", "trainer.loggers=[jsonl]", "trainer.eval_every=0",
]  # fmt: skip
MATH = [
    "task.train_file=examples/data/math_sample.jsonl", "task.heldout_file=examples/data/math_sample.jsonl",
    "task.num_heldout=1", "task.reward=parity_reward:parity", "trainer.prompts_per_step=4",
    "rollout.num_samples=4", "rollout.max_new_tokens=16",
]  # fmt: skip


def cases(work: Path, quick: bool) -> list[dict]:
    """(name, config, overrides, nproc, run it or only plan it)."""
    tiny = dict(config="examples/arith_grpo.yaml", extra=["warmstart.target_accuracy=0"])
    if quick:
        return [dict(name="tiny-ddp", nproc=2, run=True, **tiny, overrides=["trainer.total_steps=1"])]
    smollm2 = f"model.path={smollm2_dir()}"
    qwen05, qwen15 = f"model.path={work / 'qwen0.5b'}", f"model.path={work / 'qwen1.5b'}"
    fsdp2, ckpt = "parallel.strategy=fsdp2", "parallel.activation_checkpointing=true"
    math = dict(config="examples/math_verl.yaml", extra=MATH)
    return [
        dict(name="tiny-ddp", nproc=2, run=True, **tiny, overrides=[]),
        dict(name="tiny-fsdp2", nproc=2, run=True, **tiny, overrides=[fsdp2]),
        dict(name="smollm2-ddp", nproc=2, run=True, **math, overrides=[smollm2]),
        dict(name="smollm2-fsdp2", nproc=2, run=True, **math, overrides=[smollm2, fsdp2]),
        dict(name="smollm2-fsdp2-ckpt", nproc=2, run=True, **math, overrides=[smollm2, fsdp2, ckpt]),
        dict(name="qwen0.5b-ddp", nproc=1, run=True, **math, overrides=[qwen05]),
        dict(name="qwen0.5b-fsdp2-ckpt", nproc=2, run=True, **math, overrides=[qwen05, fsdp2, ckpt]),
        dict(name="qwen0.5b-ddp-2ranks", nproc=2, run=False, **math, overrides=[qwen05]),
        dict(name="qwen1.5b-fsdp2-ckpt", nproc=2, run=False, **math, overrides=[qwen15, fsdp2, ckpt]),
        dict(name="qwen1.5b-ddp", nproc=2, run=False, **math, overrides=[qwen15]),
    ]


def smollm2_dir() -> Path:
    found = sorted(Path("~/.cache/distflow/models").expanduser().glob("SmolLM2-135M-Instruct*/config.json"))
    if not found:
        sys.exit("[bench] SmolLM2 is not converted: make smollm2")
    return found[0].parent


def save_qwen(directory: Path, shape: dict, *, weights: bool) -> None:
    """A Qwen2.5-shaped model with SmolLM2's tokenizer; random weights (or only its config.json)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config = Qwen2Config(**QWEN_COMMON, **shape, **ids, pad_token_id=tokenizer.pad_token_id, rope_theta=1e6)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    if not weights:
        config.save_pretrained(directory)
        return
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def longest_prompt(tokenizer_dir: Path) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = [json.loads(line) for line in (ROOT / "examples/data/math_sample.jsonl").read_text().splitlines()]
    texts = [tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False) for row in rows]
    return max(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts)


def planned(case: dict) -> dict:
    from distflow.config import load_config
    from distflow.planner.memory import plan_memory
    from distflow.planner.memory_fit import plan_of

    config = load_config(str(ROOT / case["config"]), case["extra"] + TWO_STEPS + case["overrides"])
    shape, settings = plan_of(config, case["nproc"])
    plan = plan_memory(shape, settings)
    return {"plan_gib": plan.peak / GiB, "params_m": plan.num_parameters / 1e6, "inference_gib": plan.inference / GiB,
            "update_gib": plan.update / GiB, "persistent_gib": plan.persistent / GiB}  # fmt: skip


def train(case: dict, work: Path, environ: dict[str, str]) -> dict:
    """Run the case; the peak resident set of each rank (GiB), the largest first."""
    out = work / f"rss-{case['name']}"
    out.mkdir()
    cmd = [sys.executable, "-m", "distflow", "train", str(ROOT / case["config"]), "--nproc", str(case["nproc"])]
    cmd += case["extra"] + TWO_STEPS + case["overrides"] + [f"trainer.output_dir={work / 'runs'}"]
    cmd += [f"trainer.run_name={case['name']}"]
    path = f"{work}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    env = dict(os.environ, **environ, MEMORY_PLAN_RSS_DIR=str(out), PYTHONPATH=path)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        sys.exit(f"[bench] {case['name']}: {' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    ranks = sorted((p for p in out.glob("*.kib") if not p.name.startswith("main")), key=lambda p: p.name)
    if case["nproc"] == 1:
        ranks = list(out.glob("main-*.kib"))
    peaks = sorted((int(p.read_text()) * 1024 / GiB for p in ranks), reverse=True)
    return {"measured_gib": peaks, "warnings": [line for line in done.stderr.splitlines() if "memory plan" in line]}


def baseline_mib() -> float:
    """VmRSS of a python that has imported what a rank imports before it loads a model."""
    code = (
        "import distflow.runtime.executor, distflow.training.trainable, distflow.rollout.compact, transformers, torch\n"
        "print(open('/proc/self/status').read())"
    )
    status = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    return int(re.search(r"VmRSS:\s+(\d+)", status.stdout).group(1)) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="*", help="case names (default: all)")
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        metavar="BYTES",
        help="run the ranks with glibc's MALLOC_MMAP_THRESHOLD_=BYTES (a fixed threshold: freed blocks at least "
        "this large leave the resident set at once)",
    )
    args = parser.parse_args()
    environ = {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold else {}
    with tempfile.TemporaryDirectory(prefix="memory-plan-") as tmp:
        work = Path(tmp)
        (work / "sitecustomize.py").write_text(SITECUSTOMIZE)
        (work / "parity_reward.py").write_text(PARITY)
        chosen = [c for c in cases(work, args.quick) if not args.only or c["name"] in args.only]
        prepare(work, chosen)
        results = {"baseline_mib": round(baseline_mib(), 1), "mmap_threshold": args.mmap_threshold}
        print(
            f"{'case':<22} {'ranks':>5} {'params':>8} {'plan GiB':>9} {'measured GiB (per rank)':>26} {'plan/meas':>9}"
        )
        for case in chosen:
            row = {"nproc": case["nproc"], **planned(case)}
            if case["run"]:
                row.update(train(case, work, environ))
                row["ratio"] = row["plan_gib"] / row["measured_gib"][0]
            measured = " ".join(f"{g:.2f}" for g in row.get("measured_gib", [])) or "(planned only)"
            ratio = f"{row['ratio']:.2f}" if "ratio" in row else "-"
            name, plan = f"{case['name']:<22} {case['nproc']:>5}", f"{row['params_m']:>7.1f}M {row['plan_gib']:>9.2f}"
            print(f"{name} {plan} {measured:>26} {ratio:>9}")
            results[case["name"]] = row
        print(json.dumps(results))


def prepare(work: Path, chosen: list[dict]) -> None:
    """The Qwen-shaped directories the chosen cases need, and the math cases' prompt limit."""
    names = {c["name"].split("-")[0] for c in chosen}
    for name, shape in (("qwen0.5b", QWEN_05B), ("qwen1.5b", QWEN_15B)):
        if name in names:
            runs = any(c["run"] for c in chosen if c["name"].startswith(name))
            save_qwen(work / name, shape, weights=runs)
    if any(c["config"].endswith("math_verl.yaml") for c in chosen):
        limit = f"data.max_prompt_tokens={longest_prompt(smollm2_dir())}"
        for case in chosen:
            if case["config"].endswith("math_verl.yaml"):
                case["extra"] = case["extra"] + [limit]


if __name__ == "__main__":
    main()
