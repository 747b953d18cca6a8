"""The benchmark's modes and their labels (no TensorFlow: output.py renders without it)."""
MODES = ("tf", "xla", "stitching")
# Optional fourth mode (--modes ...,baseline or --ablation): stitching with the XLA-like
# baseline planner, timed side by side with the full planner for the ablation.
# "tf_gemm" (--modes ...,tf_gemm): stitching with Options(blas_gemm=False), the matrix
# products left to TF, timed side by side with OpenBLAS's (tf/passes/blas.py).
# "no_attn" (--modes ...,no_attn): stitching with Options(fused_attention=False), each
# attention's products and softmax kernel three ops (tf/passes/attention.py), timed side
# by side with the default's one StitchedAttention.
# "tf_conv" (--modes ...,tf_conv): stitching with Options(conv1x1_gemm=False), every 1x1
# convolution TF's (tf/passes/conv1x1.py), timed side by side with the default's.
EXTRA_MODES = ("baseline", "tf_gemm", "no_attn", "tf_conv")
LABELS = {"tf": "TF", "xla": "XLA", "stitching": "stitched", "baseline": "baseline",
          "tf_gemm": "stitched, TF GEMM", "no_attn": "stitched, attention unfused",
          "tf_conv": "stitched, TF 1x1 conv"}
