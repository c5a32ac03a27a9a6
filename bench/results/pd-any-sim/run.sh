#!/usr/bin/env bash
# issue 54 sim sweep: fixed splits beside Nxany at 4 and 8 workers, two loads each; per point
# seeds 1 and 2, each run twice with the arms' order reversed between the two runs
cd "$(dirname "$0")/../../.."
source bench/results/pd-any-sim/serve.sh
for seed in 1 2; do
  for rate in 8 16; do
    run "w4-r$rate-s$seed-a" 1p3d,2p2d,4x1,4xany $rate $seed
    run "w4-r$rate-s$seed-b" 4xany,4x1,2p2d,1p3d $rate $seed
  done
  for rate in 16 24; do
    run "w8-r$rate-s$seed-a" 4p4d,8x1,8xany $rate $seed
    run "w8-r$rate-s$seed-b" 8xany,8x1,4p4d $rate $seed
  done
done
echo done
