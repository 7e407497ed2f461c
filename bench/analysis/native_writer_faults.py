import sys, time, shutil, os
sys.path.insert(0, os.environ.get("PCCHECK_TREE", "."))
import torch
sys.argv = ["x"]
from bench.resilience.tiers import _threads_cpu, _per_iter, _model
import pccheck
torch.set_num_threads(1)
SIZE = 64 << 20
model, opt = _model(SIZE); opt.step()
d = "/tmp/w29/nf"; m = "/dev/shm/w29-nf"
shutil.rmtree(d, ignore_errors=True); shutil.rmtree(m, ignore_errors=True)
mode = sys.argv[-1]
ck = pccheck.Checkpointer(model, opt, path=d, interval=(10**9 if os.environ.get("MODE") == "memory" else 1),
                          **({"memory_interval": 1, "memory_dir": m} if os.environ.get("MODE") == "memory" else {}))
for s in range(1, 6):
    opt.step(); ck.maybe_checkpoint(s); time.sleep(0.1)
ck.wait()
b = _threads_cpu()
N = 10
for s in range(6, 6 + N):
    opt.step(); ck.maybe_checkpoint(s); time.sleep(0.1)
ck.wait()
print(os.environ.get("MODE"), _per_iter(b, _threads_cpu(), N))
ck.close()
shutil.rmtree(d, ignore_errors=True); shutil.rmtree(m, ignore_errors=True)
