"""flowgrad: train neural networks written in the `.flow` language."""
from flowgrad.api import Model, Session, StepResult, load, loads
from flowgrad.errors import DeviceError, FlowError, FlowWarning, GraphPathRefused
from flowgrad.training.data import ArrayData, Dataset
from flowgrad.training.loop import train
from flowgrad.ops.user import register_op

__version__ = "0.1.0"
__all__ = ["ArrayData", "Dataset", "DeviceError", "FlowError", "FlowWarning", "GraphPathRefused", "Model", "Session",
           "StepResult", "load", "loads", "register_op", "train"]
