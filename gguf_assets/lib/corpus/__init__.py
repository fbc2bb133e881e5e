"""The corpus: prompt file readers; clean, dedupe, split."""
