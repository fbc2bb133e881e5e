"""The project folder, the foundation every stage stands on: settings and their history, the layout, the
typed contracts between stages, format versions, presets and the teacher choice."""
