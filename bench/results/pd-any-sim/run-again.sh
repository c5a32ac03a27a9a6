#!/usr/bin/env bash
# issue 54: the two points of the sim sweep past 5% (w8-r16-s1, w8-r24-s2), run again
# (PASSES x 2 runs each, lettered from FIRST: e-h, then i-l), the arms' order alternated as in run.sh
cd "$(dirname "$0")/../../.."
source bench/results/pd-any-sim/serve.sh
letters=abcdefghijklmnopqrstuvwxyz
first=${FIRST:-e}
start=$(( $(expr index "$letters" "$first") - 1 ))
for pass in $(seq 0 $(( ${PASSES:-2} - 1 ))); do
  forward=${letters:$((start + 2 * pass)):1}
  backward=${letters:$((start + 2 * pass + 1)):1}
  run "w8-r16-s1-$forward" 4p4d,8x1,8xany 16 1
  run "w8-r16-s1-$backward" 8xany,8x1,4p4d 16 1
  run "w8-r24-s2-$forward" 4p4d,8x1,8xany 24 2
  run "w8-r24-s2-$backward" 8xany,8x1,4p4d 24 2
done
echo done
