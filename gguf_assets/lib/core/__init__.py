"""Building blocks every stage uses: atomic writes, the folder lock, stamps, liveness, fault points, errors."""
