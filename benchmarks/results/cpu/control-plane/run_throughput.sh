#!/usr/bin/env bash
# Demo model, CPU, offline throughput: this checkout ("after") and a worktree of 89b264d
# ("before"), interleaved run by run so that whatever else the machine does slows both alike;
# every run records its step timeline.
#   usage: benchmarks/results/cpu/control-plane/run_throughput.sh ROUNDS BEFORE_WORKTREE [FIRST]
# (rounds FIRST .. FIRST + ROUNDS - 1; FIRST defaults to 1)
# (make the worktree with: git worktree add --detach /tmp/tpe-before-89b264d 89b264d)
set -euo pipefail
rounds=${1:-3}
before=${2:-/tmp/tpe-before-89b264d}
first=${3:-1}
repo=$(cd "$(dirname "$0")/../../../.." && pwd)
out=$repo/benchmarks/results/cpu/control-plane
py=$repo/.venv/bin/python
workload=(--min-input-len 32 --max-input-len 256 --min-output-len 16 --max-output-len 128)
for round in $(seq "$first" $((first + rounds - 1))); do
  # Odd rounds run after first, even rounds before first: a burst of load hits both alike.
  sides=(after before); [ $((round % 2)) = 0 ] && sides=(before after)
  for seqs in 16 64; do
    for side in "${sides[@]}"; do
      root=$repo; [ "$side" = before ] && root=$before
      name=bench-demo-tp1-seqs$seqs-$side-run$round
      cmd=("$py" launch/bench.py --num-seqs "$seqs" "${workload[@]}"
           --step-timeline "$out/timeline-demo-tp1-seqs$seqs-$side-run$round.json"
           --output-json "$out/$name.json")
      # PYTHONPATH: the checkout's packages, not the editable install's (/work/main).
      (cd "$root" && export PYTHONPATH=$root &&
        { echo "\$ (cd $root && PYTHONPATH=$root ${cmd[*]})"; uptime; "${cmd[@]}"; } > "$out/$name.log" 2>&1)
      tail -n 3 "$out/$name.log" | head -n 1
    done
  done
done
