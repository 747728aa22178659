"""Discrete-event simulator of a tetri_server cluster. Instances run the SAME policy objects as
the workers (``tetri_server.policy``) on a virtual clock; a roofline cost model stands in for
the model runner. No torch. Entry points: ``Simulation`` (``cluster.py``), ``tetri-server sim``
(``cli.py``), the paper's table (``paper.py``). See docs/simulator.md.
"""

from __future__ import annotations

from tetri_server.sim.cluster import MODES, SimConfig, SimResult, Simulation
from tetri_server.sim.cost import CostModel, knee_chunk_size
from tetri_server.sim.events import EventLoop
from tetri_server.sim.instances import SimRequest
from tetri_server.sim.predictor import EmulatedPredictor
from tetri_server.sim.profiles import Hardware, ModelShape, load_hardware, load_model

__all__ = [
    "MODES",
    "CostModel",
    "EmulatedPredictor",
    "EventLoop",
    "Hardware",
    "ModelShape",
    "SimConfig",
    "SimRequest",
    "SimResult",
    "Simulation",
    "knee_chunk_size",
    "load_hardware",
    "load_model",
]
