"""Relay's training pipeline. Importing it applies $RELAY_CPU_ISA (pipeline/cpu_isa.py) while that
can still take effect: before torch has run anything."""

from pipeline import cpu_isa as _cpu_isa

_cpu_isa.apply()
