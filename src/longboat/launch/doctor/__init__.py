"""``longboat doctor``, the preflight check: versions, backends, network, shared memory and
the config's batch arithmetic, each problem with its fix. See docs/doctor.md."""

from longboat.launch.doctor.findings import Finding, exit_code
from longboat.launch.doctor.preflight import DoctorOptions, doctor

__all__ = ["DoctorOptions", "Finding", "doctor", "exit_code"]
