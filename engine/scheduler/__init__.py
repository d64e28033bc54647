"""Continuous-batching scheduler: the phases of a step in `scheduler` (load ahead, running,
waiting, finalize) and the remote-KV phase (connector lookups and loads) in `remote_kv`. The
messages it exchanges with the model runner are in `engine.step`."""
from engine.scheduler.scheduler import Scheduler, SchedulerConfig
from engine.step import ModelRunnerOutput, ScheduledSeq, SchedulerOutput

__all__ = ["ModelRunnerOutput", "ScheduledSeq", "Scheduler", "SchedulerConfig", "SchedulerOutput"]
