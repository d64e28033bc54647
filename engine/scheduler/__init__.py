"""Continuous-batching scheduler, split by phase (running, waiting, remote KV, finalize)."""
from engine.scheduler.output import ScheduledSeq, SchedulerOutput
from engine.scheduler.scheduler import Scheduler, SchedulerConfig

__all__ = ["ScheduledSeq", "Scheduler", "SchedulerConfig", "SchedulerOutput"]
