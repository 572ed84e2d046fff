#!/usr/bin/env bash
# Issue 49's two consecutive calls to a lent GPU machine (docs/benchmarks.md, "bench/gpu_campaign.py"). Here first:
#   .venv/bin/python bench/gpu_carry.py split --pieces 2 && mkdir -p .whl && $(python bench/gpu_carry.py wheels)
# then, with the device tool, within the machine's 30 s warm window of each other:
#   call 1: bash bench/gpu_lease.sh 1   carry [".whl", ".gpu/piece0"]   the wheels, piece 0, the campaign's smoke on cuda,
#                                       gpu_check's packing section (issue 50)
#   call 2: bash bench/gpu_lease.sh 2   carry [".whl", ".gpu/piece1"]   piece 1, reassemble, convert, quickstart, campaign
# Everything it keeps between calls is under /tmp (a warm machine keeps it); $OUT comes back.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "gpu_lease: the wheels did not install"; exit 2; }
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
case "${1:-}" in
  1)
    python3 bench/gpu_carry.py receive .gpu/piece0 --store /tmp/adarl-carry || exit 2
    timeout 150 python3 bench/gpu_campaign.py --smoke --tiny /tmp/adarl-tiny --out "$OUT/smoke" \
      --runs /tmp/adarl-smoke-runs --deadline-s 100 --quickstart-s 45 2>&1 | tail -25
    python3 bench/gpu_campaign.py --report "$OUT/smoke/runs.json.gz" 2>&1 | tail -12
    # issue 50's GPU target: the 0.5B and 1.5B updates at 8 rollouts a prompt, padded / packed / shared prefix
    # (each shape prints its line as it finishes, so a timeout keeps what ran)
    timeout 100 python3 bench/gpu_check.py --sections packing --out "$OUT/gpu_check_packing.json" 2>&1 | tail -6
    ;;
  2)
    python3 bench/gpu_carry.py receive .gpu/piece1 --store /tmp/adarl-carry || exit 2
    t0=$(date +%s)
    python3 bench/gpu_carry.py assemble --store /tmp/adarl-carry --convert /tmp/adarl-carry/hf 2>&1 | tail -3 || exit 2
    echo "gpu_lease: reassembled and converted in $(( $(date +%s) - t0 )) s"
    python3 bench/gpu_campaign.py --model /tmp/adarl-carry/hf --out "$OUT" --deadline-s "${DEADLINE_S:-520}" \
      2>&1 | tee "$OUT/log.txt" | tail -40
    python3 bench/gpu_campaign.py --report "$OUT/runs.json.gz" 2>&1 | tail -14
    ;;
  *) echo "usage: bash bench/gpu_lease.sh 1|2"; exit 2 ;;
esac
