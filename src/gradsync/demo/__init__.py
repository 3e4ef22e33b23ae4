"""The demo: a complete gradsync training script on a real (bundled) dataset."""
