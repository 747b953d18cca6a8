"""The benchmark's modes and their labels (no TensorFlow: output.py renders without it)."""
MODES = ("tf", "xla", "stitching")
# Optional fourth mode (--modes ...,baseline or --ablation): stitching with the XLA-like
# baseline planner, timed side by side with the full planner for the ablation.
EXTRA_MODES = ("baseline",)
LABELS = {"tf": "TF", "xla": "XLA", "stitching": "stitched", "baseline": "baseline"}
