#!/bin/bash
# A/B 2: before issue 27 (32fc816) against the branch tip (0d3ec8a: items 4, 5, 7, 9), interleaved, 3 rounds.
PY=/work/main/.venv/bin/python
O=/tmp/ab27-out2
for rep in 1 2 3; do
  for side in before after; do
    tree=/tmp/base27; [ $side = after ] && tree=/tmp/after27b
    cd $tree && flock -x /tmp/pccheck-bench.lock env PYTHONPATH=$tree $PY -m bench.persist --sizes 1GiB --repeats 5 --systems pccheck,raw_odirect --json $O/persist-$side-$rep.json --dir /tmp/ab27-scratch > $O/persist-$side-$rep.log 2>&1
    echo "persist $side $rep rc=$? $(date -u +%T)" >> $O/progress
    cd $tree && flock -x /tmp/pccheck-bench.lock env PYTHONPATH=$tree $PY -m bench.overhead --size 256MiB --workloads emulated --systems none,pccheck_N2 --intervals 1,10 --iters 40 --repeats 3 --quiet-wait 10 --json $O/overhead-$side-$rep.json --dir /tmp/ab27-scratch > $O/overhead-$side-$rep.log 2>&1
    echo "overhead $side $rep rc=$? $(date -u +%T)" >> $O/progress
  done
done
echo done >> $O/progress
