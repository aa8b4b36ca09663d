"""The dry run: the real engine at any scale on the meta device, and the time model (Note [dry run])."""

from chunkstar.dryrun.comm import SimulatedComm
from chunkstar.dryrun.record import StepRecord, StepRecorder
from chunkstar.dryrun.run import DryRunError, DryRunReport, RankReport, dry_run
from chunkstar.dryrun.timing import HARDWARE, Hardware, Prediction, calibrate_this_machine, hardware_named, predict

__all__ = [
    "HARDWARE",
    "DryRunError",
    "DryRunReport",
    "Hardware",
    "Prediction",
    "RankReport",
    "SimulatedComm",
    "StepRecord",
    "StepRecorder",
    "calibrate_this_machine",
    "dry_run",
    "hardware_named",
    "predict",
]
