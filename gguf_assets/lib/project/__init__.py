"""The project folder: settings and their history, the layout, the typed contracts, fingerprints and
status, and the demo project."""
