"""Materials: hub downloads and the pinned materials manifest."""
