"""The demo project: tiny random-weight teacher and student models, a prompt dataset, and the settings that train
an adapter from them in minutes on a CPU. Nothing in the pipeline imports it; `gguf-trainer demo`, the tests
and the benchmarks do."""
