#!/usr/bin/env bash
# issue 54: points of the sim sweep (POINTS, named as run.sh names them: wW-rR-sS; default
# w8-r16-s1 and w8-r24-s2), run again (PASSES x 2 runs each, lettered from FIRST: e-h, then
# i-l, ...), the arms' order alternated as in run.sh
cd "$(dirname "$0")/../../.."
source bench/results/pd-any-sim/serve.sh
letters=abcdefghijklmnopqrstuvwxyz
first=${FIRST:-e}
start=$(( $(expr index "$letters" "$first") - 1 ))
for pass in $(seq 0 $(( ${PASSES:-2} - 1 ))); do
  forward=${letters:$((start + 2 * pass)):1}
  backward=${letters:$((start + 2 * pass + 1)):1}
  for point in ${POINTS:-w8-r16-s1 w8-r24-s2}; do
    if [[ ! $point =~ ^w([48])-r([0-9]+)-s([0-9]+)$ ]]; then echo "unknown point $point" >&2; exit 2; fi
    workers=${BASH_REMATCH[1]} rate=${BASH_REMATCH[2]} seed=${BASH_REMATCH[3]}
    if [[ $workers == 4 ]]; then arms=1p3d,2p2d,4x1,4xany reversed=4xany,4x1,2p2d,1p3d
    else arms=4p4d,8x1,8xany reversed=8xany,8x1,4p4d; fi
    run "$point-$forward" $arms $rate $seed
    run "$point-$backward" $reversed $rate $seed
  done
done
echo done
