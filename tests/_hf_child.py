"""A real Hugging Face Trainer (or Accelerate) run for tests/test_hf.py.

    python _hf_child.py trainer OUT MODE MAX_STEPS [KILL_AT [SETTING]]
    python _hf_child.py accelerate OUT

trainer: a tiny GPT-2 built from a config (no downloads, dropout on) trains MAX_STEPS steps of
4 samples on CPU over 16 batches an epoch, logging every 5 steps. SETTING "plain" (default):
checkpoints every 5 steps, a linear schedule with warmup; "eval": checkpoints every 4 steps, an
evaluation every 4 steps that feeds ReduceLROnPlateau and the best metric (eval_loss). MODE:
  "own"        the Trainer's own checkpoints (OUT/checkpoint-N), no pccheck;
  "own:DIR"    the same, resumed with resume_from_checkpoint=DIR;
  "pccheck"    pccheck.hf.Callback(OUT/pc) at the same interval, resumed from cb.latest(), which is copied
               to OUT/resumed-from (for the test to compare with the Trainer's own files);
KILL_AT: SIGKILL the process at the end of that step. At the end, it prints ``RESUMED <dir>``,
``HISTORY <json>`` (the log history) and saves the final weights to OUT/final.pt.

accelerate: a model with BatchNorm, AdamW and StepLR under Accelerate with
pccheck.hf.register_accelerate(OUT/store); saves at step 5, trains on, loads it back, and prints
``SAME <bool> PROCESSES <n>`` for the restored weights (every process's) and ``FILES <json>`` for
what save_state wrote. Also run by torchrun on several CPU processes (gloo).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import sys

import torch

from _leave import leave


def trainer(out: str, mode: str, steps: int, kill_at: int, setting: str) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    import pccheck.hf

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=32))
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 97, (64, 16), generator=g)]
    every = 4 if setting == "eval" else 5
    more: dict = dict(lr_scheduler_type="linear", warmup_steps=3)
    if setting == "eval":
        more = dict(lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="steps", eval_steps=every,
                    per_device_eval_batch_size=4, metric_for_best_model="eval_loss")
    args = TrainingArguments(out, max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-3,
                             logging_steps=5, save_steps=every, save_strategy="steps", report_to=[], seed=0,
                             data_seed=0, use_cpu=True, disable_tqdm=True, **more)
    evals = {"eval_dataset": data[:8]} if setting == "eval" else {}

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    callbacks: list = [Kill()]
    resume = mode[4:] if mode.startswith("own:") else None
    if mode == "pccheck":
        cb = pccheck.hf.Callback(os.path.join(out, "pc"), interval=every)
        callbacks.insert(0, cb)
        resume = cb.latest()
        if resume is not None:
            shutil.copytree(resume, os.path.join(out, "resumed-from"), dirs_exist_ok=True)
    t = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks, **evals)
    t.train(resume_from_checkpoint=resume)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(out, "final.pt"))
    print("RESUMED", resume)
    print("HISTORY", json.dumps(t.state.log_history))


def accelerate(out: str) -> None:
    from accelerate import Accelerator

    import pccheck.hf

    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    model, opt, sched = acc.prepare(model, opt, sched)
    hooks = pccheck.hf.register_accelerate(acc, os.path.join(out, "store"))

    def step() -> None:
        loss = model(torch.randn(4, 8)).pow(2).mean()
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()

    for _ in range(5):
        step()
    saved = os.path.join(out, "step-5")
    acc.save_state(saved)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    ref_opt, ref_sched = copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict())
    for _ in range(3):
        step()
    acc.load_state(saved)
    same = all(torch.equal(ref[k], v) for k, v in model.state_dict().items())
    same_opt = all(torch.equal(a, b) for s in ref_opt["state"] for a, b in
                   zip(ref_opt["state"][s].values(), opt.state_dict()["state"][s].values()))
    hooks.close()
    ok = torch.tensor([int(same and same_opt and sched.state_dict() == ref_sched)])
    every = acc.gather(ok)  # under torchrun: each process loaded what the main process saved
    if acc.is_main_process:
        print("SAME", bool(every.all()), "PROCESSES", len(every))
        print("FILES", json.dumps(sorted(os.listdir(saved))))
        print("COMMITTED", sum(s.outcome == "committed" for s in hooks.stats()))
    leave()  # (under torchrun: gloo)


if __name__ == "__main__":
    if sys.argv[1] == "trainer":
        kill = int(sys.argv[5]) if len(sys.argv) > 5 else -1
        trainer(sys.argv[2], sys.argv[3], int(sys.argv[4]), kill, sys.argv[6] if len(sys.argv) > 6 else "plain")
    else:
        accelerate(sys.argv[2])
