"""Profiling a few training steps and breaking their time down into phases.

`capture` records a window of optimizer steps with torch.profiler (`ProfileWindow`,
`--profile-steps A:B`) and annotates phases (`phase("forward")`, free when nothing records);
`breakdown` reads the Chrome trace back and splits each step into data, forward, backward,
exposed communication, optimizer and other, with how much gradient communication backward hid.
"""

from gradsync.profiling.breakdown import (
    StepBreakdown,
    StepTimes,
    analyze_trace,
    format_breakdown,
)
from gradsync.profiling.capture import ProfileWindow, parse_profile_steps, phase

__all__ = [
    "ProfileWindow",
    "StepBreakdown",
    "StepTimes",
    "analyze_trace",
    "format_breakdown",
    "parse_profile_steps",
    "phase",
]
