"""The top of lib/: what is done and what is not, composed from the stages' own fingerprints and checks.

stages.py (the stages in order, each one's settings and expected fingerprint), states.py (every stage's state
with why: `status`, the studio, the planner), verify_project.py (`gguf-trainer verify`: every recorded file
read again) and estimate.py (the memory a project's pair needs). Nothing in lib/ imports this package.
"""
