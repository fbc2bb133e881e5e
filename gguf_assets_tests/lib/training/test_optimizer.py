"""lib/training/optimizer.py: the trainer's AdamW works as torch's own and leaves torch._dynamo unloaded."""

import contextlib
import io
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


def test_the_trainer_s_adamw_steps_as_torch_s_without_loading_dynamo():
    """torch's own AdamW loads torch._dynamo on its first use (about 1 CPU s); the trainer's does not, in a fresh
    interpreter, and its steps, zero_grad, state_dict and load_state_dict give torch's weights (computed here, where
    torch._dynamo is loaded already)."""
    done = subprocess.run([sys.executable, "-c", PROBE, "ours"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded, cpu_s, weights = done.stdout.split()
    assert loaded == "0", "the trainer's AdamW loaded torch._dynamo"
    namespace = {"__name__": "probe"}
    sys.argv, argv = ["-c", "torch"], sys.argv
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            exec(PROBE, namespace)
    finally:
        sys.argv = argv
    assert float(weights) == float(printed.getvalue().split()[2])
    print(f"the trainer's optimizer, made and stepped 3 times: {cpu_s} CPU s")
