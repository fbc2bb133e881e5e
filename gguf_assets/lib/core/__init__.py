"""Building blocks every stage uses: atomic writes, the folder lock, stamps, liveness, fault points, errors, Markdown
tables, the float16 range."""
