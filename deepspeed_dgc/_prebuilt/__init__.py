"""Fused ops built at install time (``DS_BUILD_DGC=1 pip install .``) land here as extension modules."""
