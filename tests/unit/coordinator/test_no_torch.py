"""The coordinator's placement, registry and balance check, and the planner, run without torch: a fresh
interpreter imports them and does their work (a checkpoint's headers checked, a plan made, memory caps
computed for a topology), and torch is still not loaded. Only the rendezvous store (coordinator/process.py)
may bring it in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from shardmesh.engine.synthetic import write_checkpoint

ROOT = Path(__file__).resolve().parents[3]

# Each step reaches code that built meta-device models (counting parameters, checking headers) before
# planning went analytic: a torch import anywhere on these paths shows up in sys.modules.
WORK = """
import json, sys
from pathlib import Path

from coordinator import calibration, placement, registry
from shardmesh.core.topology import ModelSpec, ServingLimits
from shardmesh.planning import planner
from shardmesh.planning.devices import parse_devices
from shardmesh.planning.memory import load_model

model_dir = Path(sys.argv[1])
limits = ServingLimits(2, 64, 16)
model = load_model(model_dir)
chosen = planner.plan(model, parse_devices("a:1x1GiB,b:1x1GiB"), planner.PlanOptions("float32", limits))
spec = ModelSpec(str(model_dir), "float32", model.cfg.architecture, model.cfg.num_layers, model.cfg.hidden_size,
                 model.cfg.vocab_size, model.cfg.max_context)
reg = registry.Registry(model=spec, pp=2, tp=1, limits=limits, store_host="127.0.0.1", store_port=1,
                        heartbeat_timeout=5, split=chosen.layer_split)
for i in range(2):
    reg.register(registry.Registration(f"127.0.0.1:{5000 + i}", registry.Device("cpu", "cpu", 2**30)))
caps = calibration.memory_caps(reg.store.current(), {w: 2**30 for w in reg.workers()}, {})
torch = sorted(m for m in sys.modules if m.split(".")[0] == "torch")
print(json.dumps({"pp": chosen.pp, "caps": caps, "torch": torch}))
"""


def run_work(model_dir: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", WORK, str(model_dir)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_planning_and_placement_never_load_torch(tmp_path: Path) -> None:
    model_dir = write_checkpoint(tmp_path / "m", {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96, "max_position_embeddings": 64,
    })  # fmt: skip
    got = run_work(model_dir)
    assert got["pp"] == 2 and got["caps"] is not None and min(got["caps"]) >= 1, got  # the work was done
    assert got["torch"] == [], got["torch"]
