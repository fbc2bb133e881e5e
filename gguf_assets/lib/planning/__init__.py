"""Planning a project before it runs: how much memory its pair needs and how long its work takes.

estimate.py (the memory of the teacher, the student and the adapter's training, and where the teacher goes on the
GPUs: `gguf-trainer estimate`, the studio's Memory panel) and time_estimate.py (the precompute's and the training's
time, measured where this machine has measured it (lib/status/pace.py), else scaled from a reference). It reads the
status (the measured pace of work in progress), so it sits above lib/status/; nothing in lib/ below it imports it.
"""
