"""The data plane as a pure, clock-injected state machine (shared by the simulator and the runtime)."""

from daskpipe.sched.api import Action, Dispatch, Dispatcher, Drop, Feedback, Hop, Placement, Request, Reservation, Slot

__all__ = ["Action", "Dispatch", "Dispatcher", "Drop", "Feedback", "Hop", "Placement", "Request", "Reservation", "Slot"]
