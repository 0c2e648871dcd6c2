"""Relay's training pipeline. Importing it applies two process-wide settings while they can still
take effect: $RELAY_CPU_ISA (pipeline/cpu_isa.py) before torch has run anything, and
$RELAY_HOST_MALLOC (pipeline/host_memory.py: freed memory kept in the process) before any large
tensor is allocated. A bad value of either ends the process with one line naming it."""

from pipeline import cpu_isa as _cpu_isa
from pipeline import host_memory as _host_memory

try:
    _cpu_isa.apply()
    _host_memory.apply()
except ValueError as _err:
    raise SystemExit(f"relay: {_err}") from None
