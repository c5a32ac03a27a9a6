#!/usr/bin/env bash
# issue 54: the points of the sim sweep past 5% (POINTS, default w8-r16-s1 and w8-r24-s2), run
# again (PASSES x 2 runs each, lettered from FIRST: e-h, then i-l, ...), the arms' order
# alternated as in run.sh
cd "$(dirname "$0")/../../.."
source bench/results/pd-any-sim/serve.sh
letters=abcdefghijklmnopqrstuvwxyz
first=${FIRST:-e}
start=$(( $(expr index "$letters" "$first") - 1 ))
for pass in $(seq 0 $(( ${PASSES:-2} - 1 ))); do
  forward=${letters:$((start + 2 * pass)):1}
  backward=${letters:$((start + 2 * pass + 1)):1}
  for point in ${POINTS:-w8-r16-s1 w8-r24-s2}; do
    case $point in
      w8-r16-s1) rate=16 seed=1 ;;
      w8-r24-s2) rate=24 seed=2 ;;
      *) echo "unknown point $point" >&2; exit 2 ;;
    esac
    run "$point-$forward" 4p4d,8x1,8xany $rate $seed
    run "$point-$backward" 8xany,8x1,4p4d $rate $seed
  done
done
echo done
