"""The planner: the only module that decides which path a backward takes."""
from flowgrad.planner.plan import Plan, Refusal, make_plan

__all__ = ["Plan", "Refusal", "make_plan"]
