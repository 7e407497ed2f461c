#!/bin/bash
# A/B: the tree before issue 27's refactor (32fc816) against after items 4, 5, 7 (efb531c), interleaved.
PY=/work/main/.venv/bin/python
for rep in 1 2; do
  for side in before after; do
    tree=/tmp/base27; [ $side = after ] && tree=/tmp/after27
    cd $tree && flock -x /tmp/pccheck-bench.lock env PYTHONPATH=$tree $PY -m bench.persist --sizes 256MiB --repeats 3 --systems pccheck,raw_odirect --json /tmp/ab27-out/persist-$side-$rep.json --dir /tmp/ab27-scratch > /tmp/ab27-out/persist-$side-$rep.log 2>&1
    echo "persist $side $rep rc=$?" >> /tmp/ab27-out/progress
  done
  for side in before after; do
    tree=/tmp/base27; [ $side = after ] && tree=/tmp/after27
    cd $tree && flock -x /tmp/pccheck-bench.lock env PYTHONPATH=$tree $PY -m bench.overhead --quick --workloads emulated --systems none,pccheck_N2 --intervals 1,10 --quiet-wait 10 --json /tmp/ab27-out/overhead-$side-$rep.json --dir /tmp/ab27-scratch > /tmp/ab27-out/overhead-$side-$rep.log 2>&1
    echo "overhead $side $rep rc=$?" >> /tmp/ab27-out/progress
  done
done
echo done >> /tmp/ab27-out/progress
