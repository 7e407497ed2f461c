#!/bin/bash
# A/B: base then new, memory config only, short loop
for i in 1 2; do
for t in base new; do
  d=/tmp/w29/base; [ $t = new ] && d=/work/wt-29
  (cd $d && /work/main/.venv/bin/python -m bench.tiers --configs memory --iters 8 --warmup 3 --restore-repeats 3 --json /tmp/w29/ab-$t-$i.json > /tmp/w29/ab-$t-$i.log 2>&1)
  python3 -c "
import json; d=json.load(open('/tmp/w29/ab-$t-$i.json')); r=d['runs']['memory'][0][1]; r0=d['runs']['memory'][0][0]
print('$t', 'peer', [round(x,3) for x in r['node_loss_peer_all_s']], 'raw', [round(x,3) for x in r['raw_link_all_s']], 'part', [round(x,3) for x in r['node_loss_part_all_s']], 'crash', round(r['crash_memory_s'],3), round(r0['crash_memory_s'],3), 'ratio', round(d['ratios']['peer_vs_raw_gloo'],3))"
done; done
