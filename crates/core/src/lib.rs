//! The routing brain: fleet view, prefix index, policies. Pure: no I/O, no async, no clock.
