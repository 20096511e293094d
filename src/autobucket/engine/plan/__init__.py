"""The forward plan (`forward_plan.py`): which backend (`backends.py`) runs each op family (`ops.py`) of a
call's forwards, chosen once per call."""

from autobucket.engine.plan.backends import Backend, register_backend
from autobucket.engine.plan.forward_plan import ForwardPlan, OpChoice, choose_plan

__all__ = ["Backend", "ForwardPlan", "OpChoice", "choose_plan", "register_backend"]
