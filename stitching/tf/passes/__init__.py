"""The GraphDef passes the driver (tf/pipeline.py) runs, one module each."""
