"""The benchmark's modes and their labels (no TensorFlow: output.py renders without it)."""
MODES = ("tf", "xla", "stitching")
# Optional fourth mode (--modes ...,baseline or --ablation): stitching with the XLA-like
# baseline planner, timed side by side with the full planner for the ablation.
# "tf_gemm" (--modes ...,tf_gemm): stitching with Options(blas_gemm=False), the matrix
# products left to TF, timed side by side with OpenBLAS's (tf/passes/blas.py).
# "no_attn" (--modes ...,no_attn): stitching with Options(fused_attention=False), each
# attention's products and softmax kernel three ops (tf/passes/attention.py), timed side
# by side with the default's one StitchedAttention.
EXTRA_MODES = ("baseline", "tf_gemm", "no_attn")
LABELS = {"tf": "TF", "xla": "XLA", "stitching": "stitched", "baseline": "baseline",
          "tf_gemm": "stitched, TF GEMM", "no_attn": "stitched, attention unfused"}
