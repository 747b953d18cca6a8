"""The shared lowering every backend builds on (see codegen/__init__.py)."""
