"""Discrete-event simulation of the data planes on a plan (see docs/simulator.md)."""

from daskpipe.sim.config import SimulationConfig
from daskpipe.sim.simulate import ModelResult, SimResult, find_max_load, simulate, simulate_pool

__all__ = ["ModelResult", "SimResult", "SimulationConfig", "find_max_load", "simulate", "simulate_pool"]
