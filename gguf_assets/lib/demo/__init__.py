"""The demo project: tiny random-weight teacher and student models, a prompt dataset, and the settings that train
an adapter from them in minutes on a CPU. Nothing in the pipeline imports it; `gguf-trainer demo`, the tests
and the benchmarks do."""

# The demo's training steps, here and not in demo.py so that the CLI's --help names them without loading torch.
# Since ggk's resampler (#55), measured on 2 busy cores (seed 0, the teacher reading LLaDA-Image's template, the
# student's residual scale 0.1): 128 wide, lr 4e-3: 1000 steps 0.900, 1500 0.908; lr 6e-3: 1000 steps 0.904. 64 wide
# (one head) stays near 0.84-0.86 at 1000 steps whatever else changes (two blocks 0.85, 4,000 prompts 0.85). Before
# #55 (the product's own adapter, 4 heads of 16, reading the student's embeddings): 1000 steps 0.9137.
# Since #68 the demo starts at the query rows' means, the rows at 10 times the lr (presets.CPU_START): 1,200 steps
# 0.9140, 0.9070 before.
DEMO_STEPS = 1200
