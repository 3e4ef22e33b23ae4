"""Helper package used by some red-team scripts (not a script itself)."""
