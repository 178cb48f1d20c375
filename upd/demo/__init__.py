"""A self-contained demo: train a small makemore-style MLP on names and record it with torch-upd."""
