# the one run of the issue 54 sim sweep (sourced by run.sh and run-again.sh, from the repository root)
run() {  # name compare rate seed
  timeout 900 .venv/bin/tandem bench serve --compare "$2" --engine sim --num-prompts 80 \
    --prompt-tokens 1000 --max-tokens 64 --request-rate "$3" --warmup 4 --ignore-eos --slo-ttft-ms 4000 --slo-itl-ms 55 \
    --seed "$4" --state-dir "${STATE_DIR:-/tmp/pd-any-sim}" > "${OUT_DIR:-.}/$1.json" 2> "${OUT_DIR:-.}/$1.err"
  echo "$(date +%T) $1 rc=$?"
}
