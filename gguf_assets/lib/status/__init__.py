"""What is done and what is not, composed from the stages' own fingerprints and checks.

stages.py (the stages in order, each one's settings and expected fingerprint), states.py (every stage's state
with why: `status`, the studio, the planner), verify_project.py (`gguf-trainer verify`: every recorded file
read again), pace.py (the measured pace and ETA of the work in progress) and run_end.py (the notice at a run's
end). Memory and time planning live in lib/planning/, the training runs in lib/runs/; both build on it.
"""
