import os
import sys
from pathlib import Path

import torch

# Tests share 2 cores with the processes they start; one intra-op thread keeps timings sane.
torch.set_num_threads(1)
os.environ.setdefault("SHARDMESH_LOG_LEVEL", "warning")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
