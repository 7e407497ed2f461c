"""README's Python examples run as written, in order, against a small model (issue 12)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


@pytest.mark.skipif(not README.is_file(), reason="no source tree beside the tests")
def test_readme_python_examples_run(tmp_path, monkeypatch):
    blocks = _blocks()
    assert len(blocks) >= 2
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
        for i, code in enumerate(blocks):
            exec(compile(code, f"README.md python block {i + 1}", "exec"), ns)
    finally:
        if "ck" in ns:
            ns["ck"].close()
    assert ns["r"].step == 20  # block 1: the last checkpoint of interval 10 within 25 steps
    assert ns["opts"].history.keep_every == 100
