"""lib/training/optimizer.py: the trainer's AdamW works as torch's own and leaves torch._dynamo unloaded."""

import subprocess
import sys

PROBE = """
import sys, time
import torch
from gguf_assets.lib.training.optimizer import adamw

torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
start = time.process_time()
optimizer = adamw(model.parameters(), lr=0.01, weight_decay=0.01) if sys.argv[1] == "ours" else \\
    torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
for _ in range(3):
    optimizer.zero_grad(set_to_none=True)
    model(torch.ones(2, 8)).square().sum().backward()
    optimizer.step()
optimizer.load_state_dict(optimizer.state_dict())
print(int("torch._dynamo" in sys.modules), round(time.process_time() - start, 3), model.weight.sum().item())
"""


def _probe(which: str) -> tuple[bool, float, float]:
    done = subprocess.run([sys.executable, "-c", PROBE, which], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded, cpu_s, weights = done.stdout.split()
    return loaded == "1", float(cpu_s), float(weights)


def test_the_trainer_s_adamw_steps_as_torch_s_without_loading_dynamo():
    """torch's own AdamW loads torch._dynamo on construction (about 1 CPU s); the trainer's does not, and its steps,
    zero_grad, state_dict and load_state_dict give the same weights."""
    theirs, ours = _probe("torch"), _probe("ours")
    assert theirs[0] and not ours[0], (theirs, ours)
    assert ours[2] == theirs[2]
    print(f"optimizer setup and 3 steps: {theirs[1]:.2f} CPU s with torch.optim.AdamW, {ours[1]:.2f} with adamw()")
