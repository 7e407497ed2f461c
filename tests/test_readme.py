"""The Python examples of README.md and the guides run as written, in order, against a small model:
README's first, then each guide's in the order the site's nav lists them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# Not here: remote.md and memory.md, whose examples need an S3 server and two nodes; the same calls
# run in test_remote.py (a SeaweedFS started by a fixture) and test_memory_tier.py (two torchrun agents).
# preemption.md's examples install signal handlers and poll metadata URLs; test_preemption.py runs
# the same calls against real signals, a local notice endpoint and SeaweedFS.
GUIDES = ["resume", "distributed", "spread", "transparent", "integrations", "tuning", "gpu", "export", "dataloaders",
          "incremental"]


def _blocks() -> list[tuple[str, str]]:
    out = []
    for doc in [README, *(ROOT / "docs" / "guide" / f"{g}.md" for g in GUIDES)]:
        for code in re.findall(r"^```python\n(.*?)^```", doc.read_text(), flags=re.S | re.M):
            out.append((doc.relative_to(ROOT).as_posix(), code))
    return out


@pytest.mark.skipif(not README.is_file(), reason="no source tree beside the tests")
def test_readme_python_examples_run(tmp_path, monkeypatch):
    blocks = _blocks()
    assert len(blocks) >= 4 and {d for d, _ in blocks} >= {"README.md", "docs/guide/resume.md", "docs/guide/spread.md"}
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    batch = (torch.randn(16, 8), torch.randn(16, 1))

    def train_step(b):
        x, y = b
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        return loss

    ns = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler, "batch": batch,
          "train_step": train_step, "start": 0, "total": 25}
    try:
        for i, (doc, code) in enumerate(blocks):
            exec(compile(code, f"{doc} python block {i + 1}", "exec"), ns)
    finally:
        if "ck" in ns:
            ns["ck"].close()
    assert ns["r"].step == 20  # block 1: the last checkpoint of interval 10 within 25 steps
    assert ns["opts"].disk.keep_every == 1000 and ns["opts"].disk.keep_last == 3
