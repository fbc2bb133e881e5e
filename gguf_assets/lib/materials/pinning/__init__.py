"""Resolution and pinning (the materials step): ``resolve.py`` turns each configured source into a pinned folder and
writes the manifest, ``hub_files.py`` chooses which files of a hub repo are fetched, ``checks.py`` refuses a folder
before anything loads it."""
