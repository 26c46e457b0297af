import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "workers"))

# DeepSpeed JIT-builds its CPU shared-memory comm op on the first init_distributed. Keep that
# build in this checkout: another venv sharing ~/.cache/torch_extensions rebuilds it with its
# own include paths, and a build killed half-way leaves a lock that makes every later launch
# wait forever. No build runs before the session starts, so a lock here is stale.
EXT_DIR = os.path.join(ROOT, "build", "torch_extensions")
os.environ["TORCH_EXTENSIONS_DIR"] = EXT_DIR
for dirpath, _, files in os.walk(EXT_DIR):
    if "lock" in files:
        os.unlink(os.path.join(dirpath, "lock"))
